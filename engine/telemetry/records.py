"""A step record's compact forms and the log's parts: what a reader of the log or the socket undoes.

    ranks = expand_ranks(record, previous)     # `per_rank` columns back into full rank rows
    record = with_ranks(record, previous)      # the same for a whole record (and a parameter server's `ps`)
    records, notes = read_records(path)        # a JSON-lines file, and what was left out
    parts = log_parts(path)                    # run.jsonl, run.1.jsonl, ... (a log rotates by size)

Re-exported by engine.telemetry.protocol (engine.protocol, the consoles' door); docs/telemetry.md, `per_rank`.
Torch-free, imports only the standard library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


# A step record's per-rank figures on the steps between full rank rows (docs/telemetry.md, `per_rank`):
# one column per figure, by rank. What the console and the checks need every step; the rest of a rank's
# row comes with the full rows, every `telemetry.rank_every` steps and after every change. Times are in
# ms; memory is in `memory_unit` bytes (a power of two, 1/65536 of the largest capacity or finer), so a
# figure takes 5 digits, not 11: used and NVML's used to the nearest unit, the peak rounded up (a peak
# under the capacity in the columns is under it in bytes too).
# Besides, the figures the console's streams and stages panels show (sharded's reduce and broadcast waits, a
# stage's receive wait: declared with the strategy, engine/strategies/specs/figures.py PANEL_COLUMNS), which the
# writer names (`panel`): a column of each a rank reports, its own name in the rows.
RANK_COLUMNS = ("step_ms", "compute_ms", "wait_ms")
MEMORY_COLUMNS = {"used": "used_bytes", "peak": "peak_bytes"}
OPTIONAL_MEMORY_COLUMNS = {"nvml_used": "nvml_used_bytes"}   # only where a rank has it (a GPU with NVML)
OPTIONAL_RANK_COLUMNS = ("stale_steps",)                     # only where a row is stale
MEMORY_STEPS = 1 << 16


def figure_column(ranks, name: str) -> list:
    """Every rank's figure `name`, by row order, None where a rank has none. `ranks`: full rank rows, or what
    reads them a column at a time (engine/runtime/control.py RankFigures: a step's record reads a dozen
    figures of every rank, not the fifty of each row)."""
    if isinstance(ranks, list):
        return [row.get(name) for row in ranks]
    return ranks.column(name)


def memory_unit(ranks) -> int:
    """The largest power of two with at least MEMORY_STEPS of them in every rank's capacity (1 at least)."""
    capacity = min((value or 0 for value in figure_column(ranks, "capacity_bytes")), default=0)
    return 1 << max((capacity // MEMORY_STEPS).bit_length() - 1, 0)


def rank_columns(ranks, panel: tuple[str, ...] = ()) -> dict:
    """Rank rows (see figure_column) -> the compact `per_rank` columns, by row order: `{"step_ms": [..], ...,
    "memory_unit": 1048576, "used": [..], "peak": [..]}`; `rank` is a column only when the rows are not ranks
    0..n-1; each of `panel` where a rank reports it (a 0 too)."""
    columns: dict = {}
    order = figure_column(ranks, "rank")
    if order != list(range(len(order))):
        columns["rank"] = order
    for name in RANK_COLUMNS + OPTIONAL_RANK_COLUMNS + tuple(panel):
        values = figure_column(ranks, name)
        reported = any(v is not None for v in values) if name in panel else any(values)   # a 0 wait too
        if name in RANK_COLUMNS or reported:
            columns[name] = [round(v, 2) if isinstance(v, float) else v for v in values]
    unit = columns["memory_unit"] = memory_unit(ranks)
    for name, field in {**MEMORY_COLUMNS, **OPTIONAL_MEMORY_COLUMNS}.items():
        values = figure_column(ranks, field)
        if field in MEMORY_COLUMNS.values() or any(v is not None for v in values):
            up = name == "peak"
            columns[name] = [None if v is None else -(-int(v) // unit) if up else round(v / unit) for v in values]
    return columns


def expand_ranks(record: dict, previous: dict | None) -> list[dict] | None:
    """A step record's full rank rows: its own `ranks`, or the `previous` step record's (already
    expanded) overlaid with this record's `per_rank` columns. A rank the columns leave out keeps its
    older figures and counts its `stale_steps` up. None when the record has neither."""
    if isinstance(record.get("ranks"), list):
        return record["ranks"]
    columns = record.get("per_rank")
    if not isinstance(columns, dict):
        return None
    before = {row["rank"]: row for row in (previous or {}).get("ranks") or [] if isinstance(row, dict)}
    order = columns.get("rank") or list(range(len(columns.get("step_ms") or [])))
    gap = record.get("step", 0) - (previous or {}).get("step", record.get("step", 0))
    unit = columns.get("memory_unit") or 1
    memory = {name: (field, unit) for name, field in {**MEMORY_COLUMNS, **OPTIONAL_MEMORY_COLUMNS}.items()}
    # every other column is a figure under its own name (RANK_COLUMNS, stale_steps, the writer's panel columns)
    fields = {**{name: (name, 1) for name in columns if name not in ("rank", "memory_unit")}, **memory}
    rows = {rank: {**row, "stale_steps": row.get("stale_steps", 0) + max(gap, 0)} for rank, row in before.items()}
    for i, rank in enumerate(order):
        row = {**before.get(rank, {"rank": rank}), "stale_steps": 0}
        for name, (field, scale) in fields.items():
            values = columns.get(name)
            if values is not None and i < len(values) and values[i] is not None:
                row[field] = values[i] * scale
        rows[rank] = row
    return [rows[rank] for rank in sorted(rows)]


# A parameter server's per-worker and per-layer figures on the same steps: columns too, by the order of the
# last full step's `ps.workers` and `ps.layers` (what does not change, a worker's slowness, a layer's name
# and server, comes with the full rows).
PS_WORKER_COLUMNS = ("rank", "iterations", "steps_per_s", "wait_ms", "compute_ms", "alive")
PS_LAYER_COLUMNS = ("version", "window_workers", "mean_staleness", "window_ms", "windows", "gradients",
                    "staleness_sum", "staleness_max", "applied")


def ps_columns(ps: dict) -> dict:
    """A step's `ps` with `workers` and `layers` as `worker_columns` and `layer_columns`."""
    out = {key: value for key, value in ps.items() if key not in ("workers", "layers")}
    out["worker_columns"] = {name: [w.get(name) for w in ps.get("workers") or []] for name in PS_WORKER_COLUMNS}
    layers = ps.get("layers") or []
    out["layer_columns"] = {name: [layer.get(name) for layer in layers] for name in PS_LAYER_COLUMNS
                            if any(name in layer for layer in layers) or name in PS_LAYER_COLUMNS[:4]}
    return out


def expand_ps(ps: dict, previous: dict | None) -> dict:
    """`ps` with its columns overlaid on the `previous` step's (expanded) workers and layers, by position;
    a column whose length does not match keeps the previous figures."""
    if "worker_columns" not in ps and "layer_columns" not in ps:
        return ps
    previous = previous or {}
    out = {key: value for key, value in ps.items() if key not in ("worker_columns", "layer_columns")}
    for key, columns_key in (("workers", "worker_columns"), ("layers", "layer_columns")):
        rows = [dict(row) for row in previous.get(key) or []]
        for name, values in (ps.get(columns_key) or {}).items():
            if len(values) == len(rows):
                for row, value in zip(rows, values):
                    row[name] = value
        out[key] = rows
    return out


def with_ranks(record: dict, previous: dict | None) -> dict:
    """`record` with its full rank rows in `ranks` in place of its `per_rank` columns (see expand_ranks), and a
    parameter server's workers and layers in place of their columns (expand_ps); the record itself when it
    has them."""
    compact_ps = isinstance(record.get("ps"), dict) and "worker_columns" in record["ps"]
    if "per_rank" not in record and not compact_ps:
        return record
    filled = {key: value for key, value in record.items() if key != "per_rank"}
    if "per_rank" in record:
        filled["ranks"] = expand_ranks(record, previous) or []
    if compact_ps:
        filled["ps"] = expand_ps(record["ps"], (previous or {}).get("ps"))
    return filled


def part_path(path: Path, index: int) -> Path:
    """The `index`-th part (docs/telemetry.md: a log rotates by size) of the log at `path`: `run.jsonl`, `run.1.jsonl`, ..."""
    return path if index == 0 else path.with_name(f"{path.stem}.{index}{path.suffix}")


def log_parts(path: Path) -> list[Path]:
    """The parts of the log at `path` that exist, in the order they were written."""
    path = Path(path)
    pattern = re.compile(re.escape(path.stem) + r"\.(\d+)" + re.escape(path.suffix) + "$")
    numbered = sorted((int(m.group(1)), p) for p in path.parent.glob(f"{path.stem}.*{path.suffix}")
                      if (m := pattern.match(p.name)))
    return [p for p in [path] if p.exists()] + [p for _, p in numbered]


def read_records(path: Path) -> tuple[list[dict], list[str]]:
    """A JSON-lines file's objects, and what was left out, a note a line: a line that is not a JSON object
    (`line 7: not JSON (...)`), or a last line cut short (no newline, not whole JSON: the writer stopped
    mid-record, a full disk or a kill). Older logs' NaN and Infinity read as floats."""
    records, notes = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problem = None if isinstance(record, dict) else "not a JSON object"
            except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
                problem = f"not JSON ({getattr(e, 'msg', e)})"
            if problem is None:
                records.append(record)
            elif not line.endswith(b"\n"):
                notes.append(f"an incomplete last line ({len(line)} bytes): the writer stopped mid-record")
            else:
                notes.append(f"line {number}: {problem}")
    return records, notes
