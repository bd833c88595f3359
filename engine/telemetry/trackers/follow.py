"""The launcher's side of the trackers: it follows the telemetry log as rank 0 writes it and feeds what it reads
to the trackers (feed.py), so no rank ever waits for one.

    with follow_trackers(cfg, log_path, resumed=job.resume is not None):   # engine/run/launch.py, host 0
        elastic_launch(...)(job)
    # then: "trainyard: trackers: tensorboard in runs/NAME/tb; ...; no log record dropped"

The follower starts at the log's end as the launch begins (an earlier launch's records are not this one's),
reads whole lines only, and moves to the next part once it exists (a log rotates by size, engine/telemetry/log.py).
Step records between full rank rows are filled in as every reader fills them (engine.protocol.with_ranks).
"""

from __future__ import annotations

import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from engine.telemetry.records import log_parts, part_path, with_ranks
from engine.telemetry.trackers.feed import TrackerFeed

POLL_S = 0.25    # how often the follower looks for new lines
CLOSE_S = 60.0   # how long the launcher waits, at the end, for the trackers to take the rest and close


class LogFollower:
    """Reads the lines appended to the log at `path` (every part), in a thread, handing each record to `put`."""

    def __init__(self, path: Path, put):
        self.path, self.put = Path(path), put
        parts = log_parts(self.path)
        self.part = len(parts) - 1 if parts else 0
        where = part_path(self.path, self.part)
        self.offset = where.stat().st_size if where.exists() else 0
        self.previous: dict | None = None   # the last step record, whole, for the next one's `per_rank`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainyard-log-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Read what is left (the workers have ended: the log is whole), then stop."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.read()
        self.read()

    def read(self) -> None:
        while True:
            rotated = part_path(self.path, self.part + 1).exists()   # before reading: then this part is complete
            self._read_part(part_path(self.path, self.part))
            if not rotated:
                return
            self.part, self.offset = self.part + 1, 0

    def _read_part(self, where: Path) -> None:
        try:
            with open(where, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:   # rank 0 has not opened it yet: the next read
            return
        whole = data[:data.rfind(b"\n") + 1]   # a line still being written waits for the next read
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:   # a cut line (a writer stopped mid-record): the log's readers skip it too
                continue
            if not isinstance(record, dict):
                continue
            if record.get("type") == "run_start":
                self.previous = None
            elif record.get("type") == "step":
                record = self.previous = with_ranks(record, self.previous)
            self.put(record)


def make_trackers(cfg, resumed: bool) -> list:
    """The trackers `[telemetry]` turns on, none started yet (each starts at the run's first record)."""
    trackers = []
    if cfg.telemetry.tensorboard:
        from engine.telemetry.trackers.tensorboard_run import TensorBoardTracker
        trackers.append(TensorBoardTracker(cfg.run_dir / "tb", resumed))
    if cfg.telemetry.wandb:
        from engine.telemetry.trackers.wandb_run import WandbTracker
        trackers.append(WandbTracker(cfg.telemetry.wandb, cfg.run_dir, resumed))
    return trackers


@contextmanager
def follow_trackers(cfg, log_path: Path, resumed: bool):
    """Run the trackers `cfg` turns on while the block runs (host 0's launcher: rank 0 writes the log there), and
    say at the end where they wrote and what was dropped. Nothing when none is on."""
    trackers = [] if cfg.cluster.node_rank else make_trackers(cfg, resumed)
    if not trackers:
        yield None
        return
    feed = TrackerFeed(trackers, cfg.telemetry.tracker_queue_len)
    follower = LogFollower(log_path, feed.put)
    follower.start()
    try:
        yield feed
    finally:
        try:
            follower.stop()
            ended = feed.close(CLOSE_S)
            print(feed.closing_line(ended), file=sys.stderr, flush=True)
        except Exception as e:   # the run's own outcome is what the launcher reports
            print(f"trainyard: the trackers did not close ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
