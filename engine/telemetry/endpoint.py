"""Where a hub listens: the socket's name in the runtime directory, private files, loopback TCP.

    host, port = parse_listen("tcp://127.0.0.1:0")    # ValueError for a non-loopback host
    stem = free_stem(runtime_dir, "digits-ddp")         # "digits-ddp", or "digits-ddp-PID" if taken
    write_private(runtime_dir / f"{stem}.json", text)   # atomic, mode 0600
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

SOCKET_PATH_MAX = 107   # the bytes of a Unix socket's path (sun_path's 108, less its NUL)


def parse_listen(listen: str) -> tuple[str, int]:
    """"tcp://127.0.0.1:PORT" -> (host, port); ValueError for any host that is not loopback."""
    usage = f"listen {listen!r}: expected tcp://127.0.0.1:PORT (PORT 0: any free port)"
    host, _, port = listen.removeprefix("tcp://").rpartition(":")
    host = "127.0.0.1" if host == "localhost" else host.strip("[]")
    try:
        address, port = ipaddress.ip_address(host), int(port)
    except ValueError:
        raise ValueError(usage) from None
    if not address.is_loopback:
        raise ValueError(f"listen {listen!r}: the hub serves only loopback addresses (127.0.0.1, ::1); "
                         f"from another machine, use an SSH tunnel")
    if not listen.startswith("tcp://") or not 0 <= port <= 65535:
        raise ValueError(usage)
    return host, port


def free_stem(directory: Path, run: str) -> str:
    """`run`, or `run-PID` when a live run already serves that name; a dead run's socket is removed."""
    pid = os.getpid()
    for stem in (run, f"{run}-{pid}"):
        path = directory / f"{stem}.sock"
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ValueError(f"socket path {path} is too long; set TRAINYARD_RUNTIME_DIR to a shorter folder")
        if not os.path.lexists(path):
            return stem
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))   # answered (or busy, below): a live run has this name
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)
                return stem
            except OSError:
                pass
    raise FileExistsError(f"live runs in {directory} already serve both {run} and {run}-{pid}")


def write_private(path: Path, text: str) -> None:
    """Write atomically (readers see all or nothing), readable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)
