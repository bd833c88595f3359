"""Rank 0's step record (docs/telemetry.md): every rank's row from the boundary's exchange, the time split, the
streams, the stages, the layer table, and the events a step's figures raise (a rank over its capacity, a step
skipped or rolled back by the clipping guard).

    report = StepReport(core, cfg, strategy, layer_rows, topo)   # core: the run's (engine/runtime/run_core.py)
    report.throughput = Throughput(tokens_per_step, peak_flops)   # once known (the first step's batch)
    report.step(step, loss, table, wall_s, layers, lr)     # rank 0; others return at once

`wall_s`: the time between this step's record and the last one's, what samples_per_s, tokens_per_s and mfu
divide by (the step as a user's loop would time it, the boundary's exchange and report included).

The run core keeps the peaks and says a rank over its capacity, for every driver's records alike.

Imports engine.runtime.control and engine.runtime.lifecycle (step_record: the fields every step record has).
"""

from __future__ import annotations

import collections
import statistics

from engine.runtime.control import RankFigures, Table, column
from engine.runtime.lifecycle import step_record


class StepReport:
    def __init__(self, core, cfg, strategy, layer_rows, topo):
        self.core, self.tel, self.cfg, self.strategy = core, core.tel, cfg, strategy
        self.layer_rows, self.topo = layer_rows, topo
        self.throughput = Throughput()

    def step(self, step: int, loss: float, table: Table, wall_s: float, layers, lr: float) -> None:
        if not self.topo.is_first:
            return
        wall_s = max(wall_s, 1e-9)
        ranks = RankFigures(table)   # every rank's full row only where the log keeps it (docs/telemetry.md)
        me = ranks.row(0)
        updater = self.strategy.updater
        streams = self.strategy.stream_stats(me["step_ms"])
        record = step_record(step, loss, lr, ranks, samples_per_s=self.cfg.data.batch_size / wall_s,
                             step_ms=max(ranks.column("step_ms")),
                             compute_ms=round(me["fwd_ms"] + me["bwd_ms"] + me["optim_ms"], 4),
                             comm_ms=sum(s["busy_ms"] for s in streams), wait_ms=me["wait_ms"], streams=streams,
                             throughput=self.throughput.fields(wall_s, table), **updater.decision.fields(),
                             **self.strategy.stage_rows(ranks))
        layers = self.layer_rows.report(layers)
        if layers is not None:
            record["layers"] = layers
            self.tel.update_state(layers=layers)
        self.tel.update_state(step=step)
        self.core.record(record)
        decision = updater.decision   # a rollback is rare: the steps after it wait
        if decision.skipped:
            self.tel.event("step_skipped", step, grad_norm=record["grad_norm"], redone_layers=decision.redone_layers)
        elif decision.redone_layers:
            self.tel.event("step_rolled_back", step, grad_norm=decision.grad_norm, clip=self.cfg.optim.clip_grad_norm,
                           redone_layers=decision.redone_layers)


SUMMARY_STEPS = 10_000   # the summary's tokens_per_s and mfu: the median of the latest steps, bounded


class Throughput:
    """A step's tokens_per_s and mfu from its wall time: `tokens_per_step` (the global batch's tokens; 0 where
    samples are not sequences) and the device's `peak_flops` (None where unknown: no mfu)."""

    def __init__(self, tokens_per_step: int = 0, peak_flops: float | None = None, devices: int = 1):
        self.tokens_per_step, self.peak_flops, self.devices = tokens_per_step, peak_flops, devices
        # the summary's: each figure of the latest SUMMARY_STEPS steps after the first (a day's run holds as much)
        self.seen = {key: collections.deque(maxlen=SUMMARY_STEPS) for key in ("tokens_per_s", "mfu")}
        self._steps = 0

    def summary(self) -> dict:
        """The median tokens_per_s and mfu of the run's latest SUMMARY_STEPS steps, its first step left out
        (warm-up: allocations, compiles) where there were others."""
        return {key: float(f"{statistics.median(values):.6g}") for key, values in self.seen.items() if values}

    def fields(self, wall_s: float, table: Table) -> dict:
        """The step's figures; `table`: the boundary's (its `flops` column: every rank's counted FLOPs a step,
        0 until a rank has counted, and then no mfu yet)."""
        out = {}
        if self.tokens_per_step:
            out["tokens_per_s"] = round(self.tokens_per_step / wall_s, 1)
        if self.peak_flops:
            flops = column(table, "flops")
            if all(f > 0 for f in flops):
                out["mfu"] = float(f"{sum(flops) / (wall_s * self.peak_flops * self.devices):.6g}")
        if self._steps == 1:   # the first step (warm-up) leaves the summary once another comes
            for values in self.seen.values():
                values.clear()
        self._steps += 1
        for key, value in out.items():
            self.seen[key].append(value)
        return out
