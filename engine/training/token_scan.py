"""A token file's largest id and where it first is, scanned once and kept beside the file (PATH.scan.json), so
that a run refuses ids past its model's vocabulary before any worker starts (engine/run/checks.py) and a token
data set without a vocabulary of its own takes the largest id + 1 (engine/training/data.py).

    max_id, position = largest_id("train.bin", "uint16")

Imports nothing of the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

SCAN_CHUNK_IDS = 1 << 26   # 64 Mi ids a pass: the scan holds one chunk, not the file


def scan_path(path: str) -> Path:
    """Where the scan of a token file is kept: beside it, PATH.scan.json."""
    return Path(f"{path}.scan.json")


def largest_id(path: str, dtype: str) -> tuple[int, int]:
    """(the token file's largest id, its first position as a token index). The scan is kept in
    PATH.scan.json and reused while the file's size, mtime_ns and dtype are those it was made from, so a
    large file is read once; where the folder cannot be written, the file is scanned each time."""
    stat = os.stat(path)
    key = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype}
    kept = _read_scan(scan_path(path), key)
    if kept is not None:
        return kept
    max_id, position = _scan(path, dtype)
    _keep_scan(scan_path(path), {**key, "max_id": max_id, "max_id_position": position})
    return max_id, position


def _scan(path: str, dtype: str) -> tuple[int, int]:
    import numpy as np
    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    max_id, start = -1, 0
    for i in range(0, len(ids), SCAN_CHUNK_IDS):
        chunk_max = int(ids[i:i + SCAN_CHUNK_IDS].max())
        if chunk_max > max_id:
            max_id, start = chunk_max, i
    # the position is looked for in the one chunk that holds the largest id, not in the file
    return max_id, start + int(np.argmax(ids[start:start + SCAN_CHUNK_IDS]))


def _read_scan(path: Path, key: dict) -> tuple[int, int] | None:
    try:
        scan = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(scan, dict) or any(scan.get(k) != v for k, v in key.items()):
        return None   # another file, or the file since changed
    max_id, position = scan.get("max_id"), scan.get("max_id_position")
    return (max_id, position) if type(max_id) is int and type(position) is int else None


def _keep_scan(path: Path, scan: dict) -> None:
    # written whole or not at all (tmp + rename): launchers and workers of several hosts may share the folder
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    except OSError:
        return   # a folder this process cannot write: the next run scans again
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)   # mkstemp's 0600 would hide the scan from other users
            json.dump(scan, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
