"""The telemetry log: one JSON object per line, complete (never sampled).

    log = TelemetryLog(path)            # rank 0 only
    log.write({"type": "step", "step": 1, "loss": 2.3, ...})

Record types and their fields are documented in docs/telemetry.md. The file is
opened for appending: after a restart the steps from the resumed checkpoint on
are written again, after a `restart` event, so a reader keeps the last record
of each step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

SCHEMA_VERSION = 1


class TelemetryLog:
    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)   # line-buffered: a crash loses no whole line

    def write(self, record: dict) -> dict:
        """Stamp the record with the schema version and the time, append it, return it."""
        record = {"schema": SCHEMA_VERSION, "time": round(time.time(), 3), **record}
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        return record

    def event(self, kind: str, step: int, **fields) -> None:
        self.write({"type": "event", "kind": kind, "step": step, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_log(path: Path) -> list[dict]:
    """All records of a telemetry log, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_step_records(records: list[dict]) -> dict[int, dict]:
    """step -> the last `step` record written for it (a restart writes some steps twice)."""
    return {r["step"]: r for r in records if r.get("type") == "step"}
