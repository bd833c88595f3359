"""Where the console's messages come from: a live run's socket, or a telemetry log played back.

    source = SocketSource("digits-ddp")            # a run name, a socket path or tcp://127.0.0.1:PORT
    source = ReplaySource(Path("run.jsonl"), paused=True, preload=40)
    source.run(app.post_message, cancelled)        # in a thread worker, until cancelled() is true
    cid = source.send("set-policy", ["fc1", "swap"])   # SocketSource: from any thread

Both post the same messages: `Feed` (one wire message: hello, snapshot, step, event, reply,
summary, bye, ...) and `Link` (the connection's state). A replayed log's `run_start` becomes a
hello; its step, event and summary records go out as the socket would send them. A line of the log
that is not whole JSON (cut short by a writer that stopped) is left out, and a `replay` event says so.
console/state.py folds those messages into what the screen shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual.message import Message

from engine import protocol

RETRY_FIRST_S, RETRY_MAX_S = 0.5, 5.0
READ_POLL_S = 0.25          # how often the reader looks up to see whether it was cancelled
REPLAY_SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
REPLAY_MAX_GAP_S = 2.0      # a long pause in the log plays back as this, at most


class Feed(Message):
    """One message from the run (a dict as on the wire)."""

    def __init__(self, msg: dict) -> None:
        super().__init__()
        self.msg = msg


class Link(Message):
    """The source's state: connecting, connected, lost (will retry), replay."""

    def __init__(self, state: str, detail: str = "", retry_s: float | None = None) -> None:
        super().__init__()
        self.state, self.detail, self.retry_s = state, detail, retry_s


def _sleep(seconds: float, cancelled: Callable[[], bool]) -> bool:
    """Sleep in small pieces; True if cancelled meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cancelled():
            return True
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return cancelled()


class SocketSource:
    """A live run through engine.protocol, reconnecting with backoff whenever the link drops."""

    replay = False

    def __init__(self, target: str, *, read_only: bool = False, token: str | None = None):
        self.target, self.read_only, self.token = target, read_only, token
        self._lock = threading.Lock()       # guards _conn: the UI thread sends, the worker reads
        self._conn: protocol.Connection | None = None
        self._ids = 0

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, name: str, args: list[str]) -> str:
        """Send a command at once (never waits for its reply); ConnectionError when not connected."""
        with self._lock:
            if self._conn is None:
                raise ConnectionError("not connected")
            self._ids += 1
            cid = f"console-{self._ids}"
            self._conn.send({"type": "command", "id": cid, "name": name, "args": args})
            return cid

    def _started(self) -> float | None:
        """When the run started, from its registry entry (for elapsed time); None if unknown."""
        try:
            for info in protocol.list_runs():
                if self.target in (info.get("name"), info.get("socket"), info.get("tcp")):
                    return info.get("started")
        except OSError:
            pass
        return None

    def run(self, post: Callable[[Message], object], cancelled: Callable[[], bool]) -> None:
        delay, state, reason = RETRY_FIRST_S, "connecting", ""
        while not cancelled():
            try:
                conn = protocol.connect(self.target, client="console", read_only=self.read_only,
                                        token=self.token, timeout=2.0)
            except (OSError, LookupError, EOFError, protocol.ProtocolError) as e:
                post(Link(state, reason or str(e), retry_s=delay))
                if _sleep(delay, cancelled):
                    return
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            hello = dict(conn.hello)
            hello.setdefault("started", self._started())
            with self._lock:
                self._conn = conn
            post(Feed(hello))
            post(Link("connected"))
            delay, state, reason = RETRY_FIRST_S, "lost", "connection lost"
            try:
                while not cancelled():
                    try:
                        msg = conn.read(timeout=READ_POLL_S)
                    except TimeoutError:
                        continue
                    post(Feed(msg))
                    if msg.get("type") == "bye":
                        reason = f"the run ended ({msg.get('reason', 'bye')})"
            except (EOFError, OSError, protocol.ProtocolError):
                pass
            finally:
                with self._lock:
                    self._conn = None
                conn.close()
            if cancelled():
                return
            post(Link("lost", reason, retry_s=delay))
            if _sleep(delay, cancelled):
                return


def replay_messages(records: list[dict]) -> list[dict]:
    """A telemetry log as the socket would have sent it: run_start -> hello, the rest as written."""
    out, hello_sent = [], False
    for record in records:
        msg = {"v": protocol.VERSION, **record}
        if record.get("type") == "run_start" and not hello_sent:
            config = record.get("config", {})
            msg = {"v": protocol.VERSION, "type": "hello", "protocol": protocol.VERSION,
                   "run": record.get("name"), "mode": record.get("mode") or record.get("strategy"),
                   "world_size": record.get("world_size"), "backend": record.get("backend"),
                   "device": record.get("device"), "simulated": record.get("simulated", True),
                   **{key: record[key] for key in ("devices", "device_note", "hosts", "max_world_size", "figures")
                      if key in record},
                   "layers": record.get("layers", []), "capabilities": [],   # a replay takes no commands
                   **({"layout": record["layout"]} if "layout" in record else {}),
                   "steps": config.get("run", {}).get("steps"), "config": config,
                   "started": record.get("time"), "first_step": record.get("first_step", 0)}
            hello_sent = True
        out.append(msg)
    return out


def skipped_event(notes: list[str], most: int = 3) -> dict:
    """One `replay` event for the events panel saying which lines of the log were left out (one event: the
    panel keeps only one of several alike): `skipped=run.jsonl: line 7: not JSON (...); ...`."""
    more = f"; and {len(notes) - most} more" if len(notes) > most else ""
    return {"v": protocol.VERSION, "type": "event", "kind": "replay", "step": None,
            "skipped": "; ".join(notes[:most]) + more}


class ReplaySource:
    """A telemetry log played back at its own pace (times `speed`); pause, step, faster, slower.

    The UI thread sets the controls; the worker thread reads them under a condition variable.
    """

    replay = True
    read_only = True
    connected = False

    def __init__(self, path: Path, *, paused: bool = False, preload: int = 0, speed: float = 1.0):
        records, self.notes = [], []   # notes: the lines left out (not JSON, or cut short), said at the start
        for part in protocol.log_parts(path) or [path]:   # a rotated log's parts, in order (no part: say so)
            got, notes = protocol.read_records(part)
            records += got
            self.notes += [f"{Path(part).name}: {note}" for note in notes]
        self.path = Path(path)
        self.messages = replay_messages(records)
        self.total = len(self.messages)
        self.preload = min(preload, self.total)
        self.paused, self.speed = paused, speed
        self._steps = 0                    # single steps asked for while paused
        self._cond = threading.Condition()

    def toggle(self) -> None:
        with self._cond:
            self.paused = not self.paused
            self._cond.notify()

    def step_once(self) -> None:
        with self._cond:
            self.paused = True
            self._steps += 1
            self._cond.notify()

    def change_speed(self, direction: int) -> float:
        with self._cond:
            i = min(range(len(REPLAY_SPEEDS)), key=lambda k: abs(REPLAY_SPEEDS[k] - self.speed))
            self.speed = REPLAY_SPEEDS[max(0, min(len(REPLAY_SPEEDS) - 1, i + direction))]
            self._cond.notify()
            return self.speed

    def send(self, name: str, args: list[str]) -> str:
        raise ConnectionError("a replay takes no commands")

    def _gap(self, i: int) -> float:
        before, now = self.messages[i - 1].get("time"), self.messages[i].get("time")
        if i == 0 or before is None or now is None:
            return 0.0
        return min(max(now - before, 0.0), REPLAY_MAX_GAP_S)

    def _wait_turn(self, i: int, cancelled: Callable[[], bool]) -> bool:
        """Block until record i may go out; False if cancelled."""
        start = time.monotonic()
        with self._cond:
            while not cancelled():
                if self._steps:
                    self._steps -= 1
                    return True
                left = start + self._gap(i) / self.speed - time.monotonic()
                if not self.paused and left <= 0:
                    return True
                self._cond.wait(0.1 if self.paused else min(0.1, left))
        return False

    def run(self, post: Callable[[Message], object], cancelled: Callable[[], bool]) -> None:
        for msg in self.messages[:self.preload]:
            post(Feed(msg))
        if self.notes:
            post(Feed(skipped_event(self.notes)))
        post(Link("replay", "ready"))
        for i in range(self.preload, self.total):
            if not self._wait_turn(i, cancelled):
                return
            post(Feed(self.messages[i]))
        post(Link("replay", "end of log"))

