"""`trainyard demo NAME`: start a demo's run in the background and open the console on it.

    from demo.launch import demo, demo_overrides
    demo("pipeline", steps=None)          # returns when the console closes (the run stopped or detached)
    demo_overrides("pipeline")            # the `--set` overrides the demo run gets

The demo's training runs in its own process session with its output in RUN_DIR/demo.log, so
the console can detach and leave it training; choosing "stop the run" ends it, and so does a closed
terminal, SIGTERM or SIGINT to this command (after the run's final checkpoint: the run is owned through
engine/processes/children.py). This module sits above both the engine (its config) and the console (its
app): neither imports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from demo import DEMOS, run_name
from engine import protocol
from engine.config import ConfigError, load_config
from engine.config.load import read_toml
from engine.processes.children import SIGNALS, ChildRuns

DEMO_STEPS = 3000          # about four minutes at DEMO_PAUSE_MS
DEMO_PAUSE_MS = 80
START_TIMEOUT_S = 120      # torch start-up and worker spawning on a slow machine


def demo_overrides(name: str) -> list[str]:
    """What `trainyard demo NAME` sets over the demo's config: its own overrides and a run name of its own."""
    demo = DEMOS[name]
    from demo.prepare import PREPARE
    runs_dir = Path(read_toml(demo.path).get("run", {}).get("dir", "runs"))
    files = PREPARE[name](runs_dir) if name in PREPARE else []   # the files its config names
    try:
        runs_dir = Path(load_config(demo.path, [*demo.overrides, *files]).run.dir)
    except ConfigError:   # reported when the run loads it
        runs_dir = Path("runs")
    return ["run.overwrite=true", *demo.overrides, *files, f"run.name={run_name(name, runs_dir)}"]


def _wait_for_run(proc: subprocess.Popen, name: str, since: float) -> dict | None:
    """The registry entry of the run `proc` started, once its hub is up; None if proc ended first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        for info in protocol.list_runs():
            if info.get("run") == name and info.get("started", 0) >= since - 1:
                return info
        time.sleep(0.2)
    return None


def demo(name: str, steps: int | None) -> int:
    from console.app import ConsoleApp   # here: `demo --headless` needs no console
    from console.client import SocketSource

    about = DEMOS[name]
    overrides = [*demo_overrides(name), f"run.step_pause_ms={DEMO_PAUSE_MS}", f"run.steps={steps or DEMO_STEPS}"]
    try:
        cfg = load_config(about.path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    log = cfg.run_dir / "demo.log"
    cmd = [sys.executable, "-m", "engine.cli", "run", str(about.path), "--headless",
           *(arg for o in overrides for arg in ("--set", o))]
    since = time.time()
    # Until the console is up, SIGTERM, SIGINT or a hang-up stops the run (ChildRuns) and then this process.
    with ChildRuns() as runs:
        with open(log, "w") as out:
            proc = runs.start(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        print(f"starting {cfg.run.name}: {about.about}\n  keys: {about.keys}\n  log: {log} …", flush=True)
        info = _wait_for_run(proc, cfg.run.name, since)
        if info is None:
            code = runs.stop(proc)
            print(f"the demo run ended before its console could attach (exit {code}); its log, {log}:\n"
                  + "".join(log.read_text().splitlines(keepends=True)[-15:]), file=sys.stderr)
            return code or 1
        app = ConsoleApp(SocketSource(info["name"]))
        result = _console(app, runs, proc)
        # Only a chosen detach leaves the run training. A closed terminal (a hang-up, or the console
        # ending on its lost input first) or a console that failed stops it after its final checkpoint,
        # as "stop" does: nobody is there to see it go on.
        if result == "detach" and proc.poll() is None:
            runs.release(proc)
            _say(f"{cfg.run.name} goes on training in the background (launcher pid {proc.pid}).\n"
                 f"  watch it:  trainyard console {info['name']}\n"
                 f"  stop it:   trainyard ctl {info['name']} stop\n"
                 f"  its log:   {log}")
        else:
            code = runs.stop(proc, finish_s=60.0 if result == "stop" else 0)
            _say(f"{cfg.run.name} ended (exit {code}); log: {log}")
    return 0


def _console(app, runs: ChildRuns, proc: subprocess.Popen):
    """app.run(), with SIGHUP, SIGTERM and SIGINT answered by stopping the run and then this process."""

    def hang_up(signum, frame) -> None:
        # The terminal is gone, or we are told to go. Textual's shutdown can then block for ever on its
        # output queue (its writer thread died writing to the closed terminal), so the run is stopped from
        # a thread of our own, which then ends this process whatever the console is doing.
        def end() -> None:
            runs.stop(proc)
            os._exit(128 + signum)
        threading.Thread(target=end, name="demo-hangup", daemon=True).start()
        app.exit("hangup")

    previous = {sig: signal.signal(sig, hang_up) for sig in SIGNALS}
    try:
        return app.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(text: str) -> None:
    try:
        print(text, flush=True)
    except OSError:   # the terminal is gone
        pass
