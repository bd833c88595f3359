"""`trainyard bench telemetry`: does watching a run slow it down? And how big is its telemetry?

The same digits DDP run (2 workers) trains with no console, with 1 and with 10
attached, in rounds (none, 1, 10, none, 1, 10, ...) so that drift of the machine
hits every variant alike. Consoles are threads of this process that read every
message, as the Textual console does. Throughput is measured from the telemetry
log over the steps after every console is attached; the figure is each variant's
median throughput over the rounds, divided by the median with no console. Every
variant is timed past the same warm-up (WARMUP_STEPS).

`--bytes` measures size instead: real digits DDP runs at `--world` ranks (default 8 and 16) with one
console attached counting what it receives, and a synthetic 64-rank, 200-layer GPU feed
(console/bench.py's, written through the engine's own RankRows and TelemetryLog): the log's bytes per
step and per 1000 steps, a full-rows record beside a columns one, and the live feed's bytes per message.

    trainyard bench telemetry --bytes [--world 8 16] [--steps 300] [--json]

`--record` measures rank 0's work on a step's figures instead: the step boundary's table of 1, 8 and 64 GPU
ranks (the synthetic feed's rows), read as the step loop reads it (engine/runtime/control.py RankFigures: the
figures the record needs, a column at a time) against every rank's full row first, as it did before (the
`per_rank` columns, the peaks and the slowest rank's step then made of the rows): microseconds a step, warm, the
best of 5 x 300 calls, the two in turns.

    trainyard bench telemetry --record [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.processes.children import ChildRuns

DEMO = Path(__file__).resolve().parents[2] / "demo" / "configs" / "digits_ddp.toml"
GOAL = 0.97
LOG_GOAL_BYTES = 4096      # the log's bytes per step, averaged, at 64 ranks
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


def start_run(runs: ChildRuns, name: str, steps: int, work: Path, runtime: Path, log: Path,
              *overrides: str) -> subprocess.Popen:
    """The digits DDP run, headless, in a session of its own (owned by `runs`), its hub in `runtime`."""
    env = {**os.environ, "TRAINYARD_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "engine.cli", "run", str(DEMO), "--headless", "--steps", str(steps),
           "--set", f"run.dir={work}", "--set", f"run.name={name}", "--set", "run.eval_every=0",
           "--set", "checkpoint.every=0", *(a for o in overrides for a in ("--set", o)), "--telemetry-log", str(log)]
    return runs.start(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_hub(proc: subprocess.Popen, name: str, runtime: Path) -> None:
    from engine.telemetry import protocol
    os.environ["TRAINYARD_RUNTIME_DIR"] = str(runtime)
    while not any(r["name"] == name for r in protocol.list_runs()):
        if proc.poll() is not None:
            raise RuntimeError(f"benchmark run failed: {proc.stderr.read()}")
        time.sleep(0.05)


def measure(runs: ChildRuns, clients: int, steps: int, warmup: int, work: Path, runtime: Path, index: int) -> dict:
    """One run; samples/s over the steps after every client is attached."""
    name = f"bench{index}"
    log = work / f"{name}.jsonl"
    proc = start_run(runs, name, steps, work, runtime, log)
    stop, threads, counts = threading.Event(), [], [[0] for _ in range(clients)]
    try:
        wait_for_hub(proc, name, runtime)
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
        runs.stop(proc)
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


def _counter(target: str, stop: threading.Event, got: dict, ready: threading.Event) -> None:
    """A console's share of the feed: step messages and their bytes on the wire."""
    from engine.telemetry import protocol
    with protocol.connect(target, client="bench", read_only=True) as conn:
        ready.set()
        while not stop.is_set():
            try:
                msg = conn.read(timeout=0.5)
            except TimeoutError:
                continue
            except EOFError:
                return
            if msg.get("type") == "step":
                got["messages"] += 1
                got["bytes"] += len(protocol.encode(msg))


def log_sizes(records: list[dict]) -> dict:
    """Bytes of the step records as written: on average, per 1000 steps, a full-rows one, a columns one."""
    steps = [r for r in records if r.get("type") == "step"]
    size = [len(json.dumps(r, separators=(",", ":"))) + 1 for r in steps]
    full = [n for r, n in zip(steps, size) if "ranks" in r]
    columns = [n for r, n in zip(steps, size) if "per_rank" in r and "layers" not in r]
    return {"steps": len(steps), "log_bytes_per_step": round(statistics.mean(size)),
            "log_mb_per_1000_steps": round(sum(size) / len(size) * 1000 / 2**20, 3),
            "full_rows_record_bytes": round(statistics.median(full)) if full else None,
            "columns_record_bytes": round(statistics.median(columns)) if columns else None,
            "full_rows_records": len(full)}


def measure_bytes(runs: ChildRuns, world: int, steps: int, work: Path, runtime: Path) -> dict:
    """A real digits DDP run at `world` ranks, one console attached: its log and its live feed."""
    from engine.telemetry.log import read_raw
    name = f"bytes{world}"
    log = work / f"{name}.jsonl"
    proc = start_run(runs, name, steps, work, runtime, log, f"parallel.world_size={world}",
                     f"data.batch_size={32 * world}", "parallel.collective_timeout_s=300")
    stop, ready, got = threading.Event(), threading.Event(), {"messages": 0, "bytes": 0}
    thread = None
    try:
        wait_for_hub(proc, name, runtime)
        thread = threading.Thread(target=_counter, args=(name, stop, got, ready), daemon=True)
        thread.start()
        ready.wait(timeout=30)
        proc.wait(timeout=900)
    finally:
        stop.set()
        runs.stop(proc)
        if thread is not None:
            thread.join(timeout=5)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run exited {proc.returncode}: {proc.stderr.read()}")
    records = read_raw(log)
    steps_written = [r for r in records if r.get("type") == "step"]
    wall = max(steps_written[-1]["time"] - steps_written[0]["time"], 1e-9)
    return {"source": f"ddp x{world} (CPU)", "ranks": world, "layers": len(records[0]["layers"]),
            **log_sizes(records), "steps_per_s": round(len(steps_written) / wall, 1),
            "live_messages": got["messages"],
            "live_bytes_per_message": round(got["bytes"] / got["messages"]) if got["messages"] else None,
            "live_kb_per_s": round(got["bytes"] / wall / 1024, 1)}


def synthetic_bytes(ranks: int, layers: int, steps: int, layer_every: int, rank_every: int, work: Path) -> dict:
    """The synthetic GPU feed through the engine's RankRows and TelemetryLog: what such a run would write."""
    from console.bench import synthetic_step
    from engine.protocol import encode
    from engine.telemetry.log import TelemetryLog, read_raw
    from engine.telemetry.outlets import RankRows
    path = work / f"synthetic{ranks}.jsonl"
    log, rows, live = TelemetryLog(path), RankRows(rank_every), []
    for step in range(1, steps + 1):
        record, full = rows.shape(synthetic_step(step, ranks, layers, outlier=41 if ranks > 41 else None,
                                                 with_layers=step % layer_every == 0 or step == 1))
        stamped = log.stamp({"type": "step", **record})
        live.append(len(encode(stamped)))
        log.write(rows.for_log(stamped), stamped=True)
    log.close()
    return {"source": f"synthetic {ranks} GPUs", "about": f"{ranks} ranks on {ranks // 8} hosts, {layers} "
                      f"layers timed every {layer_every} steps, full rank rows every {rank_every}", "ranks": ranks, "layers": layers, **log_sizes(read_raw(path)),
            "live_messages": steps, "live_bytes_per_message": round(statistics.mean(live)),
            "live_kb_per_s": round(statistics.mean(live) * 10 / 1024, 1), "steps_per_s": 10.0}


def record_cost(ranks: int, calls: int = 300) -> dict:
    """Rank 0's work on one step's figures from a table of `ranks` GPU ranks (see the module's `--record`)."""
    import timeit
    from console.bench import synthetic_step
    from engine.runtime.control import Peaks, RankFigures, Table, rank_rows, row_values
    from engine.strategies.specs.figures import PANEL_COLUMNS
    from engine.telemetry.records import figure_column, rank_columns
    rows = synthetic_step(5, ranks, 1, outlier=ranks // 2 if ranks > 1 else None)["ranks"]
    table = Table([row_values({name: float(v) for name, v in row.items() if name != "rank"}) for row in rows])
    peaks = Peaks(ranks)

    def full_rows():   # before: every rank's row, then the columns and the peaks made of them
        every = rank_rows(table)
        max(entry["step_ms"] for entry in every)
        peaks.note(every)
        any(entry.get("over_capacity") for entry in every)
        rank_columns(every, PANEL_COLUMNS)

    def columns():   # the step loop's (engine/run/report.py, engine/runtime/run_core.py)
        figures = RankFigures(table)
        figures.row(0)
        max(figures.column("step_ms"))
        peaks.note(figures)
        any(figure_column(figures, "over_capacity"))
        rank_columns(figures, PANEL_COLUMNS)

    if rank_columns(RankFigures(table), PANEL_COLUMNS) != rank_columns(rank_rows(table), PANEL_COLUMNS):
        raise RuntimeError("the columns read from the table differ from those made of the full rows")
    times: dict[str, list[float]] = {"full_rows_us": [], "columns_us": []}
    for _ in range(5):   # in turns, as the machine's speed moves
        for name, f in (("full_rows_us", full_rows), ("columns_us", columns)):
            times[name].append(timeit.timeit(f, number=calls))
    best = {name: min(values) / calls * 1e6 for name, values in times.items()}
    return {"ranks": ranks, **{name: round(us, 1) for name, us in best.items()},
            "ratio": round(best["columns_us"] / best["full_rows_us"], 3)}


def main_record(args) -> int:
    rows = [record_cost(ranks) for ranks in (1, 8, 64)]
    if args.json:
        print(json.dumps({"bench": "telemetry-record", "runs": rows}))
        return 0
    table = Table(title="bench telemetry --record: rank 0's work on a step's figures, microseconds a step")
    for col in ("ranks", "every rank's full row", "the columns a step reads", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["ranks"]), f"{r['full_rows_us']:,.1f}", f"{r['columns_us']:,.1f}", f"{r['ratio']:.3f}")
    Console().print(table)
    Console().print("the synthetic feed's GPU rows; warm, the best of 5 x 300 calls")
    return 0


def _folders(runs: ChildRuns) -> tuple[Path, Path]:
    """The runs' folder, in the temp dir, and their hubs' own runtime folder inside ours (a short path for
    the sockets, and no other run listed there); both removed when `runs` ends."""
    from engine.telemetry import protocol
    return runs.temp_dir("trainyard-bench-telemetry-"), runs.temp_dir("bench-", dir=protocol.runtime_dir())


def main_bytes(args) -> int:
    with ChildRuns() as runs:
        work, runtime = _folders(runs)
        rows = [measure_bytes(runs, world, args.steps, work, runtime) for world in args.world]
        rows.append(synthetic_bytes(64, 200, 1000, 10, 100, work))
    report = {"bench": "telemetry-bytes", "goal_log_bytes_per_step_64_ranks": LOG_GOAL_BYTES, "runs": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title="bench telemetry --bytes: the log and the live feed per step")
    for col in ("source", "log B/step", "log MB/1000 steps", "full rows record B", "columns record B",
                "live B/message", "live KB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["source"], f"{r['log_bytes_per_step']:,}", f"{r['log_mb_per_1000_steps']:.2f}",
                      f"{r['full_rows_record_bytes'] or 0:,}", f"{r['columns_record_bytes'] or 0:,}",
                      f"{r['live_bytes_per_message'] or 0:,}", f"{r['live_kb_per_s']:.1f} ({r['steps_per_s']:g} steps/s)")
    Console().print(table)
    Console().print(f"ddp: digits on CPU ranks, telemetry defaults; synthetic: {rows[-1]['about']}")
    Console().print(f"goal: log <= {LOG_GOAL_BYTES:,} B per step averaged at 64 ranks "
                    f"({'met' if rows[-1]['log_bytes_per_step'] <= LOG_GOAL_BYTES else 'missed'})")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench telemetry")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (0, 1, 10 clients)")
    parser.add_argument("--steps", type=int, default=3000, help="steps per run")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps not timed at the start")
    parser.add_argument("--bytes", action="store_true", help="measure the telemetry's size instead (see above)")
    parser.add_argument("--world", type=int, nargs="+", default=[8, 16], help="--bytes: the real runs' ranks")
    parser.add_argument("--record", action="store_true",
                        help="measure rank 0's work on a step's figures at 1, 8 and 64 ranks instead (see above)")
    args = parser.parse_args(argv)
    if args.record:
        return main_record(args)
    if args.bytes:
        if "--steps" not in argv:
            args.steps = 300
        return main_bytes(args)
    variants = (0, 1, 10)
    results: dict[int, list[dict]] = {n: [] for n in variants}
    with ChildRuns() as runs:   # a killed bench leaves no run training and no folder behind
        work, runtime = _folders(runs)
        index = 0
        for _ in range(args.rounds):
            for n in variants:
                results[n].append(measure(runs, n, args.steps, args.warmup, work, runtime, index))
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
