"""The model, the layouts and the ideal of `trainyard bench pipeline` (engine/bench/pipeline.py), which its
job on every stage's process (engine/bench/pipeline_job.py) builds too."""

from __future__ import annotations

import itertools
import math
import os

import torch
from torch import nn

STAGES = 4   # the default where the machine has the cores (default_stages)
BATCH, MICRO = 256, 8
HIDDEN, DEPTH, WIDE, CLASSES = 256, 16, 2048, 10
THRESHOLD = 0.2


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


def _splits(names: list[str], layer_ms: dict[str, float], stages: int, out_bytes: dict[str, int] | None,
            link_bytes_per_ms: float, micro_batches: int) -> list[tuple[float, int, list[list[str]]]]:
    """Every split of the layers into `stages` contiguous stages, in order of its cuts: (its modelled slowest
    stage, its boundary bytes, the split). A stage's modelled cost: its layers' time plus its boundary sends
    (each micro-batch's output forward and its input's gradient back, at the link rate), the objective the
    rebalancer's partition() minimises."""
    nbytes = out_bytes or {}
    splits = []
    for cuts in itertools.combinations(range(1, len(names)), stages - 1):
        bounds = (0, *cuts, len(names))
        slowest = 0.0
        for a, b in zip(bounds, bounds[1:]):
            t = sum(layer_ms[n] for n in names[a:b])
            sent = ((nbytes.get(names[a - 1], 0) if a > 0 else 0)
                    + (nbytes.get(names[b - 1], 0) if b < len(names) else 0))
            slowest = max(slowest, t + (micro_batches * sent / link_bytes_per_ms if sent else 0.0))
        boundary = sum(nbytes.get(names[c - 1], 0) for c in cuts)
        splits.append((slowest, boundary, [names[a:b] for a, b in zip(bounds, bounds[1:])]))
    return splits


def best_static(names: list[str], layer_ms: dict[str, float], stages: int = STAGES,
                out_bytes: dict[str, int] | None = None, link_bytes_per_ms: float = math.inf,
                micro_batches: int = 1) -> tuple[list[list[str]], float]:
    """The split with the smallest modelled slowest stage, by brute force (the first of equals), and that
    figure."""
    slowest, _, split = min(_splits(names, layer_ms, stages, out_bytes, link_bytes_per_ms, micro_batches),
                            key=lambda s: s[0])
    return split, slowest


def static_candidates(names: list[str], layer_ms: dict[str, float], stages: int = STAGES,
                      out_bytes: dict[str, int] | None = None, link_bytes_per_ms: float = math.inf,
                      micro_batches: int = 1, ties: float = 0.05, most: int = 3) -> list[list[list[str]]]:
    """The splits the bench measures for "best static": the modelled optimum (best_static's), and for every other
    total of boundary bytes among the splits within `ties` of it, the fastest such split, at most `most` in all,
    fastest first. The model counts a boundary's bytes at the link's rate but not the CPU a send costs, so two
    splits it puts within a few % (the optimum cut after a wide layer, 8x the bytes, and the next cut after a
    narrow one) measured 8-12% apart here, and which one the model put first changed from run to run: measuring
    both, the bench's best static is the faster one measured, the same every run."""
    splits = sorted(_splits(names, layer_ms, stages, out_bytes, link_bytes_per_ms, micro_batches),
                    key=lambda s: s[0])
    limit = splits[0][0] * (1 + ties)
    chosen, seen = [], set()
    for slowest, boundary, split in splits:
        if slowest > limit or len(chosen) == most:
            break
        if boundary not in seen:
            seen.add(boundary)
            chosen.append(split)
    return chosen


def bubble_bound_ms(stage_ms: list[float], micro_batches: int) -> float:
    """A 1F1B step's time from its stages' per-step times: every stage's work on one micro-batch passes
    once along the pipeline, and the slowest stage's on the other m - 1 (the bubble's bound)."""
    return sum(stage_ms) / micro_batches + (micro_batches - 1) / micro_batches * max(stage_ms)


def batches(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, HIDDEN, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
            for _ in range(steps)]
