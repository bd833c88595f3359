"""Rank 0's outlets: the log file (complete), the hub (best effort, live), the progress bar.

    tel = Telemetry.open(job, hello, topo)      # a no-op Telemetry on ranks other than 0
    tel.step({"step": 1, "loss": ...}); tel.event("checkpoint", 10, path=...)
    for command in tel.take_commands(): ...; tel.reply(command, "applied", step=10)

The hub gets the same records as the log. It never holds training up: if it cannot
start (no private runtime directory, say), the run goes on without it and says so.

A step record keeps every rank's full row (`ranks`) only every `telemetry.rank_every` steps, on
the first step and on the step after a change (a policy, a placement, a plan, a migration, a
restart); the steps between carry the compact `per_rank` columns (engine.protocol.rank_columns),
which a reader overlays on the last full rows (engine.protocol.expand_ranks). The log keeps the
layer rows measured next after a full step or a change; consoles get them whenever they are measured. At 64 ranks and 200 layers
that is the difference between ~75 KB and ~3.5 KB a step.
"""

from __future__ import annotations

import math
import sys
import threading
import time

from engine.strategies.specs.figures import PANEL_COLUMNS   # the panels' figures: columns every step
from engine.telemetry.headless import HeadlessProgress
from engine.telemetry.log import TelemetryLog
from engine.telemetry.protocol import ps_columns, rank_columns

# events after which the next step carries every rank's full row (and the log its layer rows): what they
# change shows in the rows
FULL_ROWS_AFTER = frozenset({"policy", "placement", "memory_plan", "update_plan", "migration", "rebalance",
                             "resume", "restart", "resize", "worker_lost", "sync_mode",
                             "memory_over_capacity"})


def rebalance_in_flight(since: str = "") -> str:
    """Why a `rebalance` command is refused while one is in flight (`since`: since when, where the asker knows).
    The hub asks first (a decided layout waits for its migration); the stage at the boundary, for a command it
    has not yet answered (engine/strategies/pipeline/rebalancing.py)."""
    return "a rebalance is already in flight" + (f" ({since})" if since else "")


class RankRows:
    """Which step records carry every rank's full row: the first, every `every` steps, and the first after
    an event that changes what the rows say (FULL_ROWS_AFTER). The others get `per_rank` columns.

        rows = RankRows(every=50)
        record, full = rows.shape(record)      # before writing a step record
        rows.noted(event_kind)                 # for every event written
    """

    def __init__(self, every: int):
        self.every, self.due, self.next_full = every, True, 0
        self.layers_due = True   # the log keeps the next layer rows: the first, and the first after a full step

    def noted(self, kind: str) -> None:
        changed = kind in FULL_ROWS_AFTER
        self.due |= changed
        self.layers_due |= changed

    def for_log(self, record: dict) -> dict:
        """`record` as the log keeps it: its layer rows only when they are the first after the run's start,
        after a full step or after a change (consoles get them all), so the log shows each change's rows."""
        if "layers" not in record:
            return record
        if self.layers_due:
            self.layers_due = False
            return record
        return {key: value for key, value in record.items() if key != "layers"}

    def shape(self, record: dict) -> tuple[dict, bool]:
        step = record["step"]
        if self.due or step >= self.next_full:
            self.due, self.next_full, self.layers_due = False, step + self.every, True
            if "ranks" in record and not isinstance(record["ranks"], list):   # read a column at a time so far
                record = {**record, "ranks": record["ranks"].rows()}
            return record, True
        if "ranks" in record:
            record = {**record, "per_rank": rank_columns(record["ranks"], PANEL_COLUMNS)}
            del record["ranks"]
        if isinstance(record.get("ps"), dict) and "workers" in record["ps"]:
            record = {**record, "ps": ps_columns(record["ps"])}
        return record, False


class Telemetry:
    """What ranks other than 0 have: nothing to write, no commands to take."""

    writes = False   # rank 0's writes the log and the files its events name

    def step(self, record: dict) -> None: ...
    def event(self, kind: str, step: int, **fields) -> None: ...
    def note(self, text: str) -> None: ...
    def update_state(self, **fields) -> None: ...
    def take_commands(self) -> list[dict]: return []
    def reply(self, command: dict, status: str, **fields) -> None: ...
    def summary(self, record: dict) -> None: ...
    def close(self, reason: str) -> None: ...

    @staticmethod
    def open(job, hello: dict, is_first: bool, first_step: int) -> "Telemetry":
        return RankZeroTelemetry(job, hello, first_step) if is_first else Telemetry()


class RankZeroTelemetry(Telemetry):
    writes = True

    def __init__(self, job, hello: dict, first_step: int):
        cfg = job.config
        self.log = TelemetryLog(job.log_path(), max_bytes=cfg.telemetry.log_max_mb << 20)
        self.rank_rows, self.log_every = RankRows(cfg.telemetry.rank_every), cfg.telemetry.log_every
        self._lock = threading.Lock()   # the hub thread logs rejected commands too
        self.progress = HeadlessProgress(cfg.run.name, cfg.run.steps, first_step) if job.headless else None
        self.capabilities = set(hello["capabilities"])
        self.declined = dict(hello.get("declined", {}))
        self.layers = set(hello.get("layers", []))
        self.updated_layers = set(hello.get("updated_layers", self.layers))
        self.rebalancing: str | None = None   # set while a decided layout waits for its migration
        self.mode = hello["mode"]
        self.live_interval_s = 1.0 / cfg.telemetry.live_hz if cfg.telemetry.live_hz else 0.0
        self._last_live = 0.0
        self._unsent = None
        self.current_step = first_step
        self.nonfinite_said = False   # the first step whose loss is NaN or inf gets an event, the rest a flag
        self.hub = None
        if cfg.telemetry.hub:
            self.hub = self._start_hub(hello, cfg, first_step)

    def _start_hub(self, hello: dict, cfg, first_step: int):
        from engine.telemetry.hub import Hub
        try:   # a console that connects before the first step still gets the run's length in its snapshot
            hub = Hub(hello, validate=self._validate, listen=cfg.telemetry.listen or None,
                      queue_len=cfg.telemetry.queue_len,
                      state={"step": first_step, "steps": cfg.run.steps, "paused": False})
            hub.start()
        except Exception as e:   # training goes on without consoles
            print(f"trainyard: the telemetry hub could not start ({e}); training goes on without it",
                  file=sys.stderr, flush=True)
            return None
        where = hub.socket_path if not hub.tcp_address else f"{hub.socket_path} and {hub.tcp_address}"
        self.note(f"console socket: {where}")
        return hub

    def _validate(self, name: str, args: list[str]) -> str | None:
        """Engine-level check of a well-formed command (the hub has checked its shape)."""
        reason = None
        if name in ("set-policy", "set-placement") and args[0] not in self.layers:
            reason = f"unknown layer {args[0]!r}"
        elif name not in self.capabilities:   # a command its config turns off says why (the hello's `declined`)
            reason = self.declined.get(name) or f"{name} is not available in mode {self.mode}"
        elif name == "rebalance" and self.rebalancing is not None:
            reason = rebalance_in_flight(self.rebalancing)
        elif name == "set-placement" and args[0] not in self.updated_layers:
            reason = f"layer {args[0]!r} has no parameters: it has no optimizer update to place"
        if reason:
            self.event("command", self.current_step, name=name, args=args, status="rejected", reason=reason)
        return reason

    def step(self, record: dict) -> None:
        if self.log.failure:   # met on the hub's thread (a command's event): the run stops here
            raise self.log.failure
        step = self.current_step = record["step"]
        loss = record.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss) and not self.nonfinite_said:
            self.nonfinite_said = True
            self.event("nonfinite", step, what="loss", value=repr(loss))
            self.note(f"step {step}: the loss is {loss!r} (the log writes it as null, named in `nonfinite`)")
        record, full = self.rank_rows.shape(record)
        now = time.monotonic()
        # Consoles get a sample of the steps (every step with layer times or full rank rows included);
        # the log every `log_every`-th step and every full one. Layer times go to consoles whenever measured,
        # to the log once per full step and once per change (a 200-layer table every 10 steps would be most
        # of the log).
        live = now - self._last_live >= self.live_interval_s or "layers" in record or full
        if live:
            self._last_live = now
        with self._lock:
            stamped = self.log.stamp({"type": "step", **record})
            logged = self.rank_rows.for_log(stamped)
            if full or "layers" in logged or step % self.log_every == 0:
                self.log.write(logged, stamped=True)
        if self.hub and live:
            self.hub.publish(stamped)
        self._unsent = None if live else stamped
        if self.progress:
            self.progress.update(record["step"], record["loss"], record["samples_per_s"])

    def event(self, kind: str, step: int | None, **fields) -> None:
        if kind in ("rebalance", "migration"):   # a decided layout is in flight until its migration is reported
            self.rebalancing = f"decided at step {step}" if kind == "rebalance" else None
        self.rank_rows.noted(kind)
        self._write({"type": "event", "kind": kind, "step": step, **fields})

    def _write(self, record: dict, live: bool = True) -> dict:
        """Log the record and send it to consoles. Once the log has failed, consoles alone get it: the run is
        stopping (its failure was raised from the write that met it)."""
        with self._lock:
            record = self.log.stamp(record) if self.log.failure else self.log.write(record)
        if self.hub and live:
            self.hub.publish(record)
        return record

    def _flush_live(self) -> None:
        """Send the newest step a console has not seen (before a pause or the end)."""
        if self.hub and self._unsent is not None:
            self.hub.publish(self._unsent)
        self._unsent = None

    def note(self, text: str) -> None:
        if self.progress:
            self.progress.note(text)

    def update_state(self, **fields) -> None:
        if fields.get("paused"):
            self._flush_live()
        if self.hub:
            self.hub.update_state(**fields)

    def take_commands(self) -> list[dict]:
        return self.hub.take_commands() if self.hub else []

    def reply(self, command: dict, status: str, **fields) -> None:
        step = fields.get("step")
        self.event("command", step, name=command["name"], args=command["args"], status=status,
                   **{k: v for k, v in fields.items() if k != "step"})
        if self.hub:
            self.hub.reply(command, status, **fields)

    def summary(self, record: dict) -> None:
        self._flush_live()
        self._write({"type": "summary", **record})
        if self.progress:
            self.progress.finish(record)

    def close(self, reason: str) -> None:
        """Never raises: it runs while a failure (a full disk's LogWriteError, say) is on its way out."""
        try:
            if self.hub:
                self.hub.close(reason)
        finally:
            with self._lock:
                try:
                    self.log.close()
                except OSError as e:
                    print(f"trainyard: the telemetry log could not be closed ({e})", file=sys.stderr)
