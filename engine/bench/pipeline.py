"""`trainyard bench pipeline`: a skewed pipeline, rebalanced live, against static layouts and torch's.

N stages (`--stages`, by default as many as the machine has cores, at most 4; one worker process each,
gloo on the CPU) train an MLP with a heavy head:
a trunk of narrow layers, then wide layers (each 8x a trunk layer's work) before the
classifier, so an even split by layer count leaves the last stage with most of the work.
The run starts from a skewed layout (the last stage holds all but N - 1 layers). Side by side in one
invocation, in rounds (so drift hits all alike):

    before       trainyard, the skewed layout, `rebalance = "auto"`, until its first check
    migration    the step during which the layers move (the check's decision, live)
    after        the same run, in the layout it rebalanced to
    best static  trainyard, `rebalance = "off"`, the layout with the smallest modelled slowest stage
                 (compute plus boundary sends at the measured link rate) over every split of the
                 layers, by brute force on the very costs the rebalancer decided on
    torch even   torch.distributed.pipelining's Schedule1F1B, the layers split evenly by count
    trainyard even   trainyard, `rebalance = "off"`, on torch's even split: the two engines on one
                 layout, so their ratio is trainyard's own overhead per micro-batch (goal <= 1.03)
      the same, activations not counted   the ledger without its saved-tensor hooks (which torch has no
                 counterpart of): what they cost, apart from the rest of the overhead

The figures are throughput (samples/s over the steps of each phase, the slowest rank's
wall time) and the ratios the goals name; a migration step is compared with the mean of
the three steps before and the three after it. Beside the measured speed-up the table prints the
ideal ones from the same measured layer times, bubble-bound (1F1B: a step is the stages' sum over
the micro-batches plus (m - 1) times the slowest stage's, per micro-batch): the best contiguous
split's, and a perfect balance's.

The goals hold where the cores allow the stages to run at once (2 stages on this 2-core machine);
with more stages than cores the figure measures the cores' time-sharing, and is reported, not judged.
Each goal is judged on every round's ratio (engine/bench/verdict.py): met, missed, or undecided when
the rounds' spread covers it. after/before is judged against 0.9 of the best contiguous split's
bubble-bound ideal, a figure the rebalance's own decision cannot lower.

    trainyard bench pipeline [--json] [--rounds 2] [--steps 12] [--stages N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time

import torch
from torch import nn

from engine.bench.verdict import judge

STAGES = 4   # the default where the machine has the cores (default_stages)
BATCH, MICRO = 256, 8
HIDDEN, DEPTH, WIDE, CLASSES = 256, 16, 2048, 10
THRESHOLD, CHECK_AT = 0.2, 8


def bench_model(hidden: int = HIDDEN, depth: int = DEPTH, wide: int = WIDE, classes: int = CLASSES, seed: int = 0):
    """`depth` narrow layers, then two wide pairs (hidden -> wide -> hidden), then the classifier."""
    from engine.models import LayerList
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers += [(f"fc{i}", nn.Linear(hidden, hidden)), (f"act{i}", nn.ReLU())]
    for j in range(2):
        layers += [(f"up{j}", nn.Linear(hidden, wide)), (f"wact{j}", nn.ReLU()), (f"down{j}", nn.Linear(wide, hidden))]
    return LayerList(layers + [("head", nn.Linear(hidden, classes))])


def default_stages() -> int:
    """As many stages as this machine has cores (one stage a core), at most STAGES, at least 2."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, min(STAGES, cores))


def skewed_layout(names: list[str], stages: int = STAGES) -> list[list[str]]:
    """Stages 0 to N-2 hold one hidden layer each; the last holds the rest and the head."""
    return [names[s:s + 1] for s in range(stages - 1)] + [names[stages - 1:]]


def even_layout(names: list[str], stages: int = STAGES) -> list[list[str]]:
    per, extra = divmod(len(names), stages)
    out, start = [], 0
    for s in range(stages):
        size = per + (1 if s < extra else 0)
        out.append(names[start:start + size])
        start += size
    return out


def best_static(names: list[str], layer_ms: dict[str, float], stages: int = STAGES,
                out_bytes: dict[str, int] | None = None, link_bytes_per_ms: float = math.inf,
                micro_batches: int = 1) -> tuple[list[list[str]], float]:
    """Every split of the layers into `stages` contiguous stages; the one with the smallest modelled slowest
    stage: its layers' time plus its boundary sends (each micro-batch's output forward and its input's
    gradient back, at the link rate), the objective the rebalancer's partition() minimises."""
    best, best_ms = None, float("inf")
    nbytes = out_bytes or {}
    for cuts in itertools.combinations(range(1, len(names)), stages - 1):
        bounds = (0, *cuts, len(names))
        split = [names[a:b] for a, b in zip(bounds, bounds[1:])]
        slowest = 0.0
        for a, b in zip(bounds, bounds[1:]):
            t = sum(layer_ms[n] for n in names[a:b])
            sent = (nbytes.get(names[a - 1], 0) if a > 0 else 0) + (nbytes.get(names[b - 1], 0) if b < len(names) else 0)
            slowest = max(slowest, t + (micro_batches * sent / link_bytes_per_ms if sent else 0.0))
        if slowest < best_ms:
            best, best_ms = split, slowest
    return best, best_ms


def bubble_bound_ms(stage_ms: list[float], micro_batches: int) -> float:
    """A 1F1B step's time from its stages' per-step times: every stage's work on one micro-batch passes
    once along the pipeline, and the slowest stage's on the other m - 1 (the bubble's bound)."""
    return sum(stage_ms) / micro_batches + (micro_batches - 1) / micro_batches * max(stage_ms)


def _batches(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, HIDDEN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
            for _ in range(steps)]


def trainyard_job(topo, stages: list[list[str]], steps: int, rebalance: str, count_activations: bool = True) -> dict:
    """One pipeline run; with `rebalance = "auto"` its first check is after step CHECK_AT. Without
    `count_activations` the ledger leaves out its saved-tensor hooks (the share they cost)."""
    from engine.config import OptimConfig, PipelineConfig
    from engine.runtime.devices import LedgerDevice
    from engine.strategies.pipeline import PipelineStage
    model = bench_model()
    device = LedgerDevice(1 << 40)
    device.ledger.count_activations = count_activations
    settings = PipelineConfig(micro_batches=MICRO, schedule="1f1b", rebalance=rebalance,
                              imbalance_threshold=THRESHOLD, rebalance_check_every=CHECK_AT)
    stage = PipelineStage(model, stages, topo, device, OptimConfig(name="sgd", lr=0.01), settings)
    step_ms, decision, migrated_at = [], None, None
    for step, (x, y) in enumerate(_batches(steps), 1):
        t0 = time.perf_counter()
        stage.train_step(x, y)
        if stage.take_migration() is not None:
            migrated_at = step
        found = stage.check(step) if decision is None else None
        decision = decision or (found if found is not None and found.changed else None)
        step_ms.append((time.perf_counter() - t0) * 1000)
    stage.close()
    return {"step_ms": step_ms, "stages": stage.stage_layers, "migrated_at": migrated_at,
            "layer_ms": decision.layer_ms if decision else None,
            "out_bytes": decision.out_bytes if decision else None,
            "link_bytes_per_ms": decision.link_bytes_per_ms if decision else None}


def _slowest(results: list[dict], lo: int, hi: int) -> float:
    """Mean step ms over steps [lo, hi) (1-based), the slowest rank's."""
    return max(statistics.mean(r["step_ms"][lo - 1:hi - 1]) for r in results)


def run(rounds: int, steps: int, stages: int = STAGES) -> dict:
    from engine.bench.torch_pipeline import torch_1f1b_job
    from engine.processes.procpool import DistPool
    names = bench_model().names
    rows: dict[str, list[float]] = {k: [] for k in ("before", "migration", "around", "after", "best", "torch", "even",
                                                "even_uncounted")}
    layouts, costs = {}, {}
    with DistPool(stages, timeout_s=120) as pool:
        for _ in range(rounds):
            auto = pool.run(trainyard_job, timeout=600, stages=skewed_layout(names, stages), steps=CHECK_AT + 2 + steps,
                            rebalance="auto")
            at = auto[0]["migrated_at"]
            if at is None:
                raise RuntimeError("the skewed start was not rebalanced at its first check")
            decided = next(r for r in auto if r["layer_ms"])
            rate = decided["link_bytes_per_ms"]
            costs = {"layer_ms": decided["layer_ms"], "out_bytes": decided["out_bytes"],
                     "link_bytes_per_ms": None if rate == math.inf else rate, "micro_batches": MICRO}
            rows["before"].append(_slowest(auto, 2, at))   # step 1 warms up
            rows["migration"].append(max(r["step_ms"][at - 1] for r in auto))
            rows["around"].append(statistics.mean([_slowest(auto, at - 3, at), _slowest(auto, at + 1, at + 4)]))
            rows["after"].append(_slowest(auto, at + 1, len(auto[0]["step_ms"]) + 1))
            layouts["after"] = auto[0]["stages"]
            layouts["best"], layouts["best_modelled_ms"] = best_static(names, decided["layer_ms"], stages,
                                                                       decided["out_bytes"], rate, MICRO)
            best = pool.run(trainyard_job, timeout=600, stages=layouts["best"], steps=steps + 1, rebalance="off")
            rows["best"].append(_slowest(best, 2, steps + 2))
            layouts["torch"] = even_layout(names, stages)
            torch_run = pool.run(torch_1f1b_job, timeout=600, build="engine.bench.pipeline:bench_model",
                                 build_kwargs={}, stage_layers=layouts["torch"], micro_batches=MICRO,
                                 batches=_batches(steps + 1), optim={"name": "sgd", "lr": 0.01}, warmup=1)
            rows["torch"].append(max(statistics.mean(r["step_ms"]) for r in torch_run))
            even = pool.run(trainyard_job, timeout=600, stages=layouts["torch"], steps=steps + 1, rebalance="off")
            rows["even"].append(_slowest(even, 2, steps + 2))
            bare = pool.run(trainyard_job, timeout=600, stages=layouts["torch"], steps=steps + 1, rebalance="off",
                            count_activations=False)
            rows["even_uncounted"].append(_slowest(bare, 2, steps + 2))
    ms = {k: statistics.median(v) for k, v in rows.items()}
    thr = {k: BATCH / ms[k] * 1000 for k in ("before", "after", "best", "torch", "even", "even_uncounted", "migration")}
    layer_ms = costs["layer_ms"]

    def bound(layout):   # bubble-bound step time of a layout, from the measured layer times
        return bubble_bound_ms([sum(layer_ms[n] for n in s) for s in layout], MICRO)
    balanced = bubble_bound_ms([sum(layer_ms.values()) / stages] * stages, MICRO)
    skewed_bound = bound(skewed_layout(names, stages))
    best_split = round(skewed_bound / bound(layouts["best"]), 3)

    def per_round(num: str, den: str) -> list[float]:   # round by round: drift hits both runs of a round alike
        return [a / b for a, b in zip(rows[num], rows[den])]
    judged = {"after / before": judge(per_round("before", "after"), at_least=round(0.9 * best_split, 3)),
              "after / best static": judge(per_round("best", "after"), at_least=0.97),
              "after / torch even split": judge(per_round("torch", "after"), at_least=1.0),
              "migration step / the steps around it": judge(per_round("around", "migration"), at_least=0.7),
              "trainyard / torch on torch's layout": judge(per_round("even", "torch"), at_most=1.03)}
    return {"judged": judged,"stages": stages, "batch": BATCH, "micro_batches": MICRO, "rounds": rounds, "steps": steps,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "step_ms": {k: round(v, 2) for k, v in ms.items()},
            "samples_per_s": {k: round(v, 1) for k, v in thr.items()},
            "after_over_before": round(ms["before"] / ms["after"], 3),
            "after_over_best_static": round(ms["best"] / ms["after"], 3),
            "after_over_torch_even": round(ms["torch"] / ms["after"], 3),
            "migration_step_over_around": round(ms["around"] / ms["migration"], 3),
            "trainyard_over_torch_same_layout": round(ms["even"] / ms["torch"], 3),
            "trainyard_uncounted_over_torch_same_layout": round(ms["even_uncounted"] / ms["torch"], 3),
            "ideal": {"best_split_over_before": best_split,
                      "balanced_over_before": round(skewed_bound / balanced, 3),
                      "after_layout_over_before": round(skewed_bound / bound(layouts["after"]), 3)},
            "costs": costs,
            "layouts": {"skewed": skewed_layout(names, stages), **layouts}}


GOALS_AT = 2   # stages: the goals hold where every stage has a core of its own here


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench pipeline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=2, help="repeat every variant this often (median)")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per variant")
    parser.add_argument("--stages", type=int, default=None,
                        help=f"pipeline stages, one worker process each (default: this machine's cores, at most "
                             f"{STAGES})")
    args = parser.parse_args(argv)
    stages = args.stages if args.stages is not None else default_stages()
    if stages < 2 or stages > len(bench_model().names) - 1:
        parser.error(f"--stages {stages}: must be between 2 and {len(bench_model().names) - 1}")
    report = run(args.rounds, args.steps, stages)
    judged = stages == GOALS_AT
    goals = {name: j["verdict"] for name, j in report["judged"].items()}
    report["goals"] = goals if judged else {}
    report["goals_note"] = ("" if judged else f"{stages} stages on {report['cores']} cores: the CPU-bound case, "
                                              f"reported, not judged (the goals are for {GOALS_AT} stages)")
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"pipeline: {stages} stages on the CPU (simulated devices), batch {BATCH}, "
                        f"{MICRO} micro-batches, 1F1B, median of {args.rounds} rounds")
    for col in ("variant", "step ms", "samples/s", "layout (layers per stage)"):
        table.add_column(col, justify="left" if col in ("variant", "layout (layers per stage)") else "right")
    lay = report["layouts"]
    for key, label, layout in (("before", "before (skewed)", lay["skewed"]), ("migration", "migration step", None),
                               ("after", "after auto rebalance", lay["after"]), ("best", "best static", lay["best"]),
                               ("torch", "torch Schedule1F1B even", lay["torch"]),
                               ("even", "trainyard on torch's even split", lay["torch"]),
                               ("even_uncounted", "  the same, activations not counted", lay["torch"])):
        table.add_row(label, f"{report['step_ms'][key]:.1f}", f"{report['samples_per_s'][key]:.0f}",
                      "" if layout is None else " | ".join(str(len(s)) for s in layout))
    Console().print(table)
    ideal = report["ideal"]
    print(f"after/before {report['after_over_before']:.3f} measured; bubble-bound ideal from the measured layer "
          f"times: {ideal['after_layout_over_before']:.3f} for the layout it took, {ideal['best_split_over_before']:.3f} "
          f"for the best contiguous split, {ideal['balanced_over_before']:.3f} for a perfect balance")
    print(f"after/best static {report['after_over_best_static']:.3f}, after/torch even {report['after_over_torch_even']:.3f}, "
          f"migration step/around {report['migration_step_over_around']:.3f}; trainyard/torch on the same layout "
          f"{report['trainyard_over_torch_same_layout']:.3f} (goal <= 1.03); without the ledger's saved-tensor hooks "
          f"{report['trainyard_uncounted_over_torch_same_layout']:.3f}")
    if judged:
        from engine.bench.verdict import say
        print("goals (each ratio the median of the rounds'; met: every round, missed: none, undecided: the spread "
              "covers the goal; after/before against 0.9 of the best contiguous split's bubble-bound ideal):")
        for name, j in report["judged"].items():
            print("  " + say(name, j))
    else:
        print(report["goals_note"])
    return 0
