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

Each record is one whole line of strict JSON (a NaN figure is written null and named in `nonfinite`).
A write that fails (a full disk) cuts the part back to its last whole line and raises LogWriteError,
which says how far the log is whole; readers skip a line that is not whole JSON and say so.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.runtime.disk import disk_words
from engine.telemetry.protocol import log_parts, part_path, read_records, strict_json, with_ranks

SCHEMA_VERSION = 1


class LogWriteError(RuntimeError):
    """The log could not be written (a full disk, say). Not an OSError: the run stops rather than restarts,
    since a restart would meet the same disk. The log is whole up to the record before; it writes no more."""

    says_all = True   # its line names the file, the disk and what is whole: no traceback beside it


class TelemetryLog:
    def __init__(self, path: Path | None, max_bytes: int = 0):
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes   # 0: one part, however long
        self._file = None
        self._part = 0
        self.last_step: int | None = None          # the last step record written whole
        self.failure: LogWriteError | None = None  # set once a write failed: the log writes no more
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            parts = log_parts(self.path)
            self._part = len(parts) - 1 if parts else 0   # a restart appends to the newest part
            self._open()

    def _open(self) -> None:
        self._file = open(part_path(self.path, self._part), "ab", buffering=0)   # a record is one write
        self._size = self._file.tell()

    @staticmethod
    def stamp(record: dict) -> dict:
        """The record with the schema version and the time, as written."""
        return {"schema": SCHEMA_VERSION, "time": round(time.time(), 3), **record}

    def write(self, record: dict, stamped: bool = False) -> dict:
        """Stamp the record (unless `stamped`), append it as one whole line of strict JSON (to a new part
        when this one is full), return it. LogWriteError when it cannot, and on every write after."""
        record = record if stamped else self.stamp(record)
        if self.failure is not None:
            raise self.failure
        if self._file is not None:
            line = (strict_json(record) + "\n").encode()
            try:
                if self.max_bytes and self._size and self._size + len(line) > self.max_bytes:
                    self._file.close()
                    self._file = None
                    self._part += 1
                    self._open()
                view = memoryview(line)
                while view:   # a full disk may take part of it first
                    view = view[self._file.write(view):]
            except OSError as e:
                raise self._fail(e) from e
            self._size += len(line)
            if record.get("type") == "step":
                self.last_step = record.get("step")
        return record

    def _fail(self, error: OSError) -> LogWriteError:
        """Cut the part back to its last whole line (ftruncate takes no space), stop writing, say why."""
        where = part_path(self.path, self._part)
        cut = ""
        if self._file is not None:
            try:
                self._file.truncate(self._size)
            except OSError as e:
                cut = f"; its last line may be cut ({e})"
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        disk = disk_words(where.parent)
        whole = f"up to step {self.last_step}" if self.last_step is not None else "with no step record yet"
        self.failure = LogWriteError(f"the telemetry log {where} could not be written: {error} ({disk}); "
                                     f"the log is whole {whole}{cut}")
        return self.failure

    def event(self, kind: str, step: int, **fields) -> None:
        self.write({"type": "event", "kind": kind, "step": step, **fields})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_raw(path: Path) -> list[dict]:
    """All records of a telemetry log's parts, in order, as written. A line that is not whole JSON (a
    last line cut short: the writer stopped mid-record) is skipped, and stderr says so."""
    records = []
    for part in log_parts(path):
        got, notes = read_records(part)
        records += got
        for note in notes:
            print(f"trainyard: {part}: skipped {note}", file=sys.stderr, flush=True)
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
