"""What the console knows about the run, folded from the feed's messages, its one-line headline
and the line under it that says which keys do something in this run.

    state = RunState()
    state.apply(msg)                 # hello, snapshot, step, event, summary, dropped, error, ...
    points, events, notes = state.take()      # what arrived since the last redraw
    headline(state, wide=True, live=True)     # `digits-ddp  ddp×2  step 41/60  loss 1.0792  ...`
    keys_line(state, read_only=False, replay=False)   # `pipeline: r rebalance · k/s/c ... · q quit`
    state.sync_mode                           # parameter server: soft, bsp, asp or ssp
    state.device_names                        # each rank's device (hello's `devices`), or None
    state.grid                                # a pipeline's stages x replicas (hello's layout.grid), or None
    state.panel_figures(protocol.STREAMS)     # [("reduce", "ms", 0.52), ...]: what the run declares a panel shows

Which figures a panel shows, in which unit and words, the run's hello says (`figures`: each figure's
declaration); a hello from before it did gets the declarations of its mode from engine.protocol.

Applying a message only stores it; the screen reads the latest state on its own timer,
so 20 steps a second cost 20 dict updates, not 20 redraws.
"""

from __future__ import annotations

import time
from collections import deque

from rich.text import Text

from console.where import grid_of
from engine import protocol
from widgets.streams import HISTORY as STREAM_HISTORY

# The keys that send a command, in the order the keys line names them: (keys, command, what they do).
# The technique's keys come first: a narrow screen cuts the line's end, and p, x and q are in the footer.
COMMAND_KEYS = (("r", "rebalance", "rebalance"), ("k/s/c", "set-policy", "activations keep/swap/recompute"),
                ("u", "set-placement", "update device/host"), ("m", "set-sync", "sync mode soft/bsp/asp/ssp"),
                ("p", "pause", "pause"), ("x", "checkpoint", "checkpoint"))
REPLAY_KEYS = (("space", "play/pause"), ("n", "step"), ("+/-", "speed"))
EVERY_RUN = protocol.every_run()   # every run's declarations, for a hello without any: made once


class RunState:
    """What the feed has said so far."""

    def __init__(self) -> None:
        self.hello: dict = {}
        self.step: int | None = None
        self.steps: int | None = None
        self.paused = False
        self.last_step: dict | None = None
        self.layers: list[dict] | None = None
        self.summary: dict | None = None
        self.sync_mode: str | None = None   # parameter server: hello's layout, then sync_mode events and steps
        self._sync_step = -1                # the step the sync mode was last reported at
        self.version = self.layers_version = self.messages = 0
        self.new_run = False             # a different run: the curves start afresh
        # (step, loss, samples/s, lr, grad norm, clipped, skipped) not yet drawn: Curves.add_point's arguments
        self.points: list[tuple] = []
        self.val_losses: list[tuple[int, float]] = []   # (step, val_loss) of every eval event (the curves' second line)
        # each step's `streams` not yet drawn: a lane's sparkline has a bar per step, however often it is drawn
        self.stream_steps: deque[list[dict]] = deque(maxlen=STREAM_HISTORY)
        self.events: list[dict] = []     # events not yet shown
        self.notes: list[tuple[str, str, float | None]] = []   # (text, style, time or None: now) to say
        self._seen: set = set()          # events already shown (a reconnect's snapshot repeats them)
        self._rate: list[tuple[float, int]] = []   # (time, step) of recent steps, for the ETA

    @property
    def mode(self) -> str:
        return str(self.hello.get("mode") or "?")

    @property
    def capabilities(self) -> set[str]:
        return set(self.hello.get("capabilities") or [])

    @property
    def precision(self) -> str:
        """The run's `[precision]` in a word for the header line: `fp32` (not shown), `bf16` (bf16 compute,
        fp32 weights), `bf16 weights` (bf16 weights, fp32 masters), `bf16 weights+sum` (summed in bf16 too)."""
        p = (self.hello.get("config") or {}).get("precision") or {}
        if p.get("params") == "bf16":
            return "bf16 weights+sum" if p.get("reduce") == "bf16" else "bf16 weights"
        return str(p.get("compute") or "fp32")

    @property
    def ps(self) -> dict | None:
        """The latest step's parameter-server figures (None in other modes)."""
        return (self.last_step or {}).get("ps")

    @property
    def device_names(self) -> list[str] | None:
        """Each rank's device by rank, e.g. "NVIDIA H100 80GB HBM3" (None in logs from before hello had them)."""
        names = self.hello.get("devices")
        return names if isinstance(names, list) else None

    @property
    def grid(self) -> dict | None:
        """A pipeline's stages x replicas, as its hello says them (layout.grid: each stage's ranks, replica 0
        first); None in other modes and with one replica."""
        return grid_of(self.hello)

    @property
    def figures(self) -> list[dict]:
        """The declarations of the figures this run's rank entries carry: the hello's `figures` (its strategy's
        own among them), or for a hello from before it had them (an older run's, its log replayed), every run's,
        which engine.protocol declares."""
        figures = self.hello.get("figures")
        return figures if isinstance(figures, list) else EVERY_RUN

    def panel_figures(self, panel: str, rank: int | None = None) -> list[tuple[str, str, float]]:
        """(label, unit, value) of each figure the run declares `panel` shows, in declared order, from the
        latest step's rank rows (`rank`: that rank's alone), the rows' values read as one as the declaration's
        `combine` says. A figure no row has (absent in this mode, or not measured yet) is left out."""
        rows = [row for row in (self.last_step or {}).get("ranks") or []
                if isinstance(row, dict) and (rank is None or row.get("rank") == rank)]
        shown = []
        for figure in self.figures:
            if not isinstance(figure, dict) or panel not in (figure.get("shows") or ()) or "name" not in figure:
                continue
            value = protocol.combine(figure.get("combine", "max"), [row.get(figure["name"]) for row in rows])
            if value is not None:
                shown.append((str(figure.get("label") or figure["name"]), str(figure.get("unit") or ""), value))
        return shown

    def layer(self, name: str) -> dict:
        return next((row for row in self.layers or [] if row.get("name") == name), {})

    def apply(self, msg: dict) -> None:
        self.messages += 1
        kind = msg.get("type")
        if kind == "hello":
            # another run, or the same name after the last one finished (not a reconnect, not a restart)
            fresh = self.hello.get("run") != msg.get("run") or self.summary is not None
            if fresh:
                self.last_step, self.layers, self.step, self.summary, self._rate = None, None, None, None, []
                self.stream_steps.clear()
                self.sync_mode, self._sync_step = None, -1
            if self.sync_mode is None:   # a reconnect's hello has the configured mode, maybe changed since
                self.sync_mode = (msg.get("layout") or {}).get("sync")
            self.new_run = self.new_run or fresh
            note = msg.get("device_note")
            if note and (fresh or note != self.hello.get("device_note")):   # once a run, not per reconnect
                self.notes.append((f"device {note}", "cyan", msg.get("started")))
            self.hello, self.steps = msg, msg.get("steps", self.steps)
            self.step = self.step if self.step is not None else msg.get("first_step")
            self.version += 1
        elif kind == "snapshot":
            self.steps, self.paused = msg.get("steps", self.steps), bool(msg.get("paused"))
            self.step = msg.get("step", self.step)
            if msg.get("layers"):
                self.layers = msg["layers"]
                self.layers_version += 1
            if msg.get("last_step"):
                self._step(msg["last_step"])
            for event in msg.get("events") or []:
                self._event(event)
            self.version += 1
        elif kind == "step":
            self._step(msg)
        elif kind == "event":
            self._event(msg)
        elif kind == "run_start" and msg.get("restart"):
            self.notes.append((f"worker group restarted ({msg['restart']}), from step {msg.get('first_step')}",
                               "bold #ffb000", None))
        elif kind == "summary":
            self.summary = msg
            accuracy, loss = msg.get("test_accuracy"), msg.get("final_loss")
            loss = f"{loss:.4f}" if isinstance(loss, (int, float)) else "not finite"   # null: NaN or inf
            val = msg.get("val_loss")
            self.notes.append((f"run finished: {msg.get('steps')} steps, final loss {loss}"
                               + (f", validation loss {val:.4f}" if isinstance(val, (int, float)) else "")
                               + (f", test accuracy {accuracy:.2%}" if accuracy is not None else ""), "bold", None))
        elif kind == "dropped":
            self.notes.append((f"{msg.get('count')} messages dropped (the console fell behind)", "dim", None))
        elif kind == "error":
            self.notes.append((f"hub: {msg.get('reason')}", "red", None))

    def _step(self, msg: dict) -> None:
        step = msg.get("step")
        if not isinstance(step, int):
            return
        # the steps between full rank rows carry `per_rank` columns: overlaid on the rows before them
        msg = protocol.with_ranks(msg, self.last_step)
        if self.last_step is None or step != self.last_step.get("step"):   # a snapshot repeats one
            # lr, grad_norm, clipped, skipped: None or False in logs from before steps carried them
            self.points.append((step, msg.get("loss", 0.0), msg.get("samples_per_s", 0.0), msg.get("lr"),
                                msg.get("grad_norm"), bool(msg.get("clipped")), bool(msg.get("skipped"))))
            self.stream_steps.append(msg.get("streams") or [])
        self.last_step, self.step = msg, step
        if msg.get("layers"):
            self.layers = msg["layers"]
            self.layers_version += 1
        if isinstance(msg.get("ps"), dict):   # the layer table shows each step's sync windows
            self._sync(msg["ps"].get("mode"), step, latest=True)
            self.layers_version += 1
        if isinstance(msg.get("time"), (int, float)):
            self._rate = [*self._rate[-49:], (msg["time"], step)]
        self.version += 1

    def _event(self, event: dict) -> None:
        key = (event.get("time"), event.get("kind"), event.get("step"), event.get("name"))
        if key in self._seen:
            return
        self._seen.add(key)
        self.events.append(event)
        if event.get("kind") == "sync_mode":
            self._sync(event.get("mode"), event.get("step"))
        if event.get("kind") == "eval" and isinstance(event.get("val_loss"), (int, float)):
            step = event.get("step", 0)
            while self.val_losses and self.val_losses[-1][0] >= step:   # a restart replays from its checkpoint
                self.val_losses.pop()
            self.val_losses.append((step, float(event["val_loss"])))
            self.version += 1
        if event.get("kind") == "command" and event.get("status") == "applied" \
                and event.get("name") in ("pause", "resume"):   # another console's, say
            self.paused = event["name"] == "pause"

    def _sync(self, mode, step, latest: bool = False) -> None:
        """A step's report is the run's state now (after a restart too); an event counts unless it is
        older than that: a snapshot repeats its recent events after its last step."""
        step = step if isinstance(step, int) else self._sync_step
        if isinstance(mode, str) and mode and (latest or step >= self._sync_step):
            self.sync_mode, self._sync_step = mode, step

    def take_stream_steps(self) -> list[list[dict]]:
        """Each step's `streams` since the last call, oldest first."""
        taken = list(self.stream_steps)
        self.stream_steps.clear()
        return taken

    def take(self) -> tuple[list, list, list]:
        """(points, events, notes) not yet drawn; the caller draws them."""
        taken = self.points, self.events, self.notes
        self.points, self.events, self.notes = [], [], []
        return taken

    def eta_s(self) -> float | None:
        if self.steps is None or self.step is None or len(self._rate) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return max(self.steps - self.step, 0) * (t1 - t0) / (s1 - s0)


def clock(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "—"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def headline(state: RunState, wide: bool, live: bool) -> Text:
    """`run  mode×world  step 41/60  loss 1.0792  3,424 samples/s  0:07 elapsed  ETA 0:28`; a language model's
    run says `52,310 tokens/s  MFU 41.2%` (mfu where the device's peak is known) in place of samples/s.

    Times come from the records (a replay is frozen); `live`: elapsed runs on the wall clock."""
    hello, step = state.hello, state.last_step or {}
    parts = [(hello.get("run") or "no run yet", "bold #ffb000"),
             (f"{state.mode}×{hello.get('world_size', '?')}"
              + (f" of {hello['max_world_size']}" if hello.get("max_world_size") else ""), "bold"),
             *([(precision, "bold #a29bfe")] if (precision := state.precision) != "fp32" else []),
             *([(f"sync {state.sync_mode}", "bold cyan")] if state.sync_mode else []),   # a mode that has one
             (f"step {state.step if state.step is not None else '—'}"
              + (f"/{state.steps}" if state.steps else ""), "")]
    if state.paused:
        parts.append(("paused", "bold #ffb000"))
    if "loss" in step:   # null: not finite (the record's `nonfinite` says so)
        loss = step["loss"]
        text = f"loss {loss:.{4 if wide else 3}f}" if isinstance(loss, (int, float)) else "loss not finite"
        parts.append((text, "#ff9f43"))
    if "tokens_per_s" in step:   # samples are sequences: tokens are what a language model's user compares
        rate = step["tokens_per_s"]
        parts.append((f"{rate:,.0f} tokens/s" if wide else f"{rate / 1000:.1f}k tok/s", "#48dbfb"))
        if "mfu" in step:
            parts.append((f"MFU {step['mfu']:.1%}", "#48dbfb"))
    elif "samples_per_s" in step:
        rate = step["samples_per_s"]
        parts.append((f"{rate:,.0f} samples/s" if wide else f"{rate / 1000:.1f}k/s", "#48dbfb"))
    started = hello.get("started")
    if started is not None and wide:
        end = time.time() if live and state.summary is None else step.get("time")
        parts.append((f"{clock(end - started) if end else '—'} elapsed", "dim"))
    eta = None if state.paused or state.summary else state.eta_s()
    if eta is not None:
        parts.append((f"ETA {clock(eta)}", "dim"))
    return Text("  " if wide else " ").join(Text(text, style) for text, style in parts)


def keys_line(state: RunState, read_only: bool, replay: bool) -> Text:
    """Which keys do something in this run, from its hello: its mode and the commands it takes.

    `pipeline: r rebalance · k/s/c activations keep/swap/recompute · u update device/host · p pause ·
    x checkpoint · q quit` (118 columns: it fits a wide screen; the headline above has the world size);
    a replay names its own keys, a read-only console says "watch only"."""
    if not state.hello:
        return Text.assemble(("no run yet", "bold"), " · ", ("q", "bold #ffb000"), " quit")
    keys = (REPLAY_KEYS if replay else () if read_only else
            [(key, what) for key, command, what in COMMAND_KEYS if command in state.capabilities])
    parts = [Text("watch only", "italic")] if read_only and not replay else []
    parts += [Text.assemble((key, "bold #ffb000"), f" {what}") for key, what in (*keys, ("q", "quit"))]
    return Text.assemble((f"{'replay of ' if replay else ''}{state.mode}: ", "bold"), Text(" · ").join(parts))


def link_label(link_state: str, read_only: bool) -> Text:
    label, style = {"connected": ("● connected", "bold green"), "lost": ("◌ reconnecting", "bold red"),
                    }.get(link_state, ("◌ connecting", "bold yellow"))
    return Text(label + (" · read-only" if read_only else ""), style)


def replay_label(paused: bool, position: int, total: int, speed: float, wide: bool) -> Text:
    where = f"{position}/{total} {speed:g}×"
    return Text(f"{'‖' if paused else '▶'} {'replay ' if wide else ''}{where}", "bold #a29bfe")
