"""Rank 0's step record (docs/telemetry.md): every rank's row from the boundary's exchange, the time split, the
streams, the stages, the layer table, and the events a step's figures raise (a rank over its capacity, a step
skipped or rolled back by the clipping guard).

    report = StepReport(tel, cfg, strategy, layer_rows)
    report.step(step, loss, table, samples_per_s, layers, lr)     # rank 0; others return at once

Imports engine.runtime.control.
"""

from __future__ import annotations

import torch

from engine.runtime.control import Peaks, rank_rows


class StepReport:
    def __init__(self, tel, cfg, strategy, layer_rows, topo):
        self.tel, self.cfg, self.strategy, self.layer_rows, self.topo = tel, cfg, strategy, layer_rows, topo
        self.peaks = Peaks(topo.world_size)
        self.over_reported: set[int] = set()

    def step(self, step: int, loss: float, table: torch.Tensor, samples_per_s: float, layers, lr: float) -> None:
        if not self.topo.is_first:
            return
        ranks = rank_rows(table)
        self.peaks.note(ranks)
        self._over_capacity(step, ranks)
        me = ranks[0]
        updater = self.strategy.updater
        streams = self.strategy.stream_stats(me["step_ms"])
        record = {"step": step, "loss": loss, "samples_per_s": samples_per_s,
                  "step_ms": max(e["step_ms"] for e in ranks), "ranks": ranks,
                  "time_split": {"compute_ms": round(me["fwd_ms"] + me["bwd_ms"] + me["optim_ms"], 4),
                                 "comm_ms": sum(s["busy_ms"] for s in streams), "wait_ms": me["wait_ms"]},
                  "streams": streams, "lr": lr, **updater.decision.fields(), **self.strategy.stage_rows(ranks)}
        layers = self.layer_rows.report(layers)
        if layers is not None:
            record["layers"] = layers
            self.tel.update_state(layers=layers)
        self.tel.update_state(step=step)
        self.tel.step(record)
        decision = updater.decision   # a rollback is rare: the steps after it wait
        if decision.skipped:
            self.tel.event("step_skipped", step, grad_norm=record["grad_norm"], redone_layers=decision.redone_layers)
        elif decision.redone_layers:
            self.tel.event("step_rolled_back", step, grad_norm=decision.grad_norm, clip=self.cfg.optim.clip_grad_norm,
                           redone_layers=decision.redone_layers)

    def _over_capacity(self, step: int, ranks: list[dict]) -> None:
        for entry in ranks:
            r = entry["rank"]
            if entry["over_capacity"] and r not in self.over_reported:
                self.over_reported.add(r)
                self.tel.event("memory_over_capacity", step, rank=r, peak_bytes=entry["peak_bytes"],
                               capacity_bytes=entry["capacity_bytes"])
                self.tel.note(f"[yellow]warning:[/] rank {r} went over its device capacity "
                              f"({entry['peak_bytes']} > {entry['capacity_bytes']} bytes)")
