"""`trainyard console`: open the console on a live run or a telemetry log.

    python -m console [RUN] [--read-only] [--replay run.jsonl] [--token-file F]   # = trainyard console

The console imports nothing of the engine but `engine.protocol`; `trainyard demo`, which also
starts a run, is demo/launch.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import protocol


def _token(target: str | None, token_file: Path | None) -> str | None:
    """The TCP token: from --token-file, else from the registry entry serving that address."""
    if token_file is not None:
        return token_file.read_text().strip()
    if target and target.startswith("tcp://"):
        for info in protocol.list_runs():
            if info.get("tcp") == target and info.get("token_file"):
                return Path(info["token_file"]).read_text().strip()
    return None


def attach(run: str | None, read_only: bool = False, replay: Path | None = None,
           token_file: Path | None = None) -> int:
    from console.app import ConsoleApp
    from console.client import ReplaySource, SocketSource

    if replay is not None:
        if not replay.is_file():
            print(f"error: no telemetry log at {replay}", file=sys.stderr)
            return 2
        ConsoleApp(ReplaySource(replay)).run()
        return 0
    try:
        if run is None:
            runs = protocol.list_runs()
            run = runs[0]["name"] if len(runs) == 1 else None   # none or several: the picker
        token = _token(run, token_file)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    source = SocketSource(run, read_only=read_only, token=token) if run else None
    ConsoleApp(source, read_only=read_only, token=token).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m console", description="The trainyard live console.")
    parser.add_argument("run", nargs="?", help="run name, socket path or tcp://127.0.0.1:PORT (default: ask)")
    parser.add_argument("--read-only", action="store_true", help="watch only: commands are disabled")
    parser.add_argument("--replay", type=Path, metavar="LOG", help="play a telemetry log back instead")
    parser.add_argument("--token-file", type=Path, help="token file of a TCP hub")
    args = parser.parse_args(argv)
    return attach(args.run, args.read_only, args.replay, args.token_file)


if __name__ == "__main__":
    sys.exit(main())
