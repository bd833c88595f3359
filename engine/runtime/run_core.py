"""One run core, two drivers: what every run does, whichever loop drives its steps. The data-parallel and
pipeline step loop (engine/run/worker.py) and the parameter server's coordinator
(engine/strategies/param_server/coordinator.py) each hold a RunCore and hand it the same things: the hello,
where the run resumes, every operator command, every step record, every checkpoint published, the end.

    resume = resume_point(cfg, job, restart)     # None, or the checkpoint this run resumes from (any strategy's)
    core = RunCore(job, topo, Telemetry.open(job, hello(...), ...), driver)   # rank 0's telemetry: the log
    core.start(device, names, first_step, restart, resume)         # rank 0: run_start, restart, resume events
    core.take(command, step)                     # pause, resume, checkpoint, stop, or the driver's own
    core.record(step_record(step, loss, lr, ranks, ...))           # rank 0: peaks, over-capacity, the log
    core.checkpointed(step, path, stall_ms, write_ms, published_ms)   # rank 0: the checkpoint event
    summary = core.end(step, stopped_early, loss, accuracy, fields)   # rank 0: stop, summary, consoles told

A driver gives `checkpoint(step)` (the operator's checkpoint command), `own_command(command, step)` (a command
of its mode: True once applied, None when answered later, False when not taken), `paused_changed()` and
`stopping()` (the coordinator tells its servers). The core never asks which strategy drives it.

Imports engine.runtime (checkpoint, checkpoint_writer, control, lifecycle) and engine.telemetry.records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from engine.runtime import checkpoint as ckpt
from engine.runtime.checkpoint_writer import published
from engine.runtime.control import Peaks
from engine.runtime.lifecycle import announce
from engine.telemetry.records import figure_column


@dataclass
class Resume:
    """The checkpoint a run resumes from: its folder and manifest (checksummed already, by the launcher's
    prepare_run_dir or, after a restart, by resume_source)."""

    source: Path
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def reader(self) -> "ckpt.Reader":
        """Its tensors by name (any strategy's, any world size's), once its format is one this build reads."""
        ckpt.check_format(self.source, self.manifest)
        return ckpt.Reader(self.source, self.manifest)

    def same_shape(self, world_size: int, strategy: str) -> bool:
        """Written by a job of this shape: each rank's RNG carries over."""
        return self.manifest["world_size"] == world_size and self.manifest["layout"].get("strategy") == strategy


def resume_point(cfg, job, restart: int) -> Resume | None:
    """Where the run resumes: `job.resume` (a path, "latest"), or after a restart its latest checkpoint."""
    source = ckpt.resume_source(cfg.run_dir, job.resume, restart)
    return None if source is None else Resume(source, ckpt.verify(source, checksums=False))


class RunCore:
    def __init__(self, job, topo, tel, driver):
        self.job, self.cfg, self.topo, self.tel, self.driver = job, job.config, topo, tel, driver
        self.paused = False
        self.stop_reason: str | None = None
        self.stop_command: dict | None = None
        self.peaks = Peaks(topo.world_size)   # every rank's highest figures, for the summary
        self.over_reported: set[int] = set()

    def start(self, device, names, first_step: int, restart: int, resume: Resume | None,
              layout: dict | None = None, resumed: dict | None = None, **state) -> None:
        """The consoles' state at the start (`state`: a mode's own, a parameter server's sync), and rank 0's
        run_start, restart, resume and resize records (`resumed`: the resume event's other fields)."""
        self.tel.update_state(step=first_step, steps=self.cfg.run.steps, paused=False, **state)
        announce(self.tel, self.cfg, self.topo, device, names, first_step, restart,
                 resume.source if resume else None, layout, resumed, joined=getattr(self.job, "joined", False))

    # --- the operator's commands ----------------------------------------------------------------
    def take(self, command: dict, step: int) -> None:
        """One operator command, answered: applied, rejected, or (stop) once the final checkpoint is written."""
        name = command["name"]
        if name in ("pause", "resume"):
            self.paused = name == "pause"
            self.driver.paused_changed()
            self.tel.update_state(paused=self.paused)
        elif name == "checkpoint":
            self.driver.checkpoint(step)
        elif name == "stop":
            self.stop_command = command
            self.begin_stop("command")
            return
        else:
            taken = self.driver.own_command(command, step)
            if taken is None:
                return
            if not taken:   # the hub rejects these in this mode; a command from elsewhere gets the same answer
                mode = self.cfg.parallel.strategy
                self.tel.reply(command, "rejected", reason=f"{name} is not available in mode {mode}")
                return
        self.tel.reply(command, "applied", step=step)

    def begin_stop(self, reason: str) -> None:
        """The run stops at its next boundary: a signal, a command, its steps done (the first reason stands
        where the driver checks stop_reason first)."""
        self.stop_reason = reason
        self.driver.stopping()

    # --- what rank 0 writes -----------------------------------------------------------------------
    def record(self, record: dict) -> None:
        """Rank 0: one step record (engine/runtime/lifecycle.py step_record), whichever driver made it: its
        ranks' peaks kept for the summary, a rank over its capacity said once, the record logged."""
        ranks = record["ranks"]   # full rows, or read a column at a time (engine/runtime/control.py RankFigures)
        self.peaks.note(ranks)
        over = figure_column(ranks, "over_capacity")
        if any(over):
            order = figure_column(ranks, "rank")
            peak, capacity = figure_column(ranks, "peak_bytes"), figure_column(ranks, "capacity_bytes")
            for i, r in enumerate(order):
                if over[i] and r not in self.over_reported:
                    self.over_reported.add(r)
                    self.tel.event("memory_over_capacity", record["step"], rank=r, peak_bytes=peak[i],
                                   capacity_bytes=capacity[i])
                    self.tel.note(f"[yellow]warning:[/] rank {r} went over its device capacity "
                                  f"({peak[i]} > {capacity[i]} bytes)")
        self.tel.step(record)

    def checkpointed(self, step: int, path: Path, stall_ms: float, write_ms: float, published_ms: float) -> None:
        """Rank 0: checkpoint `step` is published at `path` (its manifest written, the folder renamed)."""
        self.tel.event("checkpoint", step, **published(path, stall_ms, write_ms, published_ms))

    def end(self, step: int, stopped_early: bool, loss: float | None, evaluated: dict, fields: dict) -> dict:
        """Rank 0, once the final checkpoint is written: the stop event and reply, the summary (the last
        evaluation's figures, engine/training/evaluation.py; its peaks, then `fields`: the driver's own,
        restarts...), the consoles told. Returns the summary."""
        if stopped_early:
            self.tel.event("stop", step, reason=self.stop_reason)
        if self.stop_command:
            self.tel.reply(self.stop_command, "applied", step=step)
        summary = {"name": self.cfg.run.name, "final_loss": loss, **evaluated, "steps": step,
                   "wall_s": time.time() - (self.job.launched_at or time.time()), **self.peaks.summary(), **fields,
                   "stopped_early": stopped_early}
        self.tel.summary(summary)
        self.tel.close("run stopped" if stopped_early else "run finished")
        return summary
