"""`trainyard demo NAME`: start a demo's run in the background and open the console on it.

    from demo.launch import demo, demo_overrides
    demo("pipeline", steps=None)          # returns when the console closes (the run stopped or detached)
    demo_overrides("pipeline")            # the `--set` overrides the demo run gets

The demo's training runs in its own process session with its output in RUN_DIR/demo.log, so
the console can detach and leave it training; choosing "stop the run" ends it. This module sits
above both the engine (its config) and the console (its app): neither imports it.
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

DEMO_STEPS = 3000          # about four minutes at DEMO_PAUSE_MS
DEMO_PAUSE_MS = 80
START_TIMEOUT_S = 120      # torch start-up and worker spawning on a slow machine


def demo_overrides(name: str) -> list[str]:
    """What `trainyard demo NAME` sets over the demo's config: its own overrides and a run name of its own."""
    demo = DEMOS[name]
    try:
        runs_dir = Path(load_config(demo.path, list(demo.overrides)).run.dir)
    except ConfigError:   # reported when the run loads it
        runs_dir = Path("runs")
    return ["run.overwrite=true", *demo.overrides, f"run.name={run_name(name, runs_dir)}"]


def _wait_for_run(proc: subprocess.Popen, name: str, since: float) -> dict | None:
    """The registry entry of the run `proc` started, once its hub is up; None if proc ended first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        for info in protocol.list_runs():
            if info.get("run") == name and info.get("started", 0) >= since - 1:
                return info
        time.sleep(0.2)
    return None


def _end(proc: subprocess.Popen, grace_s: float) -> int:
    """Wait for the run to finish; past `grace_s`, interrupt its session (final checkpoint), then kill."""
    for sig, wait_s in ((None, grace_s), (signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


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
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    print(f"starting {cfg.run.name}: {about.about}\n  keys: {about.keys}\n  log: {log} …", flush=True)
    signal.signal(signal.SIGHUP, signal.default_int_handler)   # a hang-up before the console: as Ctrl-C
    try:
        info = _wait_for_run(proc, cfg.run.name, since)
    except KeyboardInterrupt:
        return _end(proc, 0) or 130
    if info is None:
        code = _end(proc, 0)
        print(f"the demo run ended before its console could attach (exit {code}); its log, {log}:\n"
              + "".join(log.read_text().splitlines(keepends=True)[-15:]), file=sys.stderr)
        return code or 1
    result = None
    app = ConsoleApp(SocketSource(info["name"]))
    ender = _Ender(proc)

    def hang_up(signum, frame) -> None:
        # The terminal is gone. Textual's shutdown can then block for ever on its output queue (its writer
        # thread died writing to the closed terminal), so the run is stopped from a thread of our own,
        # which then ends this process whatever the console is doing.
        threading.Thread(target=ender.after_hangup, name="demo-hangup", daemon=True).start()
        app.exit("hangup")

    signal.signal(signal.SIGHUP, hang_up)
    try:
        result = app.run()
    finally:
        # Only a chosen detach leaves the run training. A closed terminal (a hang-up, or the console
        # ending on its lost input first) or a console that failed stops it after its final checkpoint,
        # as "stop" does: nobody is there to see it go on.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if result == "detach" and proc.poll() is None:
            _say(f"{cfg.run.name} goes on training in the background (launcher pid {proc.pid}).\n"
                 f"  watch it:  trainyard console {info['name']}\n"
                 f"  stop it:   trainyard ctl {info['name']} stop\n"
                 f"  its log:   {log}")
        else:
            code = ender.end(60.0 if result == "stop" else 0)
            _say(f"{cfg.run.name} ended (exit {code}); log: {log}")
    return 0


class _Ender:
    """Ends the demo's run once, whichever of the console's thread and the hang-up's asks first."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.code, self.lock = proc, None, threading.Lock()

    def end(self, grace_s: float) -> int:
        with self.lock:
            if self.code is None:
                self.code = _end(self.proc, grace_s)
            return self.code

    def after_hangup(self) -> None:
        self.end(0)
        os._exit(0)


def _say(text: str) -> None:
    try:
        print(text, flush=True)
    except OSError:   # the terminal is gone
        pass
