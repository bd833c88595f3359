"""`trainyard bench pipeline --replicas R`: a pipeline of S stages each held by R replicas (docs/pipeline.md,
Replicas) against data parallel over the whole world and torch's own stages x replicas, on `bench
broadcast`'s model (an MLP of 21M parameters, 84 MB in fp32, in 20 equal layers; batch 32).

    trainyard bench pipeline --replicas 2 --hosts 2 --link 1gbit     # 2 hosts x 2 ranks, shaped links (root)
    trainyard bench pipeline --replicas 2 --json                     # world 4 on the loopback

One pool of world = S x R ranks (engine/processes/procpool.py; with `--hosts H`, spread over H emulated hosts,
consecutive ranks per host: engine/processes/cluster.py) runs every variant in turn, in rounds (A B C D E, A B
C D E, ...), so that the machine's drift hits every variant alike (the job: pipeline_grid_job.py):

    ddp            trainyard's ddp over the whole world (`parallel.strategy = "ddp"`)
    sharded        trainyard's sharded over the whole world, 4 streams, 16 slices, the forward gated
                   (`bench broadcast`'s sharded-4-gated)
    torch-pp-ddp   torch.distributed.pipelining's Schedule1F1B over the stages, torch's DDP across each
                   stage's replicas (engine/bench/torch_pp_ddp.py)
    SxR-ddp        trainyard's pipeline, `[parallel.pipeline] stages = S`, `data = "ddp"`
    SxR-sharded    the same with `data = "sharded"`: while the config check refuses it, reported as not run
                   with the check's message (the bench goes on)

Every variant is built from its config table as a run builds it (a refusal is the config check's own), with
1F1B, the pipeline's micro-batches per replica, `rebalance = "off"` and the stages cut where the parameters
split evenly (the same cut for torch's); `order` is the default, `stage`: a stage's replicas on one host, so
only a boundary's activations cross between hosts. Figures per variant: the median over the timed steps of the
slowest rank's step (`step_ms`), samples/s, its throughput over ddp's, and with `--hosts` the bytes its busiest
host's link carried each step in its busier direction (headers included: /proc/net/dev inside the host) and
their time at the link's rate, which a probe measures every round (engine/bench/linerate.py). The goals, for
the cluster's link-bound case (with `--hosts`; on the loopback reported, not judged), judged on every round's
ratio (engine/bench/verdict.py): SxR throughput at least 2x ddp's, at least 1.05x sharded's and torch-pp-ddp's.
"""

from __future__ import annotations

import os
import statistics

from engine.bench.verdict import judge, say

SHARDED = {"streams": 4, "slices": 16, "overlap_forward": True}   # `bench broadcast`'s sharded-4-gated
GOALS = {"ddp": 2.0, "sharded": 1.05, "torch-pp-ddp": 1.05}       # SxR's throughput over each, at least
HIDDEN, DEPTH, BATCH, MICRO = 1024, 20, 32, 4


def variants_of(stages: int, replicas: int) -> list[str]:
    return ["ddp", "sharded", "torch-pp-ddp", f"{stages}x{replicas}-ddp", f"{stages}x{replicas}-sharded"]


def even_split(model, stages: int) -> list[list[str]]:
    """The layers cut into `stages` contiguous runs of about equal parameters, each cut before a layer with
    parameters where the run's parameters come closest to their share (an activation stays with its layer)."""
    names = model.names
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    before = [sum(counts[:i]) for i in range(len(counts))]
    cuts = [0]
    for c in range(1, stages):
        left = stages - c   # stages still to cut: each needs a layer with parameters of its own
        places = [i for i in range(cuts[-1] + 1, len(names)) if counts[i]]
        places = places[:len(places) - left + 1] if left > 1 else places
        cuts.append(min(places, key=lambda i: abs(before[i] - sum(counts) * c / stages)))
    bounds = [*cuts, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def table_of(variant: str, world: int, stages: int, hidden: int, depth: int, batch: int, micro_batches: int,
             partition: list[list[str]]) -> dict | None:
    """The variant's config table (None: torch-pp-ddp, which is not trainyard's)."""
    if variant == "torch-pp-ddp":
        return None
    parallel: dict = {"world_size": world, "sharded": dict(SHARDED)}
    if variant in ("ddp", "sharded"):
        parallel["strategy"] = variant
    else:
        parallel.update(strategy="pipeline", pipeline={
            "stages": stages, "data": variant.rsplit("-", 1)[1], "micro_batches": micro_batches, "schedule": "1f1b",
            "rebalance": "off", "partition": partition})
    return {"model": {"name": "mlp", "hidden": hidden, "depth": depth},
            "data": {"name": "synthetic", "batch_size": batch, "features": hidden},
            "optim": {"name": "sgd", "lr": 0.01}, "parallel": parallel}


def refusal(table: dict | None) -> str | None:
    """The config check's refusal of a variant's table (None: it would run)."""
    if table is None:
        return None
    from engine.config import ConfigError, config_from_dict
    try:
        config_from_dict(table)
    except ConfigError as e:
        return str(e)
    return None


def run(replicas: int, stages: int, hosts: int = 0, link: str = "1gbit", rounds: int = 3, steps: int = 8,
        warmup: int = 2, hidden: int = HIDDEN, depth: int = DEPTH, batch: int = BATCH,
        micro_batches: int = MICRO) -> dict:
    from engine.bench.pipeline_grid_job import grid_model
    world = stages * replicas
    model = grid_model(hidden, depth)
    split = even_split(model, stages)
    variants = variants_of(stages, replicas)
    tables = {v: table_of(v, world, stages, hidden, depth, batch, micro_batches, split) for v in variants}
    refused = {v: r for v, r in ((v, refusal(tables[v])) for v in variants) if r is not None}
    common = dict(stage_layers=split, stages=stages, hidden=hidden, depth=depth, batch=batch,
                  micro_batches=micro_batches, steps=steps, warmup=warmup)
    if hosts:
        from engine.processes.cluster import emulated_cluster
        with emulated_cluster(hosts=hosts, link=link) as cluster:
            got, rate = _in_rounds(world, cluster, rounds, variants, tables, refused, common)
    else:
        got, rate = _in_rounds(world, None, rounds, variants, tables, refused, common)
    report = {"bench": "pipeline", "mode": "replicas", "world": world, "stages": stages, "replicas": replicas,
              "order": "stage", "hosts": hosts, "link": link if hosts else None, "batch": batch,
              "micro_batches": micro_batches, "rounds": rounds, "steps": steps, "warmup": warmup,
              "parameters": sum(p.numel() for p in model.parameters()),
              "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "layout": split, "sharded": SHARDED, "link_rate": rate}
    return {**report, **figures(variants, got, refused, batch, hosts, world, rate)}


def _in_rounds(world: int, cluster, rounds: int, variants: list[str], tables: dict, refused: dict,
               common: dict) -> tuple[dict, dict | None]:
    """Per variant run, per round, every rank's result; and over a cluster the link's measured rate."""
    from engine.bench.pipeline_grid_job import variant_job
    from engine.processes.procpool import DistPool
    got: dict[str, list[list[dict]]] = {v: [] for v in variants if v not in refused}
    probes: list[dict] = []
    with DistPool(world, timeout_s=120, cluster=cluster) as pool:
        for _ in range(rounds):
            if cluster is not None:   # the link's rate as these ranks see it, both ways at once, every round
                from engine.bench.linerate import probe_link
                probes.append(pool.run(probe_link, timeout=300, hosts=len(cluster.hosts))[0])
            for v in got:
                got[v].append(pool.run(variant_job, timeout=600, variant=v, table=tables[v],
                                       interface=cluster.interface if cluster is not None else None, **common))
    if cluster is None:
        return got, None
    from engine.bench.linerate import best_rate
    return got, best_rate(probes, cluster.link)


def _slowest(per_rank: list[dict]) -> list[float]:
    """Each timed step's slowest rank."""
    return [max(steps) for steps in zip(*(r["step_ms"] for r in per_rank))]


def _busiest(per_rank: list[dict], hosts: int, world: int, steps: int) -> int | None:
    """Bytes a step on the busiest host's link, in its busier direction (the first rank of each host read it)."""
    if not hosts or per_rank[0]["link"] is None:
        return None
    k = world // hosts
    return round(max(max(per_rank[h * k]["link"].values()) for h in range(hosts)) / steps)


def figures(variants: list[str], got: dict, refused: dict, batch: int, hosts: int, world: int,
            rate: dict | None) -> dict:
    per_round = {v: [statistics.median(_slowest(r)) for r in rounds] for v, rounds in got.items()}
    rows = []
    for v in variants:
        if v in refused:
            rows.append({"variant": v, "run": False, "step_ms": None, "not_run": refused[v]})
            continue
        steps = [ms for r in got[v] for ms in _slowest(r)]
        ms = statistics.median(steps)
        row = {"variant": v, "run": True, "step_ms": round(ms, 2),
               "step_ms_per_round": [round(x, 2) for x in per_round[v]],
               "samples_per_s": round(batch / ms * 1000, 1),
               "throughput_over_ddp": round(statistics.median(
                   a / b for a, b in zip(per_round["ddp"], per_round[v])), 3)}
        phases = {k for r in got[v] for rank in r for k in rank["phases_ms"]}
        if phases:   # each phase's slowest rank, the median over the rounds
            row["phases_ms"] = {k: round(statistics.median(max(rank["phases_ms"].get(k, 0.0) for rank in r)
                                                           for r in got[v]), 2) for k in sorted(phases)}
        crossed = [_busiest(r, hosts, world, len(r[0]["step_ms"])) for r in got[v]]
        if crossed[0] is not None:
            row["cross_host_bytes_per_step"] = round(statistics.median(crossed))
            row["link_ms_per_step"] = round(row["cross_host_bytes_per_step"] / rate["bytes_per_s"] * 1000, 2)
        rows.append(row)
    judged = {}
    for v in variants[3:]:
        if v in refused:
            continue
        for base, at_least in GOALS.items():
            ratios = [a / b for a, b in zip(per_round[base], per_round[v])]   # throughput: base's step over v's
            judged[f"{v} / {base} throughput"] = judge(ratios, at_least=at_least)
    note = ("" if hosts else "on the loopback: the goals are for the emulated cluster's link-bound case "
                             "(--hosts), reported, not judged")
    return {"variants": rows, "judged": judged,
            "goals": {name: j["verdict"] for name, j in judged.items()} if hosts else {}, "goals_note": note}


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    where = (f"{report['hosts']} hosts x {report['world'] // report['hosts']} ranks linked at {report['link']}"
             if report["hosts"] else f"world {report['world']} on the loopback")
    table = Table(title=f"pipeline {report['stages']} stages x {report['replicas']} replicas: "
                        f"{report['parameters'] / 1e6:.1f}M parameters, batch {report['batch']}, {where}, "
                        f"median of {report['rounds']} rounds x {report['steps']} steps")
    cols = ["variant", "step ms", "samples/s", "x ddp"]
    if report["hosts"]:
        cols += ["bytes across hosts / step", "at line rate ms"]
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in report["variants"]:
        if not row["run"]:
            table.add_row(row["variant"], "not run", *[""] * (len(cols) - 2))
            continue
        cells = [row["variant"], f"{row['step_ms']:.1f}", f"{row['samples_per_s']:.0f}",
                 f"{row['throughput_over_ddp']:.2f}"]
        if report["hosts"]:
            cells += [f"{row.get('cross_host_bytes_per_step', 0) / 1e6:.3f} MB",
                      f"{row.get('link_ms_per_step', 0):.1f}"]
        table.add_row(*cells)
    Console().print(table)
    for row in report["variants"]:
        if not row["run"]:
            print(f"{row['variant']}: not run: {row['not_run']}")
    rate = report["link_rate"]
    if rate is not None:
        print(f"link: {rate['bytes_per_s'] * 8 / 1e9:.3f} Gbit/s each way measured (shaped "
              f"{rate['shaped_bytes_per_s'] * 8 / 1e9:.3f}; each round's probe: "
              f"{', '.join(f'{r * 8 / 1e9:.3f}' for r in rate['rounds_bytes_per_s'])})")
    if report["goals"]:
        print("goals (each ratio the median of the rounds'; met: every round, missed: none, undecided: the "
              "spread covers the goal):")
        for name, j in report["judged"].items():
            print("  " + say(name, j))
    else:
        print(report["goals_note"] + ":")
        for name, j in report["judged"].items():
            print(f"  {name} {j['median']:.3f} (rounds {j['spread'][0]:.3f}-{j['spread'][1]:.3f}) {j['goal']}")


FLAGS = ("world", "hosts", "link", "warmup", "hidden", "depth")   # the mode's own, beside --replicas


def add_arguments(parser) -> None:
    """The mode's flags, on `bench pipeline`'s parser (engine/bench/pipeline.py)."""
    parser.add_argument("--replicas", type=int, default=None,
                        help="stages x replicas: every stage held by this many replicas, against ddp, sharded and "
                             "torch's pipeline + DDP (engine/bench/pipeline_grid.py)")
    parser.add_argument("--world", type=int, default=None,
                        help="with --replicas: worker processes (default 4, or --stages x --replicas)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="with --replicas: spread the ranks over this many emulated hosts (root; "
                             "engine/processes/cluster.py); default: the loopback")
    parser.add_argument("--link", default=None, help="with --hosts: each host's link rate (default 1gbit)")
    parser.add_argument("--warmup", type=int, default=None, help="with --replicas: untimed steps (default 2)")
    parser.add_argument("--hidden", type=int, default=None, help=f"with --replicas: MLP width (default {HIDDEN})")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"with --replicas: MLP hidden layers (default {DEPTH})")


def refuse_flags(parser, args) -> None:
    """Without --replicas the mode's flags mean nothing: said, not ignored."""
    given = [f"--{f}" for f in FLAGS if getattr(args, f) is not None]
    if given:
        parser.error(f"{', '.join(given)}: only with --replicas")


def main(parser, args) -> int:
    import json
    import sys
    replicas = args.replicas
    world = args.world or (args.stages * replicas if args.stages else 4)
    stages = args.stages or (world // replicas if replicas >= 1 else 0)
    hosts, link = args.hosts or 0, args.link or "1gbit"
    rounds, steps, warmup = args.rounds or 3, args.steps or 8, 2 if args.warmup is None else args.warmup
    hidden, depth = args.hidden or HIDDEN, args.depth or DEPTH
    if replicas < 1 or world % replicas:
        parser.error(f"--replicas {replicas}: must divide the world of {world}")
    if stages * replicas != world:
        parser.error(f"--stages {stages} x --replicas {replicas} is not the world of {world}")
    if stages < 2 or stages > depth:
        parser.error(f"{stages} stages: must be between 2 and --depth ({depth})")
    if hosts and (hosts < 2 or world % hosts):
        parser.error(f"--hosts {hosts}: must be at least 2 and divide the world of {world}")
    if args.link is not None and not hosts:
        parser.error("--link: only with --hosts")
    if rounds < 1 or steps < 1 or warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1 (the first step is torch's shape inference)")
    if BATCH % (replicas * MICRO) or BATCH % world:
        parser.error(f"batch {BATCH} does not split into {world} ranks, or into {replicas} replicas x {MICRO} "
                     f"micro-batches")
    from engine.processes.cluster import ClusterError
    try:
        report = run(replicas, stages, hosts, link, rounds, steps, warmup, hidden, depth)
    except ClusterError as e:
        print(f"trainyard bench pipeline: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0
