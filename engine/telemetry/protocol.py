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
import re
import socket
import stat
import time
from pathlib import Path

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


# A step record's per-rank figures on the steps between full rank rows (docs/telemetry.md, `per_rank`):
# one column per figure, by rank. What the console and the checks need every step; the rest of a rank's
# row comes with the full rows, every `telemetry.rank_every` steps and after every change. Times are in
# ms; memory is in `memory_unit` bytes (a power of two, 1/65536 of the largest capacity or finer), so a
# figure takes 5 digits, not 11: used and NVML's used to the nearest unit, the peak rounded up (a peak
# under the capacity in the columns is under it in bytes too).
RANK_COLUMNS = ("step_ms", "compute_ms", "wait_ms")
MEMORY_COLUMNS = {"used": "used_bytes", "peak": "peak_bytes"}
OPTIONAL_MEMORY_COLUMNS = {"nvml_used": "nvml_used_bytes"}   # only where a rank has it (a GPU with NVML)
OPTIONAL_RANK_COLUMNS = ("stale_steps",)                     # only where a row is stale
MEMORY_STEPS = 1 << 16


def memory_unit(ranks: list[dict]) -> int:
    """The largest power of two with at least MEMORY_STEPS of them in every rank's capacity (1 at least)."""
    capacity = min((row.get("capacity_bytes") or 0 for row in ranks), default=0)
    return 1 << max((capacity // MEMORY_STEPS).bit_length() - 1, 0)


def rank_columns(ranks: list[dict]) -> dict:
    """Full rank rows -> the compact `per_rank` columns, by row order: `{"step_ms": [..], ..., "memory_unit":
    1048576, "used": [..], "peak": [..]}`; `rank` is a column only when the rows are not ranks 0..n-1."""
    columns: dict = {}
    if [row["rank"] for row in ranks] != list(range(len(ranks))):
        columns["rank"] = [row["rank"] for row in ranks]
    for name in RANK_COLUMNS + OPTIONAL_RANK_COLUMNS:
        values = [row.get(name) for row in ranks]
        if name in RANK_COLUMNS or any(values):
            columns[name] = [round(v, 2) if isinstance(v, float) else v for v in values]
    unit = columns["memory_unit"] = memory_unit(ranks)
    for name, field in {**MEMORY_COLUMNS, **OPTIONAL_MEMORY_COLUMNS}.items():
        values = [row.get(field) for row in ranks]
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
    fields = {**{name: (name, 1) for name in RANK_COLUMNS + OPTIONAL_RANK_COLUMNS},
              **{name: (field, unit) for name, field in {**MEMORY_COLUMNS, **OPTIONAL_MEMORY_COLUMNS}.items()}}
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


def strict_json(record: dict) -> str:
    """`record` as one line of JSON with nothing non-finite in it (finite_record). The scan runs only when
    the record has something to replace: json.dumps refuses it first, at no cost to a finite record."""
    try:
        return json.dumps(record, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(finite_record(record), separators=(",", ":"), allow_nan=False)


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


def runtime_dir() -> Path:
    """A per-user folder (0700) holding each live run's socket and registry file."""
    if os.environ.get("TRAINYARD_RUNTIME_DIR"):
        path = Path(os.environ["TRAINYARD_RUNTIME_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "trainyard"
    else:
        path = Path("/tmp") / f"trainyard-{os.getuid()}"
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
