"""`trainyard bench telemetry`: does watching a run slow it down?

The same digits DDP run (2 workers) trains with no console, with 1 and with 10
attached, in rounds (none, 1, 10, none, 1, 10, ...) so that drift of the machine
hits every variant alike. Consoles are threads of this process that read every
message, as the Textual console does. Throughput is measured from the telemetry
log over the steps after every console is attached; the figure is each variant's
median throughput over the rounds, divided by the median with no console. Every
variant is timed past the same warm-up (WARMUP_STEPS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

DEMO = Path(__file__).resolve().parents[2] / "demo" / "configs" / "digits_ddp.toml"
GOAL = 0.97
WARMUP_STEPS = 300


def _reader(target: str, stop: threading.Event, counts: list, ready: threading.Barrier) -> None:
    from engine.telemetry import protocol
    with protocol.connect(target, client="bench", read_only=True) as conn:
        ready.wait()
        while not stop.is_set():
            try:
                conn.read(timeout=0.5)
                counts[0] += 1
            except TimeoutError:
                continue
            except EOFError:
                return


def measure(clients: int, steps: int, warmup: int, work: Path, runtime: Path, index: int) -> dict:
    """One run; samples/s over the steps after every client is attached."""
    from engine.telemetry import protocol
    name = f"bench{index}"
    log = work / f"{name}.jsonl"
    env = {**os.environ, "TRAINYARD_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engine.cli", "run", str(DEMO), "--headless", "--steps", str(steps),
           "--set", f"run.dir={work}", "--set", f"run.name={name}", "--set", "run.eval_every=0",
           "--set", "checkpoint.every=0", "--telemetry-log", str(log)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stop, threads, counts = threading.Event(), [], [[0] for _ in range(clients)]
    try:
        os.environ["TRAINYARD_RUNTIME_DIR"] = str(runtime)
        while not any(r["name"] == name for r in protocol.list_runs()):
            if proc.poll() is not None:
                raise RuntimeError(f"benchmark run failed: {proc.stderr.read()}")
            time.sleep(0.05)
        ready = threading.Barrier(clients + 1)
        for i in range(clients):
            t = threading.Thread(target=_reader, args=(name, stop, counts[i], ready), daemon=True)
            t.start()
            threads.append(t)
        if clients:
            ready.wait(timeout=30)
        attached_at = time.time()
        proc.wait(timeout=600)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for t in threads:
        t.join(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run exited {proc.returncode}: {proc.stderr.read()}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # the same window for every variant: past the warm-up, and after the consoles attached
    timed = [r for r in records if r["type"] == "step" and r["step"] > warmup and r["time"] >= attached_at + 0.5]
    if len(timed) < 20:
        raise RuntimeError("too few steps after the consoles attached; raise --steps")
    first, last = timed[0], timed[-1]
    batch = records[0]["config"]["data"]["batch_size"]
    return {"samples_per_s": (last["step"] - first["step"]) * batch / (last["time"] - first["time"]),
            "steps_timed": last["step"] - first["step"], "messages_per_client": [c[0] for c in counts]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench telemetry")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (0, 1, 10 clients)")
    parser.add_argument("--steps", type=int, default=3000, help="steps per run")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps not timed at the start")
    args = parser.parse_args(argv)
    variants = (0, 1, 10)
    results: dict[int, list[dict]] = {n: [] for n in variants}
    with tempfile.TemporaryDirectory(prefix="tyb", dir="/tmp") as tmp:
        work, runtime = Path(tmp) / "runs", Path(tmp) / "rt"
        runtime.mkdir(mode=0o700)
        index = 0
        for _ in range(args.rounds):
            for n in variants:
                results[n].append(measure(n, args.steps, args.warmup, work, runtime, index))
                index += 1
    median = {n: statistics.median(r["samples_per_s"] for r in results[n]) for n in variants}
    spread = {n: (min(r["samples_per_s"] for r in results[n]) / median[0],
                  max(r["samples_per_s"] for r in results[n]) / median[0]) for n in variants}
    report = {"bench": "telemetry", "rounds": args.rounds, "steps": args.steps, "world_size": 2,
              "device": "cpu (simulated)", "goal_ratio_10_clients": GOAL,
              "samples_per_s": {str(n): [round(r["samples_per_s"], 1) for r in results[n]] for n in variants},
              "median_samples_per_s": {str(n): round(median[n], 1) for n in variants},
              "ratio_to_no_client": {str(n): round(median[n] / median[0], 4) for n in variants},
              "ratio_range": {str(n): [round(v, 4) for v in spread[n]] for n in variants},
              "messages_per_client": {str(n): [r["messages_per_client"] for r in results[n]] for n in variants}}
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title="bench telemetry: digits DDP, 2 workers (CPU, simulated devices)")
    for col in ("consoles", "samples/s (median)", "each round", "ratio to none", "rounds' range"):
        table.add_column(col, justify="right")
    for n in variants:
        table.add_row(str(n), f"{median[n]:,.0f}", ", ".join(f"{r['samples_per_s']:,.0f}" for r in results[n]),
                      f"{median[n] / median[0]:.3f}", f"{spread[n][0]:.2f} to {spread[n][1]:.2f}")
    console = Console()
    console.print(table)
    ok = median[10] / median[0] >= GOAL
    console.print(f"10 consoles: {median[10] / median[0]:.3f} of the throughput with none "
                  f"(goal >= {GOAL}: {'met' if ok else 'missed'})")
    return 0
