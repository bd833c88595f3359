"""`trainyard bench pipeline`: a skewed pipeline, rebalanced live, against static layouts and torch's.

N stages (`--stages`, by default as many as the machine has cores, at most 4; one worker process each,
gloo on the CPU) train an MLP with a heavy head:
a trunk of narrow layers, then wide layers (each 8x a trunk layer's work) before the
classifier, so an even split by layer count leaves the last stage with most of the work.
The run starts from a skewed layout (the last stage holds all but N - 1 layers). Every variant is built
in the same N processes and stepped in turns, one step of each (engine/bench/pipeline_job.py):

    before       trainyard, the skewed layout, `rebalance = "auto"`, alone until its first check
    migration    the step during which the layers move (the check's decision, live)
    after        the same run, in the layout it rebalanced to, checked at every step as the engine does
      its steps the layer clock times   after's sampled steps (the clock's cost, apart)
    skewed static   trainyard, the skewed layout, `rebalance = "off"`, stepped beside after: the
                 before of the judged after/before
    best static  trainyard, `rebalance = "off"`, the faster measured of the splits the model puts first:
                 over every split of the layers, by brute force on the very costs the rebalancer
                 decided on, the smallest modelled slowest stage (compute plus boundary sends at the
                 measured link rate), and the fastest split of every other boundary size within 5%
                 of it (pipeline_model.static_candidates). The model alone put a cut after a wide
                 layer first in some runs and the next cut in others, 8-12% apart when measured.
    torch even   torch.distributed.pipelining's Schedule1F1B, the layers split evenly by count
    trainyard even   trainyard, `rebalance = "off"`, on torch's even split: the two engines on one
                 layout, so their ratio is trainyard's own overhead per micro-batch (goal <= 1.0: no slower than torch)
      the same, activations not counted   the ledger without its saved-tensor hooks (which torch has no
                 counterpart of): what they cost, apart from the rest of the overhead

A variant's figure is the median over its timed steps of the slowest stage's step; a judged ratio is the
median over the turns of the two variants' steps in the same turn (`paired`), so the machine's drift
hits both. Which steps are timed, and why: pipeline_job.py. The migration step is compared with the mean
of the steps before and after it. Beside the measured speed-up the table prints the
ideal ones from the same measured layer times, bubble-bound (1F1B: a step is the stages' sum over
the micro-batches plus (m - 1) times the slowest stage's, per micro-batch): the best contiguous
split's, and a perfect balance's.

The goals hold where the cores allow the stages to run at once (2 stages on this 2-core machine);
with more stages than cores the figure measures the cores' time-sharing, and is reported, not judged.
Each goal is judged on every round's ratio (engine/bench/verdict.py): met, missed, or undecided when
the rounds' spread covers it. after/before is judged against 0.9 of the best contiguous split's
bubble-bound ideal, a figure the rebalance's own decision cannot lower.

    trainyard bench pipeline [--json] [--rounds 2] [--steps 150] [--stages N]

With `--replicas R` the bench is another one: S stages x R replicas against ddp, sharded and torch's pipeline
with DDP, over an emulated cluster with `--hosts H --link RATE` (engine/bench/pipeline_grid.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from engine.bench.verdict import judge

from engine.bench.pipeline_model import (BATCH, MICRO, STAGES, bench_model, bubble_bound_ms, default_stages,
                                         even_layout, skewed_layout)


def _steps(per_rank: list[list[tuple]], keep) -> list[float | None]:
    """Each step's slowest rank, None where `keep(k, armed, moved)` leaves the step out (a step's flags are
    every rank's alike)."""
    return [max(rank[k][0] for rank in per_rank) if keep(k, step[1], step[2]) else None
            for k, step in enumerate(per_rank[0])]


def _median(steps: list[float | None], needed: bool = True) -> float | None:
    kept = [ms for ms in steps if ms is not None]
    if not kept and needed:
        raise RuntimeError("no step was left to time: give more --steps")
    return statistics.median(kept) if kept else None


def paired(num: list[float | None], den: list[float | None]) -> float:
    """The median over the turns of num's step over den's in the same turn: the two ran within a second of each
    other, on the same cores, so a core that slows down for seconds (this machine's run between ~67 and ~85 ms
    on one fixed kernel, in spells of seconds, each core on its own) slows both."""
    return _median([a / b if a is not None and b is not None else None for a, b in zip(num, den)])


def one_round(pool, stages: int, steps: int) -> dict:
    """A round (engine/bench/pipeline_job.py): {"ms": every row's step ms, "ratios": the judged ratios,
    "layouts", "costs": the check's, "page_faults": each variant's median minor faults a step, warm-up
    apart (under 100 where the allocator keeps what a step frees)}."""
    from engine.bench.pipeline_job import WARMUP, side_by_side_job
    names = bench_model().names
    got = pool.run(side_by_side_job, timeout=600, skewed=skewed_layout(names, stages),
                   even=even_layout(names, stages), steps=steps)
    first = [r["first"] for r in got]
    at = len(first[0])   # the migration step, 1-based
    timed = lambda k, armed, moved: k >= WARMUP and not armed and not moved   # noqa: E731
    per_rank = {name: [r["rows"][name] for r in got] for name in got[0]["rows"]}
    turns = {name: _steps(rows, timed) for name, rows in per_rank.items()}
    clock = _steps(per_rank["auto"], lambda k, armed, moved: k >= WARMUP and armed and not moved)
    candidates = got[0]["layouts"]["candidates"]
    measured = [turns.pop(f"best{i}") for i in range(len(candidates))]   # every candidate's turns
    candidates_ms = [_median(t) for t in measured]
    fastest = candidates_ms.index(min(candidates_ms))
    turns["best"] = measured[fastest]
    ms = {"before": _median(_steps(first, lambda k, armed, moved: timed(k, armed, moved) and k < at - 1)),
          "migration": max(r[at - 1][0] for r in first),
          **{name: _median(t) for name, t in turns.items() if name != "auto"},
          "after": _median(turns["auto"]), "clock": _median(clock, needed=False)}
    ms["around"] = statistics.mean([ms["before"], ms["after"]])
    faults = {name: statistics.median(max(rank[k][3] for rank in rows) for k in range(WARMUP, len(rows[0])))
              for name, rows in per_rank.items()}
    ratios = {"after / before": paired(turns["skewed"], turns["auto"]),
              "after / best static": paired(turns["best"], turns["auto"]),
              "after / torch even split": paired(turns["torch"], turns["auto"]),
              "migration step / the steps around it": ms["around"] / ms["migration"],
              "trainyard / torch on torch's layout": paired(turns["even"], turns["torch"]),
              "uncounted / torch": paired(turns["even_uncounted"], turns["torch"])}
    layouts = {**got[0]["layouts"], "best": candidates[fastest], "candidates_ms": [round(v, 2) for v in candidates_ms]}
    return {"ms": ms, "ratios": ratios, "layouts": layouts, "costs": got[0]["costs"], "page_faults": faults}


def run(rounds: int, steps: int, stages: int = STAGES) -> dict:
    from engine.processes.procpool import DistPool
    names = bench_model().names
    rows: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}
    with DistPool(stages, timeout_s=120) as pool:
        for _ in range(rounds):
            got = one_round(pool, stages, steps)
            for into, part in ((rows, "ms"), (ratios, "ratios"), (faults, "page_faults")):
                for k, v in got[part].items():
                    into.setdefault(k, []).append(v)
    layouts, costs = got["layouts"], got["costs"]
    layouts["torch"] = even_layout(names, stages)
    ms = {k: statistics.median(x for x in v if x is not None) for k, v in rows.items() if any(x is not None for x in v)}
    thr = {k: BATCH / ms[k] * 1000 for k in ms}
    layer_ms = costs["layer_ms"]

    def bound(layout):   # bubble-bound step time of a layout, from the measured layer times
        return bubble_bound_ms([sum(layer_ms[n] for n in s) for s in layout], MICRO)
    balanced = bubble_bound_ms([sum(layer_ms.values()) / stages] * stages, MICRO)
    skewed_bound = bound(skewed_layout(names, stages))
    best_split = round(skewed_bound / bound(layouts["modelled_best"]), 3)
    goals = {"after / before": {"at_least": round(0.9 * best_split, 3)}, "after / best static": {"at_least": 0.97},
             "after / torch even split": {"at_least": 1.0}, "migration step / the steps around it": {"at_least": 0.7},
             "trainyard / torch on torch's layout": {"at_most": 1.0}}
    judged = {name: judge(ratios[name], **goal) for name, goal in goals.items()}
    ratio = {name: statistics.median(v) for name, v in ratios.items()}
    return {"judged": judged, "stages": stages, "batch": BATCH, "micro_batches": MICRO, "rounds": rounds,
            "steps": steps, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "step_ms": {k: round(v, 2) for k, v in ms.items()},
            "step_ms_per_round": {k: [round(x, 2) for x in v] for k, v in rows.items()},
            "samples_per_s": {k: round(v, 1) for k, v in thr.items()},
            "after_over_before": round(ratio["after / before"], 3),
            "after_over_best_static": round(ratio["after / best static"], 3),
            "after_over_torch_even": round(ratio["after / torch even split"], 3),
            "migration_step_over_around": round(ratio["migration step / the steps around it"], 3),
            "trainyard_over_torch_same_layout": round(ratio["trainyard / torch on torch's layout"], 3),
            "trainyard_uncounted_over_torch_same_layout": round(ratio["uncounted / torch"], 3),
            "clock_step_over_after": round(ms["clock"] / ms["after"], 3) if "clock" in ms else None,
            "ideal": {"best_split_over_before": best_split,
                      "balanced_over_before": round(skewed_bound / balanced, 3),
                      "after_layout_over_before": round(skewed_bound / bound(layouts["after"]), 3)},
            "costs": costs,
            "page_faults_per_step": faults,
            "layouts": {"skewed": skewed_layout(names, stages), **layouts}}


GOALS_AT = 2   # stages: the goals hold where every stage has a core of its own here


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench pipeline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=None,
                        help="repeat every variant this often (median; default 2, 3 with --replicas)")
    parser.add_argument("--steps", type=int, default=None,
                        help="turns of every variant after the migration (each variant's steps, warm-up apart; "
                             "default 150); with --replicas: timed steps per variant and round (default 8)")
    parser.add_argument("--stages", type=int, default=None,
                        help=f"pipeline stages, one worker process each (default: this machine's cores, at most "
                             f"{STAGES}); with --replicas: stages of each replica (default the world / R)")
    from engine.bench import pipeline_grid
    pipeline_grid.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.replicas is not None:
        return pipeline_grid.main(parser, args)
    pipeline_grid.refuse_flags(parser, args)
    args.rounds = 2 if args.rounds is None else args.rounds
    args.steps = 150 if args.steps is None else args.steps
    stages = args.stages if args.stages is not None else default_stages()
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{flag} {value}: must be at least 1")
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
    for key, label, layout in (("before", "before: auto, skewed, until its check", lay["skewed"]),
                               ("migration", "migration step", None),
                               ("after", "after auto rebalance", lay["after"]),
                               ("clock", "  its steps the layer clock times", lay["after"]),
                               ("skewed", "skewed static, beside after", lay["skewed"]),
                               ("best", "best static", lay["best"]),
                               ("torch", "torch Schedule1F1B even", lay["torch"]),
                               ("even", "trainyard on torch's even split", lay["torch"]),
                               ("even_uncounted", "  the same, activations not counted", lay["torch"])):
        if key not in report["step_ms"]:   # the clock's row, where no step it timed was among the turns
            continue
        table.add_row(label, f"{report['step_ms'][key]:.1f}", f"{report['samples_per_s'][key]:.0f}",
                      "" if layout is None else " | ".join(str(len(s)) for s in layout))
    Console().print(table)
    ideal = report["ideal"]
    print(f"after/before {report['after_over_before']:.3f} measured (the skewed layout stepped beside the rebalanced "
          f"one); bubble-bound ideal from the measured layer "
          f"times: {ideal['after_layout_over_before']:.3f} for the layout it took, {ideal['best_split_over_before']:.3f} "
          f"for the best contiguous split, {ideal['balanced_over_before']:.3f} for a perfect balance")
    print(f"after/best static {report['after_over_best_static']:.3f}, after/torch even {report['after_over_torch_even']:.3f}, "
          f"migration step/around {report['migration_step_over_around']:.3f}; trainyard/torch on the same layout "
          f"{report['trainyard_over_torch_same_layout']:.3f} (goal <= 1.0); without the ledger's saved-tensor hooks "
          f"{report['trainyard_uncounted_over_torch_same_layout']:.3f}"
          + ("" if report["clock_step_over_after"] is None
             else f"; the layer clock's steps {report['clock_step_over_after']:.3f}x the others"))
    if judged:
        from engine.bench.verdict import say
        print("goals (each ratio the median of the rounds'; met: every round, missed: none, undecided: the spread "
              "covers the goal; after/before against 0.9 of the best contiguous split's bubble-bound ideal):")
        for name, j in report["judged"].items():
            print("  " + say(name, j))
    else:
        print(report["goals_note"])
    return 0
