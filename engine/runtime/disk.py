"""What to say when a write fails: the disk it went to and what that disk has left.

    disk_words(path)                 # "its disk (/runs, mounted at /) has 0 B free of 2.0 MiB"
    describe_os_error(error, path)   # "[Errno 28] No space left on device writing /runs/x/...; its disk ..."

The log, the checkpoint, the export and the launcher say the same words. Imports nothing of the engine's.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_words(path) -> str:
    """The disk holding `path` (or its nearest existing parent): its folder, mount point and free bytes."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return f"its disk ({path}) could not be read"
    return (f"its disk ({path}, mounted at {_mount_point(path)}) has {human_bytes(usage.free)} free of "
            f"{human_bytes(usage.total)}")


def describe_os_error(error: OSError, path=None) -> str:
    """An OSError in one line: what failed, on which file, and, for a full disk, that disk's state."""
    where = path or error.filename
    text = f"{error.strerror or error}" + (f" writing {error.filename}" if error.filename else "")
    if where is not None and (error.errno in FULL or error.errno == errno.EROFS):
        text += f"; {disk_words(where)}"
    return text
