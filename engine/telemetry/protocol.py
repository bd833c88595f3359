"""The wire protocol between a run's hub and its clients (console, `trainyard ctl`).

    with connect("digits-ddp") as conn:          # a run name, a socket path or tcp://127.0.0.1:PORT
        print(conn.hello["world_size"])
        reply = conn.command("pause")             # {"type": "reply", "status": "applied", "step": 42, ...}
        for msg in conn.messages():               # snapshot, step, event, reply, dropped, bye
            ...

Newline-delimited JSON. Every message is one object with `v` (the protocol version)
and `type`. This module is the only part of the engine that clients import: it has no
torch in it. docs/protocol.md shows an example of every message.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import stat
import time
from pathlib import Path

# every run's per-rank figures, declared once (GPU_FIELDS: a CUDA rank's own, absent rather than 0 on a CPU rank);
# a run's declarations (the hello's `figures`, with its strategy's own; `every_run()` for a hello from before it
# had them) say which figures each console panel (STAGES, STREAMS) shows, and `combine` reads the ranks' values
# as one
from engine.telemetry.figures import FIGURES, GPU_FIELDS, STAGES, STREAMS, combine, every_run  # noqa: F401
# a step record's compact forms and the log's parts (records.py), read through this door too
from engine.telemetry.records import (MEMORY_COLUMNS, MEMORY_STEPS, OPTIONAL_MEMORY_COLUMNS,  # noqa: F401
                                      OPTIONAL_RANK_COLUMNS, PS_LAYER_COLUMNS, PS_WORKER_COLUMNS, RANK_COLUMNS,
                                      expand_ps, expand_ranks, log_parts, memory_unit, part_path, ps_columns,
                                      rank_columns, read_records, with_ranks)

VERSION = 1
MAX_CLIENT_LINE_BYTES = 64 * 1024        # a client's message; longer ones are refused
MAX_SERVER_LINE_BYTES = 16 * 1024 * 1024  # a hub's message (a snapshot of a big run)

CLIENT_TYPES = ("hello", "command", "ping")
SERVER_TYPES = ("hello", "snapshot", "run_start", "step", "event", "summary", "reply", "error", "dropped",
                "pong", "bye")

POLICIES = ("keep", "swap", "recompute")
PLACEMENTS = ("device", "host")
SYNC_MODES = ("soft", "bsp", "asp", "ssp")
# name -> ((argument, allowed values or None for any text), ...)
COMMANDS: dict[str, tuple] = {
    "pause": (), "resume": (), "stop": (), "checkpoint": (), "rebalance": (),
    "set-policy": (("layer", None), ("policy", POLICIES)),
    "set-placement": (("layer", None), ("placement", PLACEMENTS)),
    "set-sync": (("mode", SYNC_MODES),),
}


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text is what the peer is told."""


def usage(name: str) -> str:
    args = " ".join(a.upper() if allowed is None else "|".join(allowed) for a, allowed in COMMANDS[name])
    return f"{name} {args}".strip()


# --- strict JSON -----------------------------------------------------------------

NONFINITE_PATHS_MAX = 16   # a record names at most this many of its non-finite figures, then `+N more`


def finite_record(record: dict) -> dict:
    """`record` with every non-finite float in it (NaN, inf, -inf: not JSON), however deep, replaced by null,
    and a top-level `nonfinite` list naming them by dotted path: `["loss", "ranks.1.step_ms"]`."""
    found: list[str] = []
    cleaned = _finite(record, "", found)
    if len(found) > NONFINITE_PATHS_MAX:
        found[NONFINITE_PATHS_MAX:] = [f"+{len(found) - NONFINITE_PATHS_MAX} more"]
    return {**cleaned, "nonfinite": found} if found else record


def _finite(value, prefix: str, found: list[str]):
    """`value` with its non-finite floats as None, each one's path (`prefix` + key) added to `found`; a
    container with none is returned as it is, not copied."""
    out = None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(item, float):
            if math.isfinite(item):
                continue
            found.append(f"{prefix}{key}")
            new = None
        elif isinstance(item, (dict, list, tuple)):
            if (new := _finite(item, f"{prefix}{key}.", found)) is item:
                continue
        else:
            continue
        if out is None:
            out = dict(value) if isinstance(value, dict) else list(value)
        out[key] = new
    return value if out is None else out


def _line_encoder():
    """json.dumps(record, separators=(",", ":"), allow_nan=False), with json's C encoder made once: json.dumps makes
    one on every call, about half its time for a step record (7 microseconds against 15 alone, more in the step
    loop). No check for circular containers: a record is a tree of plain values."""
    from json import encoder
    compact = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
    if encoder.c_make_encoder is None:   # an interpreter without json's C encoder
        return compact.encode
    make = encoder.c_make_encoder(None, compact.default, encoder.encode_basestring_ascii, compact.indent,
                                  compact.key_separator, compact.item_separator, compact.sort_keys, compact.skipkeys,
                                  compact.allow_nan)
    return lambda record: "".join(make(record, 0))


_compact = _line_encoder()


def strict_json(record: dict) -> str:
    """`record` as one line of JSON with nothing non-finite in it (finite_record). The scan runs only when
    the record has something to replace: the encoder refuses it first, at no cost to a finite record."""
    try:
        return _compact(record)
    except ValueError:
        return _compact(finite_record(record))


def encode(msg: dict) -> bytes:
    return (strict_json({"v": VERSION, **msg}) + "\n").encode()


def _finite_float(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def decode(line: bytes, types=CLIENT_TYPES) -> dict:
    """One line -> a message, or ProtocolError naming what is wrong with it. A client's message must be
    strict JSON: NaN, Infinity and a number that overflows to inf (1e999, as an `id` say) are refused."""
    strict = {"parse_float": _finite_float, "parse_constant": _no_constant} if types == CLIENT_TYPES else {}
    try:
        msg = json.loads(line, **strict)
    except (ValueError, RecursionError) as e:   # also: nested too deep, an integer too long to convert
        raise ProtocolError(f"not JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} not supported; this side speaks {VERSION}")
    if msg.get("type") not in types:
        raise ProtocolError(f"unknown message type {msg.get('type')!r}; expected one of {', '.join(types)}")
    return msg


def check_command(msg: dict) -> tuple[str, list[str]]:
    """Validate a `command` message's shape: (name, args). Engine-level checks come later."""
    name, args = msg.get("name"), msg.get("args", [])
    if not isinstance(msg.get("id"), (str, int)) or isinstance(msg.get("id"), bool):
        raise ProtocolError("a command needs an `id` (string or integer) to match its reply")
    if name not in COMMANDS:
        raise ProtocolError(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ProtocolError(f"`args` must be a list of strings; usage: {usage(name)}")
    spec = COMMANDS[name]
    if len(args) != len(spec):
        raise ProtocolError(f"{name} takes {len(spec)} argument(s), got {len(args)}; usage: {usage(name)}")
    for value, (arg, allowed) in zip(args, spec):
        if allowed is not None and value not in allowed:
            raise ProtocolError(f"{name}: {arg} must be one of {', '.join(allowed)}, got {value!r}")
    return name, args


# --- where live runs are found --------------------------------------------------

class RuntimeDirError(PermissionError):
    """The folder of live runs is not ours alone: nothing may be served or found there."""


def runtime_path() -> Path:
    """Where runtime_dir() is, without making it (what a process removing its own part of it asks: making the
    folder again there left it behind, empty, after its owner had removed it)."""
    if os.environ.get("TRAINYARD_RUNTIME_DIR"):
        return Path(os.environ["TRAINYARD_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "trainyard"
    return Path("/tmp") / f"trainyard-{os.getuid()}"


def runtime_dir() -> Path:
    """A per-user folder (0700) holding each live run's socket and registry file, made where it is missing."""
    path = runtime_path()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise RuntimeDirError(f"{path}: must belong to you and be private (mode 0700); fix it or set "
                              f"TRAINYARD_RUNTIME_DIR")
    return path


def pid_alive(pid: int) -> bool:
    if pid <= 0:   # kill(0) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_runs() -> list[dict]:
    """Registry entries of the live runs on this machine (stale ones are removed)."""
    runs = []
    for entry in sorted(runtime_dir().glob("*.json")):
        try:
            info = json.loads(entry.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not pid_alive(int(info.get("pid", 0))):
            entry.unlink(missing_ok=True)
            continue
        runs.append(info)
    return runs


def find_run(name: str | None) -> dict:
    runs = list_runs()
    if name is None:
        if len(runs) == 1:
            return runs[0]
        if not runs:
            raise LookupError("no live run on this machine (`trainyard runs` lists them)")
        raise LookupError(f"{len(runs)} live runs; name one: {', '.join(r['name'] for r in runs)}")
    for info in runs:
        if info["name"] == name:
            return info
    known = ", ".join(r["name"] for r in runs) or "none"
    raise LookupError(f"no live run named {name!r} (live runs: {known})")


# --- a client -----------------------------------------------------------------

class Connection:
    """A blocking client connection: hello exchanged on open."""

    def __init__(self, sock: socket.socket, client: str, read_only: bool, token: str | None):
        self.sock = sock
        self._buffer = b""
        self._next_id = 0
        hello = {"type": "hello", "client": client, "read_only": read_only}
        if token is not None:
            hello["token"] = token
        self.send(hello)
        self.hello = self.read()
        if self.hello.get("type") == "error":
            raise ConnectionRefusedError(self.hello.get("reason", "refused by the hub"))
        if self.hello.get("type") != "hello":
            raise ProtocolError(f"expected hello from the hub, got {self.hello.get('type')!r}")

    def send(self, msg: dict) -> None:
        self.sock.sendall(encode(msg))

    def read(self, timeout: float | None = None) -> dict:
        """The next message; TimeoutError if none within `timeout`, EOFError when the hub closes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no message from the hub")
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError("no message from the hub") from None
            if not chunk:
                raise EOFError("the hub closed the connection")
            self._buffer += chunk
            if len(self._buffer) > MAX_SERVER_LINE_BYTES:
                raise ProtocolError("message from the hub exceeds the size limit")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return decode(line, SERVER_TYPES)

    def messages(self, timeout: float | None = None):
        while True:
            try:
                yield self.read(timeout)
            except EOFError:
                return

    def command(self, name: str, *args: str, timeout: float = 30.0) -> dict:
        """Send a command; return its final reply (applied or rejected), or an error."""
        self._next_id += 1
        cid = f"c{self._next_id}"
        self.send({"type": "command", "id": cid, "name": name, "args": list(args)})
        deadline = time.monotonic() + timeout
        while True:
            msg = self.read(max(deadline - time.monotonic(), 0.001))
            if msg.get("id") != cid:
                continue
            if msg["type"] == "error" or msg.get("status") in ("applied", "rejected"):
                return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


CONNECT_RETRY_S = 2.0   # a burst of consoles can fill a hub's listen queue for a moment


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A socket connected to `path`. A full listen queue (EAGAIN) or a refusal while the socket file
    exists is tried again for up to CONNECT_RETRY_S (or `timeout`, if shorter) before it is raised."""
    deadline, pause = time.monotonic() + min(CONNECT_RETRY_S, timeout), 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            busy = e.errno in (errno.EAGAIN, errno.ECONNREFUSED) and os.path.exists(path)
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def connect(target: str | None = None, *, client: str = "client", read_only: bool = False,
            token: str | None = None, timeout: float = 10.0) -> Connection:
    """`target`: a run name (None: the only live run), a socket path, or tcp://127.0.0.1:PORT."""
    if target and target.startswith("tcp://"):
        host, _, port = target[len("tcp://"):].rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    else:
        path = target if target and "/" in target else None
        if path is None:
            info = find_run(target)
            path = info["socket"]
        sock = connect_unix(path, timeout)
    try:
        return Connection(sock, client, read_only, token)
    except BaseException:
        sock.close()
        raise
