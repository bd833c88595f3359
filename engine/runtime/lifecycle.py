"""What every run does alike at its start, in its step records, at the operator's commands and at its end,
whichever loop drives it:
the data-parallel and pipeline step loop (engine/run/worker.py) and the parameter server's coordinator
(engine/strategies/param_server/coordinator.py).

    stop = StopRequest()                        # SIGINT/SIGTERM -> a flag the loop reads at its boundary
    tel = Telemetry.open(job, hello(cfg, topo, device, names, layout, updated, capabilities), ...)
    announce(tel, cfg, topo, device, names, first_step, restart, resumed_from)   # rank 0: run_start
    tel.step(step_record(step, loss, lr, ranks, samples_per_s=..., step_ms=..., ...))   # rank 0, every step
    class Loop(RunControl): ...                 # take(command, step) for every command; end(...) once

Imports torch (nothing else of the engine's own).
"""

from __future__ import annotations

import signal
import time


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop acts on it at the next boundary. `grace_s`: how long the process has
    from the first signal on before it is killed (the elastic agent's parallel.shutdown_timeout_s, and the
    lifeline's: engine/processes/lifeline.py)."""

    def __init__(self, grace_s: float = float("inf")):
        self.signal: int | None = None
        self.at: float | None = None   # time.monotonic() of the first signal
        self.grace_s = grace_s
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is None:
            self.at = time.monotonic()
        self.signal = signum

    def seconds_left(self) -> float:
        """Seconds until this process is killed; infinite where no signal came."""
        return float("inf") if self.at is None else self.grace_s - (time.monotonic() - self.at)

    @property
    def requested(self) -> bool:
        return self.signal is not None


def device_fields(device) -> dict:
    """What hello and run_start say of the devices: rank 0's name, whether simulated, every rank's
    name, and which device the run uses and why."""
    return {"device": device.name, "simulated": device.simulated,
            "devices": list(device.rank_names or [device.name]), "device_note": device.note}


def world_range(cfg) -> dict:
    """What hello says of a run over a range of hosts (`--nnodes MIN:MAX`): `max_world_size`, the world at MAX
    hosts (`parallel.world_size`), which the consoles show beside the world the run has now; nothing else."""
    return {"max_world_size": cfg.parallel.world_size} if len(cfg.cluster.host_counts) > 1 else {}


def hello(cfg, topo, device, names, layout: dict, updated_layers: list[str], capabilities: list[str]) -> dict:
    """What the hub says to every console that connects (docs/protocol.md, hello), whichever loop runs:
    `updated_layers`, the layers with an optimizer update of their own; `capabilities`, the commands taken."""
    return {"run": cfg.run.name, "mode": cfg.parallel.strategy, "world_size": topo.world_size,
            **world_range(cfg), "hosts": topo.hosts(), "backend": topo.backend, **device_fields(device),
            "layers": list(names), "layout": layout, "updated_layers": updated_layers,
            "capabilities": capabilities, "steps": cfg.run.steps, "config": cfg.to_dict()}


def step_record(step: int, loss: float | None, lr: float, ranks: list[dict], *, samples_per_s: float,
                step_ms: float, compute_ms: float, comm_ms: float, wait_ms: float, streams: list[dict],
                throughput: dict | None = None, **more) -> dict:
    """A step record (docs/telemetry.md, step), whichever loop writes it: what every one has, rank 0's time split
    among them, then `throughput` (tokens_per_s, mfu where known) and `more`, a mode's own (a pipeline's
    stages, the update's decision, a parameter server's `ps`)."""
    return {"step": step, "loss": loss, "samples_per_s": samples_per_s, "step_ms": step_ms, **(throughput or {}),
            "ranks": ranks, "time_split": {"compute_ms": compute_ms, "comm_ms": comm_ms, "wait_ms": wait_ms},
            "streams": streams, "lr": lr, **more}


def announce(tel, cfg, topo, device, names, first_step: int, restart: int, resumed_from,
             layout: dict | None = None, resumed: dict | None = None) -> None:
    """Rank 0: the run_start record, and the restart and resume events (`resumed`: the resume event's other
    fields, the load's time and the job shape that wrote the checkpoint)."""
    if not topo.is_first:
        return
    start = {"type": "run_start", "name": cfg.run.name, "strategy": cfg.parallel.strategy,
             "world_size": topo.world_size, **world_range(cfg), "hosts": topo.hosts(), "backend": topo.backend,
             **device_fields(device),
             "layers": list(names), "first_step": first_step,
             "restart": restart, "config": cfg.to_dict()}
    if layout is not None:
        start["layout"] = layout
    tel._write(start)
    was = (resumed or {}).get("from_world_size")
    grew = restart and was is not None and was < topo.world_size
    if restart:
        tel.event("restart", first_step, restart=restart, max_restarts=cfg.parallel.max_restarts)
        # a restart for a host that joins counts no failure (parallel.max_restarts counts those)
        head = f"restart {restart}:[/] a host joined" if grew else \
            f"restart {restart} of {cfg.parallel.max_restarts}:[/] a worker failed"
        tel.note(f"[yellow]{head}; resumed from step {first_step}")
    if first_step:
        tel.event("resume", first_step, checkpoint=str(resumed_from), **(resumed or {}))
        if not restart:
            tel.note(f"resumed from {resumed_from} at step {first_step}")
    if restart and was is not None and was != topo.world_size:
        hosts = sorted(set(topo.hosts()))
        tel.event("resize", first_step, from_world_size=was, world_size=topo.world_size, hosts=hosts,
                  max_hosts=cfg.cluster.nnodes)
        tel.note(f"[yellow]resized:[/] {was} -> {topo.world_size} workers on {len(hosts)} of {cfg.cluster.nnodes} "
                 f"hosts ({', '.join(map(str, hosts))}); resumed from step {first_step}")


class RunControl:
    """The operator's commands every run takes (pause, resume, checkpoint, stop) and the end of a run. A loop
    gives `tel`, `mode` and its own `checkpoint(step)`; `own_command` takes the commands of its mode."""

    tel = None    # the run's telemetry (engine/telemetry/outlets.py)
    cfg = None    # the run's Config
    job = None    # the run's Job (engine/run/rank.py)
    mode = ""
    paused = False
    stop_reason: str | None = None
    stop_command: dict | None = None

    def checkpoint(self, step: int) -> None:
        raise NotImplementedError

    def own_command(self, command: dict, step: int) -> bool | None:
        """A command of this mode: True once applied, None when answered later (or already), False: not taken."""
        return False

    def paused_changed(self) -> None:
        """After pause or resume (the coordinator tells its servers)."""

    def begin_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def take(self, command: dict, step: int) -> None:
        """One operator command, answered: applied, rejected, or (stop) once the final checkpoint is written."""
        name = command["name"]
        if name in ("pause", "resume"):
            self.paused = name == "pause"
            self.paused_changed()
            self.tel.update_state(paused=self.paused)
        elif name == "checkpoint":
            self.checkpoint(step)
        elif name == "stop":
            self.stop_command = command
            self.begin_stop("command")
            return
        else:
            taken = self.own_command(command, step)
            if taken is None:
                return
            if not taken:   # the hub rejects these in this mode; a command from elsewhere gets the same answer
                self.tel.reply(command, "rejected", reason=f"{name} is not available in mode {self.mode}")
                return
        self.tel.reply(command, "applied", step=step)

    def end(self, step: int, stopped_early: bool, loss: float | None, accuracy: float | None, fields: dict) -> dict:
        """Rank 0, once the final checkpoint is written: the stop event and reply, the summary, the consoles
        told. `fields`: the rest of the summary (peaks, restarts...). Returns the summary."""
        if stopped_early:
            self.tel.event("stop", step, reason=self.stop_reason)
        if self.stop_command:
            self.tel.reply(self.stop_command, "applied", step=step)
        summary = {"name": self.cfg.run.name, "final_loss": loss, "test_accuracy": accuracy, "steps": step,
                   "wall_s": time.time() - (self.job.launched_at or time.time()), **fields,
                   "stopped_early": stopped_early}
        self.tel.summary(summary)
        self.tel.close("run stopped" if stopped_early else "run finished")
        return summary
