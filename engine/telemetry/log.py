"""The telemetry log: one JSON object per line, complete (never sampled).

    log = TelemetryLog(path, max_bytes=1 << 30)   # rank 0 only
    log.write({"type": "step", "step": 1, "loss": 2.3, ...})
    records = read_log(path)                      # every part, in order, each step's ranks in full

Record types and their fields are documented in docs/telemetry.md. The file is
opened for appending: after a restart the steps from the resumed checkpoint on
are written again, after a `restart` event, so a reader keeps the last record
of each step.

A log rotates by size: once a part holds `max_bytes`, the next record starts the next part,
`telemetry.jsonl`, `telemetry.1.jsonl`, `telemetry.2.jsonl`, ... in the order written. Parts
are never renamed, so a reader following one is never pulled from under it; `log_parts` lists
the set, and `read_log` and `--replay` read it whole.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.telemetry.protocol import log_parts, part_path, with_ranks

SCHEMA_VERSION = 1


class TelemetryLog:
    def __init__(self, path: Path | None, max_bytes: int = 0):
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes   # 0: one part, however long
        self._file = None
        self._part = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            parts = log_parts(self.path)
            self._part = len(parts) - 1 if parts else 0   # a restart appends to the newest part
            self._open()

    def _open(self) -> None:
        self._file = open(part_path(self.path, self._part), "a", buffering=1)   # line-buffered: no half line
        self._size = self._file.tell()

    @staticmethod
    def stamp(record: dict) -> dict:
        """The record with the schema version and the time, as written."""
        return {"schema": SCHEMA_VERSION, "time": round(time.time(), 3), **record}

    def write(self, record: dict, stamped: bool = False) -> dict:
        """Stamp the record (unless `stamped`), append it (to a new part when this one is full), return it."""
        record = record if stamped else self.stamp(record)
        if self._file is not None:
            line = json.dumps(record, separators=(",", ":")) + "\n"
            if self.max_bytes and self._size and self._size + len(line) > self.max_bytes:
                self._file.close()
                self._part += 1
                self._open()
            self._file.write(line)
            self._size += len(line)
        return record

    def event(self, kind: str, step: int, **fields) -> None:
        self.write({"type": "event", "kind": kind, "step": step, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_raw(path: Path) -> list[dict]:
    """All records of a telemetry log's parts, in order, as written."""
    records = []
    for part in log_parts(path):
        with open(part) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def read_log(path: Path) -> list[dict]:
    """All records of a telemetry log's parts, in order; every step record has its full `ranks` (the
    steps between full rank rows carry `per_rank` columns, overlaid here on the rows before them)."""
    return fill_ranks(read_raw(path))


def fill_ranks(records: list[dict]) -> list[dict]:
    """Each step record with its full `ranks` (engine.protocol.with_ranks)."""
    previous, out = None, []
    for record in records:
        if record.get("type") == "step":
            record = previous = with_ranks(record, previous)
        elif record.get("type") == "run_start":
            previous = None   # a restart's first step has full rows again
        out.append(record)
    return out


def last_step_records(records: list[dict]) -> dict[int, dict]:
    """step -> the last `step` record written for it (a restart writes some steps twice)."""
    return {r["step"]: r for r in records if r.get("type") == "step"}
