"""Measured stage times and the rebalance threshold, pure functions beside the partitioner (partition.py).

    stage_times(layout, layer_ms)          # each stage's summed layer times
    needs_rebalance(stage_ms, 4.0)         # max - min over 4 ms?
    threshold_in_ms(0.2, stage_ms)         # a fraction of the mean stage time, or ms (> 1)

Imports engine.strategies.pipeline.partition (Layout) and engine.telemetry.records (figure_column). `stage_rows`: a
PipelineStage's step-record rows.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from engine.strategies.pipeline.partition import Layout
from engine.telemetry.records import figure_column


def stage_times(layout_or_stages: Layout | Sequence[Sequence[str]],
                layer_ms: Mapping[str, float]) -> list[float]:
    """Per-stage sum of `layer_ms` for a Layout or a list of layer-name lists."""
    stages = layout_or_stages.stages if isinstance(layout_or_stages, Layout) else layout_or_stages
    out: list[float] = []
    for stage in stages:
        t = 0.0
        for name in stage:
            if name not in layer_ms:
                raise ValueError(f"no timing for layer {name!r}")
            t += layer_ms[name]
        out.append(t)
    return out


def needs_rebalance(stage_ms: Sequence[float], threshold_ms: float) -> bool:
    """True when the slowest and fastest stages differ by more than threshold_ms."""
    if not stage_ms:
        return False
    return max(stage_ms) - min(stage_ms) > threshold_ms


def threshold_in_ms(value: float, stage_ms: Sequence[float]) -> float:
    """A threshold in ms: value > 1 is ms; 0 < value <= 1 is a fraction of the mean stage time.

    0 stays 0.  Negative, NaN, infinite or non-numeric values raise ValueError, as does
    a fraction when `stage_ms` is empty (there is no mean to take it of).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"threshold must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"threshold must be >= 0, got {value!r}")
    if value == 0:
        return 0.0
    if value > 1:
        return float(value)
    if not stage_ms:
        raise ValueError(f"threshold {value!r} is a fraction of the mean stage time, "
                         f"but no stage times were given")
    return value * (sum(stage_ms) / len(stage_ms))


def stage_rows(st, ranks) -> dict:
    """The step record's `stages` (one per stage, from every rank's timings: with replicas, its slowest
    replica's, and every replica's busy time in `replicas_ms`) and `imbalance_ms`, of the PipelineStage `st`.
    `ranks`: the step's rank rows (engine.telemetry.records figure_column), read a figure at a time."""
    rows = []
    fwd, bwd, optim, wall, sent = (figure_column(ranks, name) for name in
                                   ("fwd_ms", "bwd_ms", "optim_ms", "step_ms", "sent_bytes"))
    order = figure_column(ranks, "rank")
    index = {rank: i for i, rank in enumerate(order)}
    for stage, names in enumerate(st.stage_layers):
        held = [index[rank] for rank in st.grid.group_of(stage)]
        i = max(held, key=lambda i: fwd[i] + bwd[i])   # the stage waits for its slowest replica
        busy = fwd[i] + bwd[i] + optim[i]
        rows.append({"stage": stage, "rank": order[i], "layers": names,
                     "fwd_ms": fwd[i], "bwd_ms": bwd[i], "idle_ms": round(max(0.0, wall[i] - busy), 4),
                     "micro_batches": st.micro_batches, "sent_bytes": sent[i] or 0})
        if len(held) > 1:
            rows[-1]["replicas_ms"] = [round(fwd[j] + bwd[j], 4) for j in held]
    busy = [row["fwd_ms"] + row["bwd_ms"] for row in rows]
    # the threshold a check would apply to these stage times (a fraction is of their mean)
    threshold_ms = threshold_in_ms(st.rebalancer.threshold, busy)
    return {"stages": rows, "imbalance_ms": round(max(busy) - min(busy), 4),
            "threshold_ms": round(threshold_ms, 4), "migrating": st.migration is not None}
