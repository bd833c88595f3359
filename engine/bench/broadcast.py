"""`trainyard bench broadcast`: sharded ownership and the sliced, gated broadcast against torch DDP.

One pool of `--world` worker processes (gloo on this machine) trains the same MLP
(21M parameters in 20 equal layers by default, synthetic data) with each variant in turn, in rounds
(A B C D, A B C D, ...) so that drift of the machine hits every variant alike:

    ddp              torch DistributedDataParallel and one torch optimizer stepping after backward, as users
                     run it (all-reduce inside backward, full optimizer state on every rank)
    fsdp2-no-reshard torch's FSDP2 (fully_shard on each layer, then the root, as torchtitan applies it), the
                     gathered parameters kept from forward to backward: the peer a PyTorch user would pick
    fsdp2-reshard    the same, resharding after forward (gathered again in backward)
    sharded-1        1 stream, the step waits for the whole broadcast
    sharded-n        n streams, the step waits for the whole broadcast
    sharded-n-gated  n streams, the next forward gated per layer on its own slices
    (--hosts only) sharded-1-gated, and sharded-n-gated-flat: without the two-level exchange across
                     hosts (every rank sends to every other directly; engine/strategies/sharded/)

Figures: each variant's median step time over the rounds and its ratio to DDP, the optimizer-state bytes
per rank (largest rank), and per sharded variant, measured alike in each:
- the reduce's span (from the step's first gradient sent, during backward, to the owner's last sum) and
  the broadcast's span (from its launch to its last slice landing);
- the overlap efficiency: the fraction of the broadcast's span hidden behind compute,
  1 - (gate wait + broadcast wait) / broadcast span, in [0, 1] (0 when the step waits for all of it).
With `--hosts`, the line-rate ideal too (engine/bench/linerate.py): each phase's bytes over the most
loaded host link, each way, divided by the link's rate: the best a probe measured in any round (it runs
at the start of every round, beside the variants; both ways at once), never above the rate `--link`
shapes; and each variant's communication (reduce span + broadcast span) over it. A variant whose step is
under its ideal is a fault of the bench (the probe under-measured the link): the table and the JSON say
so. The goals judge the best gated variant's step against DDP's and against the better FSDP2 row's.
The per-phase columns are the profile that explains a missed goal, on the device's clock (engine/training/timing.py);
the step time is the wall time of the timed steps, the last broadcast included.

    trainyard bench broadcast [--world 4] [--streams 4] [--json]
    trainyard bench broadcast --hosts 2 --link 1gbit     # over an emulated cluster's shaped links (root)
    trainyard bench broadcast --precision bf16           # every variant in fp32 and in bf16, side by side
    trainyard bench broadcast --clip-grad-norm 1.0       # clipping's cost, waiting for the norm or speculating

With `--precision bf16` every variant runs twice in each round, in fp32 and in bf16 (compute, params and
reduce "bf16", "bf16", "fp32": engine/training/precision.py), one after the other, and the bench adds each
variant's bytes per step and step time in both with their bf16/fp32 ratios. Bytes per step: for the
sharded variants the broadcast each rank's stream meters count (every slice, sent or received); for
ddp the all-reduce (every gradient once, in its dtype). In bf16 the sharded variants cast the model to
bf16 before the strategy is built (bf16 flat buffers, so a bf16 broadcast: half the bytes; fp32 masters
and state at each owner) and step under autocast; ddp is torch's own mixed precision as users run it
(fp32 weights, gradients and all-reduce under bf16 autocast), so its bytes stay. On a CPU bf16 matmuls
may be slower than fp32: the bytes are the figure. `--precision fp32` (the default) runs as before.

With `--hosts N` the ranks are spread over N emulated hosts (engine/processes/cluster.py: network namespaces
whose links are shaped with tbf to `--link`), made for the bench and removed after it: network-bound
figures, with sharded-1-gated and sharded-n-gated-flat too.

With `--clip-grad-norm X` the bench runs instead `ddp-inline` (trainyard's own ddp strategy: each layer's update
inline as its bucket's all-reduce completes; torch's DDP steps one optimizer after backward and cannot
speculate) without clipping, clipping at X after waiting for the norm, and clipping speculatively, and
sharded-n-gated without and with clipping (its owners update after the reduce: the norm is known before any
update, so it never rolls back), a variant's modes back to back in each round, with the rollback and clipped
rates of the clipping runs and the goals (engine/bench/clip.py). fp32 only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from engine.bench.broadcast_figures import figures
from engine.bench.broadcast_tables import goal_of, print_comparison, print_precision
from engine.bench.clip import add_precision_and_clip, check_precision_and_clip, ratio
from engine.bench.torch_ddp import TorchDDP


PRECISIONS = {"fp32": ("fp32", "fp32", "fp32"), "bf16": ("bf16", "bf16", "fp32")}   # compute, params, reduce
# the note every bench's bf16/fp32 table carries
BF16_NOTE = ("bytes are the figure: on a CPU bf16 matmuls may be slower than fp32 (no bf16 units), so the step "
             "times of bf16 say little there")


def precision_config(name: str):
    """The bench's precision `name` as a PrecisionConfig: fp32 everywhere, or bf16 compute and working weights
    with gradients summed in fp32."""
    from engine.config import PrecisionConfig
    compute, params, reduce = PRECISIONS[name]
    return PrecisionConfig(compute=compute, params=params, reduce=reduce)


def measure(topo, variant: str, hidden: int, depth: int, features: int, batch: int, steps: int, warmup: int,
            streams: int, slices: int, precision: str = "fp32", optim_keys: dict | None = None) -> dict:
    """One variant on this rank in `precision` (PRECISIONS): `warmup` steps, then `steps` timed ones.
    `optim_keys` (--clip-grad-norm): [optim] keys over the bench's SGD, and the timed steps' guard fields
    in the result (`guard`: engine/bench/clip.py)."""
    import torch
    import torch.distributed as dist

    from engine.config import ModelConfig, OptimConfig, ShardedConfig
    from engine.training.precision import compute_in, param_dtype, reduce_dtype
    from engine.runtime.devices import LedgerDevice, tensor_bytes
    from engine.bench.clip import GuardTally
    from engine.bench.torch_fsdp import TorchFSDP, link_bytes as fsdp_link_bytes
    from engine.models import build_model
    from engine.strategies.ddp import DDPStrategy
    from engine.strategies.sharded import ShardedStrategy

    prec = precision_config(precision)
    model = build_model(ModelConfig(name="mlp", hidden=hidden, depth=depth),
                        {"input_dim": features, "num_classes": 10}, seed=0)
    device = LedgerDevice(1 << 40)
    optim = OptimConfig(name="sgd", lr=0.01, **(optim_keys or {}))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())   # fp32, before any sharding
    if variant == "ddp":   # torch's mixed precision as users run it: fp32 weights, the step under autocast
        runner = TorchDDP(model, optim, topo, device)
    elif variant.startswith("fsdp2"):   # its own mixed precision: bf16 gathered, fp32 reduced and stepped
        runner = TorchFSDP(model, optim, topo, device, reshard_after_forward=variant == "fsdp2-reshard",
                           bf16=precision == "bf16")
    elif variant == "ddp-inline":   # trainyard's own: each layer's update inline as its bucket's all-reduce lands
        runner = DDPStrategy(model, optim, topo, device)
    else:   # the working weights in their dtype before the strategy makes its flat buffers of them
        model = model.to(param_dtype(prec))
        settings = ShardedConfig(streams=1 if variant.startswith("sharded-1") else streams, slices=slices,
                                 overlap_forward="gated" in variant, hierarchical=not variant.endswith("flat"))
        runner = ShardedStrategy(model, optim, topo, device, settings, reduce_dtype=reduce_dtype(prec))
    device.ledger.track_module(model, runner.optimizer)
    meters = runner.meters if isinstance(runner, ShardedStrategy) else []   # one per stream: every slice broadcast
    per_rank = batch // topo.world_size
    gen = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(per_rank, features, generator=gen)
    y = torch.randint(0, 10, (per_rank,), generator=gen)
    phases = ("fwd_ms", "bwd_ms", "reduce_ms", "optim_ms", "broadcast_wait_ms", "gate_ms", "reduce_span_ms",
              "broadcast_span_ms", "broadcast_issue_ms")
    where = device.torch_device
    for _ in range(warmup):
        with compute_in(prec, where):   # fp32: no context at all
            runner.train_step(x, y)
    runner.sync()
    dist.barrier(group=topo.compute)
    for meter in meters:   # the warm-up's broadcasts are not counted
        meter.take()
    sums = dict.fromkeys(phases, 0.0)
    guard = GuardTally() if optim_keys is not None else None
    t0 = time.perf_counter()
    for _ in range(steps):
        with compute_in(prec, where):
            runner.train_step(x, y)
        for k in phases:
            sums[k] += runner.timings.get(k, 0.0)
        if guard is not None:
            guard.add(runner)
    runner.sync()   # the last broadcast is part of the work
    elapsed = time.perf_counter() - t0   # wall time: every step read its loss, so the device's work is in it
    if meters:   # every timed step's broadcast, as this rank's streams carried it
        link_bytes = sum(meter.take()["bytes"] for meter in meters) / steps
    elif variant.startswith("fsdp2"):   # its gathers of the working weights, and the gradients' reduce-scatter
        working = full_bytes // 2 if precision == "bf16" else full_bytes
        link_bytes = fsdp_link_bytes(working, full_bytes, variant == "fsdp2-reshard")
    else:        # DDP's all-reduce carries every gradient once per step, in the gradients' dtype
        link_bytes = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    device.ledger.refresh()
    result = {"step_ms": elapsed / steps * 1000, **{k: v / steps for k, v in sums.items()},
              "optimizer_state_bytes": device.ledger.bytes["optimizer_state"],
              "parameters": sum(p.numel() for p in model.parameters()), "model_bytes": full_bytes,
              "bytes_per_step": link_bytes, "parameter_bytes": device.ledger.bytes["parameters"],
              "master_bytes": device.ledger.bytes["master"], "owned_bytes": runner.owned_bytes if isinstance(runner, ShardedStrategy) else 0}
    if guard is not None:
        result["guard"] = guard.figures()
    runner.close()
    return result


def run_bench(world: int, rounds: int, streams: int, slices: int, hidden: int, depth: int, features: int,
              batch: int, steps: int, warmup: int, hosts: int = 0, link: str = "1gbit",
              precision: str = "fp32", clip: float | None = None) -> dict:
    """`precision` "bf16": every variant in fp32 and in bf16, side by side (the report's "bf16" and
    "bf16_vs_fp32"); "fp32": fp32 only. `clip`: the clipping comparison at that threshold instead (fp32)."""
    precisions = ("fp32", "bf16") if precision == "bf16" else ("fp32",)

    def run(cluster) -> dict:
        if clip is not None:
            return _run_clip(world, rounds, streams, slices, hidden, depth, features, batch, steps, warmup, cluster,
                             clip)
        return _run_variants(world, rounds, streams, slices, hidden, depth, features, batch, steps, warmup, cluster,
                             precisions)
    if hosts:
        from engine.processes.cluster import emulated_cluster
        with emulated_cluster(hosts=hosts, link=link) as cluster:
            report = run(cluster)
        return {**report, "hosts": hosts, "link": link}
    return run(None)


def _in_rounds(world: int, cluster, rounds: int, jobs: list[dict], **common) -> tuple[list[list[list[dict]]], dict]:
    """measure() of each job (its keyword arguments over `common`) on a pool of `world` ranks, the jobs one after
    another, `rounds` times, so that drift of the machine hits every job alike: per job, per round, the
    ranks' results; and over a cluster, the link probe's figures (engine/bench/linerate.py; else {})."""
    from engine.processes.procpool import DistPool
    out: list[list[list[dict]]] = [[] for _ in jobs]
    probes: list[dict] = []
    with DistPool(world, timeout_s=120, cluster=cluster) as pool:
        for _ in range(rounds):
            if cluster is not None:   # the link's rate as these ranks see it, both ways at once, every round
                from engine.bench.linerate import probe_link
                probes.append(pool.run(probe_link, timeout=300, hosts=len(cluster.hosts))[0])
            for i, job in enumerate(jobs):
                out[i].append(pool.run(measure, timeout=600, **common, **job))
    if cluster is None:
        return out, {}
    from engine.bench.linerate import best_rate
    return out, best_rate(probes, cluster.link)


def _run_variants(world: int, rounds: int, streams: int, slices: int, hidden: int, depth: int, features: int,
                  batch: int, steps: int, warmup: int, cluster, precisions: tuple[str, ...] = ("fp32",)) -> dict:
    variants = ["ddp", "fsdp2-no-reshard", "fsdp2-reshard", "sharded-1", f"sharded-{streams}",
                f"sharded-{streams}-gated"]
    if cluster is not None:   # the stream count's effect on overlap, and the two-level exchange's effect
        variants.insert(variants.index("sharded-1") + 1, "sharded-1-gated")
        variants.append(f"sharded-{streams}-gated-flat")
    runs: dict[str, dict[str, list[dict]]] = {p: {v: [] for v in variants} for p in precisions}
    # a variant's precisions back to back: drift hits both alike
    jobs = [{"variant": v, "precision": p} for v in variants for p in precisions]
    got, link = _in_rounds(world, cluster, rounds, jobs, hidden=hidden, depth=depth, features=features,
                           batch=batch, steps=steps, warmup=warmup, streams=streams, slices=slices)
    for job, per_round in zip(jobs, got):
        for results in per_round:
            runs[job["precision"]][job["variant"]].append(
                {**results[0], "state_per_rank": [r["optimizer_state_bytes"] for r in results],
                 "master_per_rank": [r["master_bytes"] for r in results],
                 "owned_per_rank": [r["owned_bytes"] for r in results]})
    hosts = len(cluster.hosts) if cluster is not None else 0
    goal = goal_of(hosts, world, cluster.link if cluster is not None else "")
    compare = len(precisions) > 1
    summary = {p: figures(runs[p], variants, world, goal, with_bytes=compare, hosts=hosts, link=link)
               for p in precisions}
    fp32 = summary["fp32"]
    report = {"bench": "broadcast", "world": world, "streams": streams, "slices": slices, "rounds": rounds,
              "steps_per_round": steps, "parameters": fp32.pop("parameters"), "batch": batch, **fp32}
    if not compare:
        return report
    bf16 = summary["bf16"]
    bf16.pop("parameters")
    by_name = {r["variant"]: r for r in bf16["variants"]}
    report.update({
        "precision": "bf16",
        "precisions": {p: dict(zip(("compute", "params", "reduce"), PRECISIONS[p])) for p in precisions},
        "bytes_per_step_is": {"sharded": "the broadcast: every slice as this rank's stream meters count it "
                                         "(sent or received; with --hosts, within its host), per step",
                              "ddp": "the all-reduce: every gradient once, in its dtype (torch's mixed precision: "
                                     "fp32 gradients in both)"},
        "bf16": bf16,
        "bf16_vs_fp32": [{"variant": r["variant"],
                          "bytes_per_step_fp32": r["bytes_per_step"],
                          "bytes_per_step_bf16": by_name[r["variant"]]["bytes_per_step"],
                          "bytes_ratio": ratio(by_name[r["variant"]]["bytes_per_step"], r["bytes_per_step"], 4),
                          "step_ms_fp32": r["step_ms"], "step_ms_bf16": by_name[r["variant"]]["step_ms"],
                          "step_ratio": ratio(by_name[r["variant"]]["step_ms"], r["step_ms"]),
                          "parameter_bytes_ratio": ratio(by_name[r["variant"]]["parameter_bytes_per_rank"],
                                                         r["parameter_bytes_per_rank"], 4)}
                         for r in fp32["variants"]],
        "note": BF16_NOTE})
    return report


# --clip-grad-norm: trainyard's ddp (torch's DDP + one optimizer cannot speculate: it steps after backward) in the
# three modes, and the gated sharded variant without and with clipping: its owners update after the reduce, so
# the norm is known first and it never rolls back (it waits by design)
CLIP_NOTE = ("ddp-inline: trainyard's ddp strategy, each layer's update inline as its bucket's all-reduce "
             "completes; sharded: the owners update after the reduce, so the norm is known before any update: it "
             "waits by design and never rolls back (no speculate run)")


def _run_clip(world: int, rounds: int, streams: int, slices: int, hidden: int, depth: int, features: int,
              batch: int, steps: int, warmup: int, cluster, clip: float) -> dict:
    from engine.bench.clip import MODES, optim_keys, variant_row
    plan = {"ddp-inline": MODES, f"sharded-{streams}-gated": ("none", "wait")}
    jobs = [{"variant": v, "optim_keys": optim_keys(m, clip)} for v, modes in plan.items() for m in modes]
    got, _ = _in_rounds(world, cluster, rounds, jobs, hidden=hidden, depth=depth, features=features, batch=batch,
                        steps=steps, warmup=warmup, streams=streams, slices=slices)
    results = iter(got)
    runs = {v: {m: [per_rank[0] for per_rank in next(results)] for m in modes} for v, modes in plan.items()}
    return {"bench": "broadcast", "clip_grad_norm": clip, "world": world, "streams": streams, "slices": slices,
            "rounds": rounds, "steps_per_round": steps, "batch": batch,
            "parameters": runs["ddp-inline"]["none"][0]["parameters"],
            "modes": {m: optim_keys(m, clip) for m in MODES},
            "variants": [variant_row(v, runs[v], overlap=False) for v in plan], "note": CLIP_NOTE}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench broadcast")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--world", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--streams", type=int, default=4, help="streams of the n-stream variants (default 4)")
    parser.add_argument("--slices", type=int, default=16, help="slices per owner (default 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--depth", type=int, default=20, help="MLP hidden layers (default 20: 21M parameters in "
                                                                "20 equal layers, which whole-parameter ownership "
                                                                "can split evenly over 2 or 4 ranks)")
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--hosts", type=int, default=0, help="spread the ranks over this many emulated hosts "
                                                             "(0: one machine; needs root, engine/processes/cluster.py)")
    parser.add_argument("--link", default="1gbit", help="each emulated host's link rate, with --hosts "
                                                        "(default 1gbit)")
    add_precision_and_clip(parser, "every variant's bytes per step",
                           "ddp-inline without clipping, clipping at X after waiting for the norm, and clipping "
                           "speculatively, and sharded-n-gated without and with clipping")
    args = parser.parse_args(argv)
    if args.slices < args.streams or args.batch % args.world:
        parser.error("--slices must be >= --streams and --batch divisible by --world")
    if args.hosts and (args.hosts < 2 or args.world % args.hosts):
        parser.error("--hosts must be at least 2 and divide --world")
    check_precision_and_clip(parser, args)
    from engine.processes.cluster import ClusterError
    try:
        report = run_bench(args.world, args.rounds, args.streams, args.slices, args.hidden, args.depth,
                           args.features, args.batch, args.steps, args.warmup, args.hosts, args.link, args.precision,
                           args.clip_grad_norm)
    except ClusterError as e:
        print(f"trainyard bench broadcast: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    where = f", {args.hosts} hosts linked at {args.link}" if args.hosts else ""
    if args.clip_grad_norm is not None:
        from engine.bench.clip import print_rows
        print_rows(console, Table, f"broadcast, clipping at {report['clip_grad_norm']:g}: "
                                   f"{report['parameters'] / 1e6:.1f}M parameters, world {args.world}{where}, median "
                                   f"of {args.rounds} rounds (ms per step; rates over "
                                   f"{report['variants'][0]['timed_steps']} timed steps)", report["variants"],
                   caption=f"note: {report['note']}")
        return 0
    compare = args.precision == "bf16"
    for label, figures in ((("fp32", report), ("bf16", report["bf16"])) if compare else ((None, report),)):
        print_precision(console, Table, args, report["parameters"], where, figures, label)
    if compare:
        print_comparison(console, Table, report)
    return 0


