"""The records every run writes alike, whichever loop drives it (the step loop, engine/run/worker.py; the
parameter server's coordinator): its hello, its start, its step records; and the stop a signal requests. The
run core (engine/runtime/run_core.py) writes them.

    stop = StopRequest()                        # SIGINT/SIGTERM -> a flag the loop reads at its boundary
    tel = Telemetry.open(job, hello(cfg, topo, device, names, layout, updated, capabilities), ...)
    announce(tel, cfg, topo, device, names, first_step, restart, resumed_from)   # rank 0: run_start
    core.record(step_record(step, loss, lr, ranks, samples_per_s=..., step_ms=..., ...))   # rank 0, every step

Imports (when a hello is made) the strategies' registry and their figures (engine/strategies/specs/).
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


def hello(cfg, topo, device, names, layout: dict, updated_layers: list[str], loop_commands=()) -> dict:
    """What the hub says to every console that connects (docs/protocol.md, hello), whichever loop runs:
    `updated_layers`, the layers with an optimizer update of their own; `capabilities`, the commands taken (the
    strategy's, from its spec, then the loop's own `loop_commands`) and `declined`, those its config turns off
    with why; `figures`, the declarations of the figures this strategy's rank entries carry, from which a
    console learns what each panel shows."""
    from engine.strategies.specs import STRATEGIES   # each strategy's commands (the config's floor)
    from engine.strategies.specs.figures import declared   # every run's figures and the strategy's own
    spec = STRATEGIES[cfg.parallel.strategy]
    own = list(spec.commands(cfg))
    capabilities = own + [c for c in loop_commands if c not in own]
    return {"run": cfg.run.name, "mode": cfg.parallel.strategy, "world_size": topo.world_size,
            **world_range(cfg), "hosts": topo.hosts(), "backend": topo.backend, **device_fields(device),
            "layers": list(names), "layout": layout, "updated_layers": updated_layers,
            "capabilities": capabilities, "declined": spec.declined(cfg), "steps": cfg.run.steps,
            "config": cfg.to_dict(),
            "figures": declared(cfg.parallel.strategy)}


def step_record(step: int, loss: float | None, lr: float, ranks, *, samples_per_s: float,
                step_ms: float, compute_ms: float, comm_ms: float, wait_ms: float, streams: list[dict],
                throughput: dict | None = None, **more) -> dict:
    """A step record (docs/telemetry.md, step), whichever loop writes it: what every one has, rank 0's time split
    among them, then `throughput` (tokens_per_s, mfu where known) and `more`, a mode's own (a pipeline's
    stages, the update's decision, a parameter server's `ps`). `ranks`: every rank's full row, or what reads
    them a column at a time (engine/runtime/control.py RankFigures); the log's writer makes its rows or its
    `per_rank` columns of either (engine/telemetry/outlets.py)."""
    return {"step": step, "loss": loss, "samples_per_s": samples_per_s, "step_ms": step_ms, **(throughput or {}),
            "ranks": ranks, "time_split": {"compute_ms": compute_ms, "comm_ms": comm_ms, "wait_ms": wait_ms},
            "streams": streams, "lr": lr, **more}


def announce(tel, cfg, topo, device, names, first_step: int, restart: int, resumed_from,
             layout: dict | None = None, resumed: dict | None = None, joined: bool = False) -> None:
    """Rank 0: the run_start record (with the hello's `figures`, which a replay of the log learns from), and the
    restart and resume events (`resumed`: the resume event's other fields, the load's time and the job shape
    that wrote the checkpoint; `joined`: the launcher restarted the group for a host that joins)."""
    if not topo.is_first:
        return
    from engine.strategies.specs.figures import declared
    start = {"type": "run_start", "name": cfg.run.name, "strategy": cfg.parallel.strategy,
             "world_size": topo.world_size, **world_range(cfg), "hosts": topo.hosts(), "backend": topo.backend,
             **device_fields(device),
             "layers": list(names), "first_step": first_step,
             "restart": restart, "config": cfg.to_dict(), "figures": declared(cfg.parallel.strategy)}
    if layout is not None:
        start["layout"] = layout
    tel._write(start)
    was = (resumed or {}).get("from_world_size")
    host_joined = restart and (joined or (was is not None and was < topo.world_size))
    if restart:
        tel.event("restart", first_step, restart=restart, max_restarts=cfg.parallel.max_restarts)
        # a restart for a host that joins counts no failure (parallel.max_restarts counts those)
        head = f"restart {restart}:[/] a host joined" if host_joined else \
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
