"""`trainyard bench console [--json]`: what the live console costs, and how fast a key reaches the run.

A child process serves a synthetic run through a real engine.telemetry.hub.Hub: 64 ranks and 200 layers,
10 step messages a second, every one with its layers. This process runs the real console app
headless (App.run_test) attached to it, so psutil's figure for this process is the console's
alone: socket reader, message handling and redraws. Then `p` is pressed 20 times; the child
stamps each command as take_commands() hands it over, and the delay is stamp minus press
(CLOCK_MONOTONIC is one clock for every process on Linux).

    trainyard bench console              # a table
    trainyard bench console --json       # one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RANKS, LAYERS, HZ = 64, 200, 10
CPU_GOAL_PERCENT, DELAY_GOAL_MS = 30.0, 100.0
RUN = "bench-console"


def synthetic_step(step: int) -> dict:
    ranks = [{"rank": r, "loss": 2.0 / (1 + step / 100), "step_ms": 40.0 + r % 7, "fwd_ms": 12.0, "bwd_ms": 24.0,
              "optim_ms": 4.0, "wait_ms": r % 5 * 0.3, "parameters_bytes": 200_000_000,
              "gradients_bytes": 200_000_000, "optimizer_state_bytes": 400_000_000,
              "activations_bytes": (step * 7919 + r * 104729) % 900_000_000, "swapped_bytes": 0,
              "used_bytes": 1_500_000_000 + r * 1_000_000, "peak_bytes": 2_000_000_000,
              "capacity_bytes": 8 << 30, "over_capacity": False, "rss_bytes": 3 << 30,
              "cpu_percent": 95.0} for r in range(RANKS)]
    layers = [{"name": f"blocks.{i}", "owner_rank": i % RANKS, "fwd_ms": 0.1 + (i * step) % 17 / 10,
               "bwd_ms": 0.2 + (i + step) % 13 / 10, "activation_bytes": 1_000_000 + i * 1000,
               "policy": ("keep", "swap", "recompute")[i % 3], "placement": ("device", "host")[i % 2]}
              for i in range(LAYERS)]
    streams = [{"stream": s, "bytes": 50_000_000 + step % 9 * 1_000_000, "busy_ms": 10.0 + s,
                "busy_fraction": 0.3 + s / 20, "in_flight": s % 3} for s in range(4)]
    return {"schema": 1, "time": time.time(), "type": "step", "step": step, "loss": 2.0 / (1 + step / 100),
            "samples_per_s": 50_000.0 + step % 50 * 100, "step_ms": 45.0, "ranks": ranks,
            "time_split": {"compute_ms": 36.0, "comm_ms": 12.0, "wait_ms": 1.5}, "streams": streams,
            "layers": layers}


def feed(seconds: float) -> None:
    """The child: a hub fed at HZ; every command is stamped on stdout, then applied."""
    import threading

    from engine.telemetry.hub import Hub
    hub = Hub({"run": RUN, "mode": "sharded", "world_size": RANKS, "simulated": True, "steps": 1_000_000,
               "layers": [f"blocks.{i}" for i in range(LAYERS)],
               "capabilities": ["pause", "resume", "stop", "checkpoint", "set-policy", "set-placement"]})
    hub.start()
    hub.update_state(step=0, steps=1_000_000, paused=False)
    step, stop = 0, threading.Event()

    def answer() -> None:
        while not stop.is_set():
            for command in hub.take_commands():
                print(json.dumps({"t": time.monotonic(), "name": command["name"]}), flush=True)
                hub.reply(command, "applied", step=step)
            time.sleep(0.001)
    threading.Thread(target=answer, daemon=True).start()
    end = time.monotonic() + seconds
    due = time.monotonic()
    while due < end:
        step += 1
        hub.publish(synthetic_step(step))
        due = max(due + 1 / HZ, time.monotonic())   # late: no burst to catch up, the rate stays HZ
        time.sleep(max(0.0, due - time.monotonic()))
    stop.set()
    hub.close("bench finished")


async def drive(measure_s: float, presses: int) -> dict:
    import psutil

    from console.app import ConsoleApp
    from console.client import SocketSource
    app = ConsoleApp(SocketSource(RUN))
    me = psutil.Process()

    def lag_s() -> float:   # how far the console is behind the feed
        return time.time() - (app.state.last_step or {}).get("time", 0.0)
    async with app.run_test(size=(200, 60)) as pilot:
        deadline = time.monotonic() + 60
        while lag_s() > 0.3 and time.monotonic() < deadline:   # start-up is not the steady state
            await pilot.pause(0.1)
        await pilot.pause(1.0)
        cpu0, wall0, step0, lags = me.cpu_times(), time.monotonic(), app.state.step, []
        while time.monotonic() < wall0 + measure_s:
            await pilot.pause(0.25)
            lags.append(lag_s())
        cpu1, wall1, step1 = me.cpu_times(), time.monotonic(), app.state.step
        pressed = []
        for _ in range(presses):
            pressed.append(time.monotonic())
            await pilot.press("p")
            await pilot.pause(0.3)
        used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        return {"cpu_percent": 100 * used / (wall1 - wall0), "measured_s": wall1 - wall0,
                "steps_per_s": (step1 - step0) / (wall1 - wall0), "lag_ms_max": 1000 * max(lags),
                "pressed": pressed}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench console")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the CPU is measured")
    parser.add_argument("--presses", type=int, default=20)
    parser.add_argument("--feed", type=float, help=argparse.SUPPRESS)   # the child's mode
    args = parser.parse_args(argv)
    if args.feed:
        feed(args.feed)
        return 0
    runtime = tempfile.mkdtemp(prefix="tyb", dir="/tmp")
    os.environ["TRAINYARD_RUNTIME_DIR"] = runtime
    child = subprocess.Popen([sys.executable, "-m", "console.bench", "--feed", str(args.seconds + 60)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        from engine import protocol
        deadline = time.monotonic() + 30
        while not any(r["name"] == RUN for r in protocol.list_runs()):
            if time.monotonic() > deadline or child.poll() is not None:
                print("the feeding hub did not start", file=sys.stderr)
                return 1
            time.sleep(0.1)
        result = asyncio.run(drive(args.seconds, args.presses))
    finally:
        child.kill()
        out, _ = child.communicate(timeout=30)
        shutil.rmtree(runtime, ignore_errors=True)
    arrived = [json.loads(line)["t"] for line in out.splitlines() if line.startswith("{")]
    delays = [1000 * (t - p) for p, t in zip(result.pop("pressed"), arrived)]
    figures = {"bench": "console", "ranks": RANKS, "layers": LAYERS, "updates_per_s": HZ,
               "cpu_percent_of_one_core": round(result["cpu_percent"], 1),
               "measured_s": round(result["measured_s"], 1),
               "steps_per_s_shown": round(result["steps_per_s"], 1), "lag_ms_max": round(result["lag_ms_max"]),
               "presses": args.presses, "commands_arrived": len(arrived),
               "key_to_hub_ms_median": round(statistics.median(delays), 1) if delays else None,
               "key_to_hub_ms_max": round(max(delays), 1) if delays else None,
               "cpu_goal_percent": CPU_GOAL_PERCENT, "delay_goal_ms": DELAY_GOAL_MS}
    figures["meets_goals"] = bool(delays) and len(arrived) == args.presses and \
        figures["cpu_percent_of_one_core"] < CPU_GOAL_PERCENT and figures["key_to_hub_ms_max"] < DELAY_GOAL_MS
    if args.json:
        print(json.dumps(figures))
    else:
        from rich.console import Console
        from rich.table import Table
        table = Table("figure", "value", "goal", title=f"console: {RANKS} ranks, {LAYERS} layers, {HZ} updates/s")
        table.add_row("console CPU, % of one core", f"{figures['cpu_percent_of_one_core']:.1f}",
                      f"< {CPU_GOAL_PERCENT:g}")
        table.add_row("steps shown per second", f"{figures['steps_per_s_shown']:.1f}", f"{HZ}")
        table.add_row("console behind the feed, max ms", str(figures["lag_ms_max"]), "")
        table.add_row("key -> hub, median ms", str(figures["key_to_hub_ms_median"]), "")
        table.add_row("key -> hub, max ms", str(figures["key_to_hub_ms_max"]), f"< {DELAY_GOAL_MS:g}")
        table.add_row("commands arrived", f"{len(arrived)}/{args.presses}", "all")
        Console().print(table)
    return 0   # the figures are the result; meets_goals says whether they reach the goals


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
