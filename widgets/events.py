"""The run's events, one line each: checkpoints, restarts, evals, commands, sync changes, skipped and
rolled-back steps, and console notes.

`add_event(record)` takes a telemetry `event` record (docs/telemetry.md);
`add_text("connection lost", "red")` is for lines the console itself has to say.
"""

from __future__ import annotations

import time
from collections import deque
from math import isfinite

from rich.text import Text
from textual.widgets import RichLog

from .devices import human_bytes

MAX_LINES = 500
TAG_WIDTH = 10
KIND_STYLES = {
    "checkpoint": "bold cyan", "restart": "bold #ffb000", "resume": "bold blue", "eval": "bold magenta",
    "memory_over_capacity": "bold red", "stop": "bold #ffb000", "command": "bold green",
    "rebalance": "bold #ffb000", "migration": "bold #ffb000", "sync_mode": "bold cyan",
    "worker_lost": "bold red", "ps_profile": "bold blue", "memory_plan": "bold blue", "update_plan": "bold blue",
    "policy": "bold green", "placement": "bold green", "step_skipped": "bold #ffb000",
    "step_rolled_back": "bold yellow", "nonfinite": "bold red", "checkpoint_skipped": "bold red",
    "checkpoint_waited": "bold yellow",
    "auto_fit": "bold blue", "plan_reverted": "bold yellow",
    "replay": "bold yellow",
}
TAGS = {"memory_over_capacity": "memory", "sync_mode": "sync", "worker_lost": "lost", "ps_profile": "profile",
        "memory_plan": "mem plan", "update_plan": "upd plan", "step_skipped": "skipped", "step_rolled_back": "rollback",
        "checkpoint_skipped": "no ckpt", "checkpoint_waited": "ckpt wait",
        "auto_fit": "auto fit", "plan_reverted": "plan back"}


def describe(event: dict) -> tuple[str, str]:
    """(tag style, message) for one event record."""
    kind, style = event.get("kind", "?"), KIND_STYLES.get(event.get("kind"), "bold")
    if kind == "checkpoint":
        said = f"saved {event.get('path', '')}"
        if "stall_ms" in event:   # what the step waited, beside the write that went on behind it
            said += f" (the step waited {event['stall_ms']:.0f} ms; written in {event.get('write_ms', 0):.0f} ms)"
        return style, said
    if kind == "checkpoint_waited":
        return style, (f"checkpoint waited {event.get('waited_ms', 0):.0f} ms for the write of step "
                       f"{event.get('previous', '?')} (one write at a time)")
    if kind == "restart":
        return style, f"worker group restarted ({event.get('restart')}/{event.get('max_restarts')})"
    if kind == "resume":
        return style, f"resumed from {event.get('checkpoint', '?')}"
    if kind == "eval":
        accuracy = event.get("test_accuracy")
        return style, "test accuracy —" if accuracy is None else f"test accuracy {accuracy:.2%}"
    if kind == "memory_over_capacity":
        return style, (f"rank {event.get('rank')} peak {human_bytes(event.get('peak_bytes'))}"
                       f" over capacity {human_bytes(event.get('capacity_bytes'))}")
    if kind == "stop":
        return style, f"stopped ({event.get('reason', '?')})"
    if kind == "nonfinite":
        return style, (f"{event.get('what', '?')} is {event.get('value', 'not finite')} (later steps log it as null; "
                       f"optim.skip_nonfinite skips such steps)")
    if kind == "checkpoint_skipped":
        return style, (f"final checkpoint skipped: it needs about {event.get('needs_s', '?')} s, more than "
                       f"parallel.shutdown_timeout_s = {event.get('shutdown_timeout_s', '?')} leaves")
    if kind == "replay":
        return style, f"skipped {event.get('skipped', 'a line')}"
    if kind == "command":
        command = " ".join([str(event.get("name", "?")), *map(str, event.get("args") or [])])
        if event.get("status") == "rejected":
            return "bold red", f"{command} rejected: {event.get('reason', 'no reason given')}"
        detail = f" ({event['reason']})" if event.get("reason") else ""
        return style, f"{command} applied at step {event.get('step')}{detail}"
    if kind == "rebalance":
        now, then = event.get("stage_ms") or [0], event.get("predicted_ms") or [0]
        return style, (f"{event.get('reason', '?')}: slowest stage {max(now):.1f} -> {max(then):.1f} ms, "
                       f"new stages {_sizes(event.get('stages'))} layers; migrating next step")
    if kind == "migration":
        moves = event.get("moves") or []
        moved = ", ".join(f"{m.get('layer')} {m.get('from_stage')}→{m.get('to_stage')}" for m in moves[:6])
        more = f" +{len(moves) - 6} more" if len(moves) > 6 else ""
        return style, (f"{len(moves)} layer(s) moved ({moved}{more}), {human_bytes(event.get('bytes'))} "
                       f"in {event.get('duration_ms', 0):.0f} ms; stages {_sizes(event.get('stages'))}")
    if kind == "sync_mode":
        change = f"{event['previous']} -> {event.get('mode')}" if event.get("previous") else str(event.get("mode"))
        return style, f"sync mode {change} (from {event.get('source', '?')})"
    if kind == "worker_lost":
        return style, f"worker rank {event.get('rank')} lost: {event.get('reason', 'no reason given')}"
    if kind == "ps_profile":
        return style, "sync windows per worker: " + ", ".join(
            f"{layer.get('name')} {_spread(layer.get('window_ms'))} ms" for layer in event.get("layers") or [])
    if kind == "memory_plan":
        ranks = "; ".join(f"rank {r.get('rank')}: {r.get('swap_layers', 0)} swap, {r.get('recompute_layers', 0)} "
                          f"recompute, modelled peak {human_bytes(r.get('estimate_bytes'))}"
                          for r in event.get("ranks") or [])
        note = f" ({event['note']})" if event.get("note") else ""
        return style, (f"{event.get('planner', '?')}: {ranks or 'no rank planned'} of "
                       f"{human_bytes(event.get('capacity_bytes'))}{note}")
    if kind == "auto_fit":
        if "need_bytes" not in event:
            return style, f"keep and all-device not estimated ({event.get('reason', '?')}); the trials measure"
        return style, (f"keep and all-device estimated {human_bytes(event.get('need_bytes'))} with the margin, of "
                       f"{human_bytes(event.get('capacity_bytes'))}: memory {event.get('memory')}, updates "
                       f"{event.get('placement')} from step 1")
    if kind == "plan_reverted":
        return style, (f"update plan went back: {event.get('plan_ms', 0):.1f} ms a step against "
                       f"{event.get('replaced_ms', 0):.1f} ms for the placement it replaced")
    if kind == "update_plan":
        placement = event.get("placement") or {}
        on_host = sum(p == "host" for p in placement.values())
        return style, (f"{event.get('planner', '?')}: {on_host} of {len(placement)} updates on the host; modelled "
                       f"step {event.get('predicted_ms', 0):.1f} ms (all device {event.get('all_device_ms', 0):.1f}, "
                       f"all host {event.get('all_host_ms', 0):.1f})")
    # the step column and the tag say which step and what became of it: `step 120 skipped  gradient norm ...`
    if kind == "step_skipped":
        norm = event.get("grad_norm")
        why = f"gradient norm {_norm(norm)}" if _finite(norm) else "gradient norm not finite"
        return style, f"{why}; {_layers(event.get('redone_layers'))} rolled back"
    if kind == "step_rolled_back":
        return style, (f"gradient norm {_norm(event.get('grad_norm'))} over clip {_norm(event.get('clip'))}, "
                       f"{_layers(event.get('redone_layers'))} redone with the clipped gradient")
    if kind in ("policy", "placement"):
        return style, f"{event.get('layer')} -> {event.get(kind)} (from {event.get('source', '?')})"
    extra = {k: v for k, v in event.items() if k not in ("schema", "time", "type", "kind", "step", "v")}
    return style, " ".join(f"{k}={v}" for k, v in extra.items())


def _spread(values) -> str:
    """`1.2–3.6` (least to most of the workers), or one figure when they agree."""
    values = [v for v in values or [] if isinstance(v, (int, float))]
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}–{high:.1f}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and isfinite(value)


def _norm(value) -> str:
    """A gradient norm or a clip threshold: `3.2`, `1.0`, `0.0123`, `2.5e+04`; `?` when absent."""
    if not _finite(value):
        return "?" if value is None else str(value)
    return f"{value:.1f}" if 1 <= abs(value) < 1000 else f"{value:.3g}"


def _layers(count) -> str:
    if not isinstance(count, int):
        return "? layers"
    return f"{count} layer{'' if count == 1 else 's'}"


def _sizes(stages) -> str:
    return "|".join(str(len(s)) for s in stages or [])


class EventLog(RichLog):
    """`12:01:03 step    100 checkpoint saved runs/…/step_000100`, newest at the bottom."""

    DEFAULT_CSS = """
    EventLog { height: 1fr; background: $surface; }
    """

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("max_lines", MAX_LINES)
        kwargs.setdefault("wrap", True)
        super().__init__(**kwargs)
        self.texts: deque[Text] = deque(maxlen=MAX_LINES)   # every line as written, to wrap again
        self.wrapped_at = 0    # the width the lines were last wrapped at all together

    @staticmethod
    def stamp(seconds: float | None) -> Text:
        return Text(time.strftime("%H:%M:%S ", time.localtime(seconds)), style="dim")

    def add_event(self, event: dict) -> None:
        style, message = describe(event)
        kind = str(event.get("kind", "?"))
        step = event.get("step")
        line = self.stamp(event.get("time"))
        line.append(f"step {step:>6} " if isinstance(step, int) else "step      ? ", "dim")
        line.append(TAGS.get(kind, kind)[:TAG_WIDTH].ljust(TAG_WIDTH), style)
        line.append(" ")
        line.append(message, "red" if style == "bold red" else "")
        self.add_line(line)

    def add_text(self, text: str, style: str = "") -> None:
        line = self.stamp(None)
        line.append(text, style or "italic")
        self.add_line(line)

    def add_line(self, line: Text) -> None:
        # wrap at the log's own width (RichLog alone would measure against the terminal's)
        self.texts.append(line)
        width = self.scrollable_content_region.width
        if not width:   # not laid out yet (a replay's preload, say) or hidden: wrapped again when shown
            self.wrapped_at = 0
        self.write(line, width=width or None)

    def on_resize(self) -> None:
        self.call_after_refresh(self.rewrap)   # after the layout: the content region is the new one then

    def on_show(self) -> None:
        self.call_after_refresh(self.rewrap)

    def rewrap(self) -> None:
        """Every line again at the log's width, when that is not the width they were wrapped at."""
        width = self.scrollable_content_region.width
        if width and width != self.wrapped_at:
            self.wrapped_at = width
            self.clear()
            for line in self.texts:
                self.write(line, width=width)
