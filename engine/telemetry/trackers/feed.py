"""The trackers' feed: a bounded queue of log records and the one thread that hands them to the trackers.

    feed = TrackerFeed([TensorBoardTracker(...), WandbTracker(...)], queue_len=1024)
    feed.put(record)              # never waits: a record that does not fit is dropped and counted
    feed.close(timeout_s=60)      # the thread hands over what is queued, closes the trackers and ends

A tracker is any object with `name`, `where` (a line saying where it writes), and the calls `start(run_start)`,
`scalars(step, {tag: value})`, `text(step, tag, text)` and `close()` (tensorboard_run.py, wandb_run.py).
What a record becomes is `calls` below: a step's training figures and each rank's peak memory as scalars,
an evaluation's figures as scalars, every other event as a line of text under `events/KIND`.

A tracker that raises is said once, on stderr, closed and called no more; the others go on, and so does the
run: the feed lives in the launcher, off every rank's step.
"""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
from contextlib import suppress

# step record field -> tag (the loss is the step's training loss; lr, grad_norm: the optimizer's step)
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "train/tokens_per_s", "samples_per_s": "train/samples_per_s",
             "step_ms": "train/step_ms", "mfu": "train/mfu"}
EVAL_TAGS = {"val_loss": "eval/val_loss", "perplexity": "eval/perplexity", "test_accuracy": "eval/test_accuracy"}
RANK_TAGS = ("peak_bytes", "allocator_peak_bytes")   # each rank's: memory/peak_bytes/rank0, ...
_NOT_FIELDS = ("schema", "time", "type", "kind", "step")
_END = object()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_scalars(record: dict) -> dict[str, float]:
    """A step record's scalars: its training figures (a null, non-finite loss left out) and each rank's peak."""
    values = {tag: record[name] for name, tag in STEP_TAGS.items() if _number(record.get(name))}
    for i, row in enumerate(record.get("ranks") or []):
        for name in RANK_TAGS:
            if _number(row.get(name)):
                values[f"memory/{name}/rank{row.get('rank', i)}"] = row[name]
    return values


def event_text(record: dict) -> str:
    """An event as a line: `migration at step 12: {"moves": ..., ...}`."""
    fields = {key: value for key, value in record.items() if key not in _NOT_FIELDS}
    return f"{record.get('kind')} at step {record.get('step')}: {json.dumps(fields, sort_keys=True)}"


def calls(record: dict, step: int) -> list[tuple[str, tuple]]:
    """What the trackers are asked to do with a log record (`step`: the latest step, for a record without one)."""
    kind = record.get("type")
    step = record.get("step") if isinstance(record.get("step"), int) else step
    if kind == "run_start":
        return [("start", (record,))]
    if kind == "step":
        return [("scalars", (step, step_scalars(record)))]
    if kind == "event" and record.get("kind") == "eval":
        values = {tag: record[name] for name, tag in EVAL_TAGS.items() if _number(record.get(name))}
        return [("scalars", (step, values))] if values else []
    if kind == "event":
        return [("text", (step, f"events/{record.get('kind')}", event_text(record)))]
    return []   # the summary: its figures are the last step's and evaluation's


class TrackerFeed:
    def __init__(self, trackers: list, queue_len: int):
        self.trackers = list(trackers)
        self.failed: dict[str, str] = {}   # tracker name -> what it raised
        self.dropped = 0
        self.step = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_len)
        self._thread = threading.Thread(target=self._consume, name="trainyard-trackers", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float) -> bool:
        """Hand over what is queued, close the trackers, end the thread; False when that took longer than
        `timeout_s` (a tracker that hangs: the thread is a daemon, left behind)."""
        try:
            self._queue.put(_END, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _consume(self) -> None:
        while (record := self._queue.get()) is not _END:
            if record.get("type") == "run_start":   # a restart goes back to its checkpoint's step
                self.step = record.get("first_step", 0)
            elif isinstance(record.get("step"), int):
                self.step = record["step"]
            for name, args in calls(record, self.step):
                for tracker in self.live():
                    self._call(tracker, name, args)
        for tracker in self.live():
            self._call(tracker, "close", ())

    def live(self) -> list:
        return [t for t in self.trackers if t.name not in self.failed]

    def _call(self, tracker, name: str, args: tuple) -> None:
        try:
            getattr(tracker, name)(*args)
        except Exception as e:   # said once; the run and the other trackers go on
            self.failed[tracker.name] = f"{type(e).__name__}: {e}"
            print(f"trainyard: the {tracker.name} tracker failed ({self.failed[tracker.name]}) at step "
                  f"{self.step}; it records no more, training goes on", file=sys.stderr, flush=True)
            if name != "close":
                with suppress(Exception):
                    tracker.close()

    def closing_line(self, ended: bool) -> str:
        """What the launcher says at the end: where each tracker wrote, and the records dropped."""
        said = [f"{t.name} failed (said above)" if t.name in self.failed else _where(t)
                for t in self.trackers]
        dropped = (f"{self.dropped} log records dropped (telemetry.tracker_queue_len)" if self.dropped
                   else "no log record dropped")
        late = "" if ended else "; they did not finish in time, what they hold may be cut short"
        return f"trainyard: trackers: {'; '.join(said)}; {dropped}{late}"


def _where(tracker) -> str:
    try:
        return tracker.where
    except Exception:   # the closing line never fails the run's end
        return tracker.name
