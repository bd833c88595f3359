"""`trainyard runs` and `trainyard ctl`: the shell's view of live runs, through engine.telemetry.protocol only
(and console/where.py, which words where a pipeline's layer is for the answer to a command on it).

    trainyard runs                           # name, mode, world size, step, socket
    trainyard ctl digits-ddp pause           # prints "applied at step 42", exit 0
    trainyard ctl digits-ddp set-policy fc9 swap   # "rejected: unknown layer 'fc9'", exit 1
    trainyard ctl gpt-pipe set-policy blocks.3 swap
    # "applied at step 42", then "blocks.3 is on stage 1: applied on each of its 2 replicas (ranks 2, 3)"

Exit status of ctl: 0 applied, 1 rejected, 2 a bad command or no run to talk to.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from console.where import LAYER_COMMANDS, where_applied
from engine.telemetry import protocol

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _token(path: Path | None) -> str | None:
    return path.read_text().strip() if path else None


def runs() -> int:
    try:
        live = protocol.list_runs()
    except PermissionError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    if not live:
        out.print("no live runs")
        return 0
    table = Table("name", "mode", "world size", "step", "socket", box=None)
    for info in live:
        world = str(info.get("world_size", "?")) + (f"/{info['max_world_size']}" if info.get("max_world_size") else "")
        table.add_row(info["name"], info.get("mode", "?"), world, _current_step(info),
                      info["socket"] + (f"  {info['tcp']}" if info.get("tcp") else ""))
    out.print(table)
    return 0


def _current_step(info: dict) -> str:
    try:
        with protocol.connect(info["socket"], client="trainyard-runs", read_only=True, timeout=2) as conn:
            snapshot = conn.read(timeout=2)
        steps = snapshot.get("steps")
        return f"{snapshot.get('step', '?')}/{steps}" + (" (paused)" if snapshot.get("paused") else "")
    except (OSError, EOFError, TimeoutError, protocol.ProtocolError):
        return "?"


def ctl(run: str, command: str, args: list[str], token_file: Path | None, timeout_s: float) -> int:
    try:
        protocol.check_command({"id": 0, "name": command, "args": args})
    except protocol.ProtocolError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    try:
        with protocol.connect(run, client="trainyard-ctl", token=_token(token_file)) as conn:
            # a command on a layer: where the layer is (a pipeline's stage), from the snapshot that follows hello
            snapshot = conn.read(timeout=timeout_s) if command in LAYER_COMMANDS else {}
            reply = conn.command(command, *args, timeout=timeout_s)
    except LookupError as e:
        err.print(f"[red]error:[/] {escape(str(e.args[0]))}")
        return 2
    except (OSError, EOFError, TimeoutError, protocol.ProtocolError) as e:
        err.print(f"[red]error:[/] cannot talk to run {run!r}: {escape(str(e) or type(e).__name__)}")
        return 2
    said = escape(" ".join([command, *args]))
    if reply.get("status") == "applied":
        out.print(f"{said}: applied at step {reply.get('step')}")
        if reply.get("reason"):   # what the engine made of it (a rebalance: the new layout, or why none)
            out.print(f"  {escape(str(reply['reason']))}")
        if where := where_applied(command, args, conn.hello, snapshot.get("last_step"), snapshot.get("layers")):
            out.print(f"  {escape(where)}")
        return 0
    err.print(f"{said}: rejected: {escape(str(reply.get('reason')))}")
    return 1
