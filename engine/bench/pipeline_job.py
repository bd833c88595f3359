"""The job `trainyard bench pipeline` runs on every stage's process: every variant built in the same
processes and stepped in turns, so that what the machine does to one step (a core's speed changing for
seconds, another process taking a core) it does to its neighbours too.

    first    the skewed start alone, `rebalance = "auto"`, the engine's own check at every step, until the
             check's layout is in place (the migration step)
    then     WARMUP + steps turns of one step of every variant, each after a barrier (its time is the step's
             alone, every stage starting it together), in an order drawn afresh every turn:
                 auto          the same run, in the layout it rebalanced to, checked at every step as before
                 skewed        the skewed layout, `rebalance = "off"`: the before of after/before, stepped beside
                 best0, ...    the best contiguous splits of the check's own costs, `rebalance = "off"`: the
                               modelled optimum and the fastest of every other boundary size within 5% of it
                               (pipeline_model.static_candidates); the faster measured is "best static"
                 torch         torch.distributed.pipelining's Schedule1F1B on the even split by count
                 even          trainyard on that even split, `rebalance = "off"`
                 even_uncounted   the same, the ledger's saved-tensor hooks off

Stage r runs on core r where there are cores enough, and the allocator keeps what a step frees
(_keep_freed_memory): without it, the variants' turns made the last stage fault 20 to 33 MB of pages in
again every step, a cost that depended on which variant ran before (one fixed order measured the same
layout 5% apart, depending on its neighbour in the order).

What a figure leaves out, and why (each measured on this machine, `bench pipeline --stages 2`):
- the first WARMUP steps of every variant: a new stage's first step took ~5,000 minor page faults and its
  second ~1,500 (the allocator growing into its working set), then under 100 a step; step 2 ran up to 50 ms
  over the steps after it;
- the steps the layer clock times (one in TIME_EVERY, and the one before each check, which also runs the
  check): up to 20% slower on the CPU, where the clock's marks are host calls around every layer; their
  cost is its own figure (`clock`), not part of after's;
- a step in which layers moved.
The figures are per-step medians of the slowest stage's time, not means, so one preempted step moves
nothing. Each step's minor page faults come back too (`page_faults_per_step`: a few a step).
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import time

import torch.distributed as dist

from engine.bench.pipeline_model import MICRO, THRESHOLD, batches, bench_model, best_static, static_candidates

WARMUP = 2      # steps of every variant that are not timed
CHECK_AT = 8    # the auto run's check interval: its first check decides the migration


def _trainyard(topo, stages, rebalance: str, count_activations: bool = True):
    from engine.config import OptimConfig, PipelineConfig
    from engine.runtime.devices import LedgerDevice
    from engine.strategies.pipeline import PipelineStage
    device = LedgerDevice(1 << 40)
    device.ledger.count_activations = count_activations
    settings = PipelineConfig(micro_batches=MICRO, schedule="1f1b", rebalance=rebalance,
                              imbalance_threshold=THRESHOLD, rebalance_check_every=CHECK_AT)
    return PipelineStage(bench_model(), stages, topo, device, OptimConfig(name="sgd", lr=0.01), settings)


class _Auto:
    """The rebalanced run: each step as the engine's loop runs it (the step, its migration, the check)."""

    def __init__(self, stage):
        self.stage, self.step_no, self.decision = stage, 0, None

    def step(self, x, y) -> tuple[bool, bool]:
        """One step; (whether the layer clock timed it, whether layers moved in it)."""
        self.step_no += 1
        armed = self.stage.layer_clock.armed
        self.stage.train_step(x, y)
        moved = self.stage.take_migration() is not None
        found = self.stage.check(self.step_no)
        if found is not None and found.changed and self.decision is None:
            self.decision = found
        return armed, moved


def side_by_side_job(topo, skewed: list[list[str]], even: list[list[str]], steps: int) -> dict:
    """On every stage's process. Returns {"first": [step], "rows": {variant: [step]}, "layouts", "costs"}, a
    step as _timed gives it; every rank's (the bench takes the slowest rank's step)."""
    from engine.bench.torch_pipeline import TorchPipeline
    import torch
    names = bench_model().names
    _pin(topo.rank)
    _keep_freed_memory()
    # the narrow trunk makes denormal floats, slow on the CPU (not on a GPU), and how many a step meets depends
    # on the weights, which differ by variant: flushed, one layout's step took ~100-120 ms, not ~135-150
    torch.set_flush_denormal(True)
    inputs = batches(CHECK_AT + 2 + WARMUP + steps)
    auto = _Auto(_trainyard(topo, skewed, "auto"))
    first = []
    for x, y in inputs[:CHECK_AT + 2]:
        first.append(_timed(auto.step, x, y))
        if first[-1][2]:   # layers moved in it
            break
    else:
        raise RuntimeError(f"the skewed start was not rebalanced at its check after step {CHECK_AT}")
    decided = auto.decision
    costs = (names, decided.layer_ms, len(skewed), decided.out_bytes, decided.link_bytes_per_ms, MICRO)
    best, best_ms = best_static(*costs)
    candidates = static_candidates(*costs)
    stages = {"skewed": _trainyard(topo, skewed, "off"),
              **{f"best{i}": _trainyard(topo, split, "off") for i, split in enumerate(candidates)},
              "even": _trainyard(topo, even, "off"),
              "even_uncounted": _trainyard(topo, even, "off", count_activations=False)}
    baseline = TorchPipeline(topo, "engine.bench.pipeline_model:bench_model", {}, even, MICRO,
                             {"name": "sgd", "lr": 0.01})
    variants = {"auto": auto.step, **{name: _static(s.train_step) for name, s in stages.items()},
                "torch": _static(baseline.step)}
    rows = {name: [] for name in variants}
    for k, (x, y) in enumerate(inputs[len(first):len(first) + WARMUP + steps]):
        order = list(variants)
        random.Random(k).shuffle(order)   # the same order on every rank; a new one every turn
        for name in order:
            dist.barrier(group=topo.compute)
            rows[name].append(_timed(variants[name], x, y))
    for stage in (auto.stage, *stages.values()):
        stage.close()
    rate = decided.link_bytes_per_ms
    return {"first": first, "rows": rows,
            "layouts": {"after": auto.stage.stage_layers, "modelled_best": best, "best_modelled_ms": best_ms,
                        "candidates": candidates},
            "costs": {"layer_ms": decided.layer_ms, "out_bytes": decided.out_bytes,
                      "link_bytes_per_ms": None if rate == float("inf") else rate, "micro_batches": MICRO}}


def _timed(step, x, y) -> tuple[float, bool, bool, int]:
    """(ms, whether the layer clock timed the step, whether layers moved in it, minor page faults in it)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    armed, moved = step(x, y)
    ms = (time.perf_counter() - t0) * 1000
    return ms, armed, moved, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def _pin(rank: int) -> None:
    """Stage r's process on core r alone, where the machine has a core for every stage (as each stage has a
    device of its own): every variant's stage r then runs on the same core, whose speed is what it is."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _keep_freed_memory() -> None:
    """glibc keeps the memory a step frees for the next step, as torch's CUDA caching allocator keeps a GPU's.
    Its default hands freed memory at the top of the heap back to the system, and with the variants taking
    turns, each step of the last stage took 5,000 to 8,500 minor page faults (20 to 33 MB faulted in again,
    some 10% of its time, more after some variants than others), against under 100 a step for a variant
    alone; with these settings, under 100 in turns too. No trimming (M_TRIM_THRESHOLD), and blocks up to
    32 MB from the heap (M_MMAP_THRESHOLD), where glibc is the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


def _static(run):
    """A variant that never times its layers nor moves them: `run(x, y)` is its step."""
    def step(x, y) -> tuple[bool, bool]:
        run(x, y)
        return False, False
    return step
