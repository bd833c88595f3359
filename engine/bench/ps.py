"""`trainyard bench ps`: a parameter server's sync modes on a cluster with one slow worker.

Digits, 2 servers and 4 workers, worker rank 5 three times slower (emulated: it sleeps
twice each layer's forward and backward time after it). One run per mode, one after
another in this invocation, each for the same wall time after its first step:

    bsp    every layer waits for every worker (synchronous data parallel)
    asp    every gradient applied on arrival, staleness-scaled
    ssp    on arrival, no worker more than 2 iterations ahead of the slowest
    soft   per-layer windows from the profile (engine/techniques/ps_sync.py)

The run evaluates the test split every few steps; the figures are each mode's time from
its first step to 0.90 test accuracy, its accuracy when the wall time is up, its steps,
and the ratios to bsp. A run is ended by the `stop` command through its socket, as an
operator would.

    trainyard bench ps [--json] [--seconds 30] [--modes bsp,asp,ssp,soft] [--slow 3.0]

`--repeat N` asks instead how much a mode's result depends on luck: N runs per mode of `--steps` steps
each (300 by default), seeds 0 to N-1, the same seeds in every mode, each run to its end; the figures are
each run's final test accuracy and the distribution per mode (worst, 10th percentile, median, best), with
what the servers' tally says of each run: updates per step, mean and largest staleness, and how many
full steps' worth of gradient were applied per step (docs/param_server.md).

    trainyard bench ps --repeat 30 --servers 1 --modes soft,bsp,asp [--set optim.lr_schedule=cosine ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.processes.children import ChildRuns

MODES = ("bsp", "asp", "ssp", "soft")
TARGET = 0.90
CONFIG = Path(__file__).resolve().parents[2] / "demo" / "configs" / "digits_ps.toml"


def _records(path: Path) -> list[dict]:
    """The log's records so far, each step's workers, layers and ranks filled in (between full steps they go
    as columns: docs/telemetry.md)."""
    from engine.telemetry.log import fill_ranks
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass   # a line still being written
    return fill_ranks(out)


def _start(runs: ChildRuns, name: str, log: Path, workdir: Path, settings: list[str]) -> subprocess.Popen:
    """`trainyard run` of the bench's config as `name`, logging to `log`, with no checkpoints and `settings`
    (KEY=VALUE) set, owned by `runs`."""
    cmd = [sys.executable, "-m", "engine.cli", "run", str(CONFIG), "--headless", "--telemetry-log", str(log)]
    for setting in [f"run.dir={workdir / 'runs'}", f"run.name={name}", "checkpoint.every=0", *settings]:
        cmd += ["--set", setting]
    return runs.start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finished(proc: subprocess.Popen, err: str, log: Path, what: str) -> list[dict]:
    """The log's records of a run that ended well (its summary last), or RuntimeError saying why not."""
    records = _records(log)
    if proc.returncode != 0 or not records or records[-1].get("type") != "summary":
        raise RuntimeError(f"bench ps: the {what} failed (exit {proc.returncode}): {err.strip()[-600:]}")
    return records


def run_mode(runs: ChildRuns, mode: str, seconds: float, slow: float, eval_every: int, workdir: Path,
             extra: list[str]) -> dict:
    """One run in `mode` for `seconds` after its first step; what its log says."""
    from engine.telemetry import protocol
    name = f"bench-ps-{mode}-{os.getpid()}"
    log = workdir / f"{mode}.jsonl"
    proc = _start(runs, name, log, workdir, ["run.steps=1000000", f"run.eval_every={eval_every}",
                                             f"parallel.param_server.sync={mode}", f"parallel.param_server.slow_workers={{5 = {slow}}}", *extra])
    try:
        first = None
        deadline = time.monotonic() + 120 + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [r for r in _records(log) if r.get("type") == "step"]
            if steps and first is None:
                first = time.monotonic() - (time.time() - steps[0]["time"])
            if first is not None and time.monotonic() - first >= seconds:
                with protocol.connect(name, client="bench ps") as conn:
                    conn.command("stop")
                break
            time.sleep(0.2)
        _, err = proc.communicate(timeout=120)
    finally:
        runs.stop(proc)
    records = _finished(proc, err, log, f"{mode} run")
    steps = [r for r in records if r.get("type") == "step"]
    t0 = steps[0]["time"]
    evals = [(r["time"] - t0, r["test_accuracy"]) for r in records if r.get("kind") == "eval"]
    reached = next((t for t, acc in evals if acc >= TARGET), None)
    last = steps[-1]
    return {"mode": mode, "time_to_target_s": round(reached, 3) if reached is not None else None,
            "final_accuracy": records[-1]["test_accuracy"], "steps": records[-1]["steps"],
            "trained_s": round(last["time"] - t0, 3), "evals": [(round(t, 3), round(a, 4)) for t, a in evals],
            "iterations": {w["rank"]: w["iterations"] for w in last["ps"]["workers"]},
            "window_workers": {layer["name"]: layer["window_workers"] for layer in last["ps"]["layers"]},
            "mean_staleness": {layer["name"]: layer["mean_staleness"] for layer in last["ps"]["layers"]}}


def run_seed(runs: ChildRuns, mode: str, seed: int, steps: int, servers: int, slow: float, workdir: Path,
             extra: list[str]) -> dict:
    """One run in `mode` with `seed`, `steps` steps to its end: its final accuracy and the servers' tally."""
    sync, _, unit = mode.partition(":")   # soft:versions -- a mode with parallel.param_server.staleness_unit set
    name = f"bench-ps-{sync}-{unit or 'default'}-{seed}-{os.getpid()}"
    log = workdir / f"{sync}-{unit}-{seed}.jsonl"
    slow_rank = servers + 3   # the last of the 4 workers
    proc = _start(runs, name, log, workdir, [
        f"run.steps={steps}", f"run.seed={seed}", f"run.eval_every={steps}", f"parallel.param_server.sync={sync}",
        f"parallel.param_server.servers={servers}", f"parallel.world_size={servers + 4}",
        f"parallel.param_server.slow_workers={{{slow_rank} = {slow}}}", *([f"parallel.param_server.staleness_unit={unit}"] if unit else []),
        *extra])
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        runs.stop(proc)
    records = _finished(proc, err, log, f"{mode} run with seed {seed}")
    log.unlink()
    last = [r for r in records if r.get("type") == "step"][-1]
    layers = last["ps"]["layers"]
    done = max(last["step"], 1)
    grads = sum(layer.get("gradients", 0) for layer in layers)
    return {"seed": seed, "final_accuracy": records[-1]["test_accuracy"], "steps": records[-1]["steps"],
            "updates_per_step": round(sum(layer.get("windows", 0) for layer in layers) / len(layers) / done, 3),
            "mean_staleness": round(sum(layer.get("staleness_sum", 0) for layer in layers) / grads, 3) if grads else 0.0,
            "max_staleness": max((layer.get("staleness_max", 0) for layer in layers), default=0),
            "applied_per_step": round(sum(layer.get("applied", 0.0) for layer in layers) / len(layers) / done, 4)}


def distribution(values: list[float]) -> dict:
    """Worst, 10th percentile, median and best of `values` (nearest rank)."""
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
    return {"worst": ordered[0], "p10": at(0.1), "median": median, "best": ordered[-1]}


def measure_repeat(modes, repeat: int, steps: int, servers: int, slow: float, hidden: int, batch: int,
                   settings: tuple[str, ...] = ()) -> dict:
    extra = [f"model.hidden={hidden}", f"data.batch_size={batch}", *settings]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with ChildRuns() as runs:
        work = runs.temp_dir("trainyard-bench-ps-")
        for seed in range(repeat):   # seed by seed, every mode: drift on the machine hits the modes alike
            for mode in modes:
                results[mode].append(run_seed(runs, mode, seed, steps, servers, slow, work, extra))
    summary = {mode: {key: distribution([run[key] for run in rows])
                      for key in ("final_accuracy", "updates_per_step", "mean_staleness", "applied_per_step")}
               for mode, rows in results.items()}
    return {"servers": servers, "workers": 4, "slow_worker": {"rank": servers + 3, "factor": slow}, "steps": steps,
            "hidden": hidden, "batch_size": batch, "repeat": repeat, "seeds": list(range(repeat)), "set": list(settings),
            "modes": summary, "runs": results}


def print_repeat(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"bench ps --repeat {out['repeat']}: digits, {out['servers']} server(s), 4 workers, worker "
                        f"{out['slow_worker']['rank']} {out['slow_worker']['factor']:g}x slower (emulated), "
                        f"{out['steps']} steps, seeds 0-{out['repeat'] - 1}"
                        f"{''.join(', ' + s for s in out.get('set', []))}; CPU ledger (simulated devices)")
    for col in ("mode", "worst", "p10", "median", "best", "updates/step", "staleness", "applied/step"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for mode, row in out["modes"].items():
        acc = row["final_accuracy"]
        table.add_row(mode, *(f"{acc[k]:.4f}" for k in ("worst", "p10", "median", "best")),
                      *(f"{row[k]['median']:g} ({row[k]['worst']:g}-{row[k]['best']:g})"
                        for k in ("updates_per_step", "mean_staleness", "applied_per_step")))
    Console(width=max(Console().width, 130)).print(table)
    worst = Table(title="each mode's three worst runs: seed, accuracy, applied/step, mean staleness")
    for mode in out["modes"]:
        worst.add_column(mode, no_wrap=True)
    lows = {mode: sorted(runs, key=lambda r: r["final_accuracy"])[:3] for mode, runs in out["runs"].items()}
    for i in range(min(3, out["repeat"])):
        worst.add_row(*(f"{r[i]['seed']}: {r[i]['final_accuracy']:.4f}, {r[i]['applied_per_step']:g}, "
                        f"{r[i]['mean_staleness']:g}" for r in lows.values()))
    Console(width=max(Console().width, 130)).print(worst)


def measure(modes, seconds: float, slow: float, eval_every: int, hidden: int, batch: int) -> dict:
    extra = [f"model.hidden={hidden}", f"data.batch_size={batch}"]
    with ChildRuns() as runs:   # a killed bench leaves no run training and no folder behind
        work = runs.temp_dir("trainyard-bench-ps-")
        results = {mode: run_mode(runs, mode, seconds, slow, eval_every, work, extra) for mode in modes}
    bsp = results.get("bsp")
    for row in results.values():
        row["time_vs_bsp"] = (round(row["time_to_target_s"] / bsp["time_to_target_s"], 3)
                              if bsp and bsp["time_to_target_s"] and row["time_to_target_s"] is not None else None)
        row["accuracy_minus_bsp"] = round(row["final_accuracy"] - bsp["final_accuracy"], 4) if bsp else None
    return {"servers": 2, "workers": 4, "slow_worker": {"rank": 5, "factor": slow}, "seconds": seconds,
            "hidden": hidden, "batch_size": batch,
            "target_accuracy": TARGET, "modes": results}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench ps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--seconds", type=float, default=30.0, help="training wall time per mode (default 30)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes (default: all four); with --repeat, soft:rounds or "
                             "soft:versions also sets parallel.param_server.staleness_unit")
    parser.add_argument("--slow", type=float, default=3.0, help="worker rank 5's slow-down factor (default 3)")
    parser.add_argument("--eval-every", type=int, default=5, help="steps between test evaluations (default 5)")
    parser.add_argument("--hidden", type=int, default=128, help="the MLP's hidden width (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="the global batch, split over 4 workers (default 64)")
    parser.add_argument("--repeat", type=int, default=0,
                        help="N runs per mode to their end, seeds 0 to N-1: each mode's accuracy distribution "
                             "(default 0: one run per mode for --seconds)")
    parser.add_argument("--steps", type=int, default=300, help="with --repeat: steps per run (default 300)")
    parser.add_argument("--servers", type=int, default=2,
                        help="with --repeat: parameter servers (default 2); the slow worker is the last rank")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --repeat: a config setting for every run, as `trainyard run --set` takes it "
                             "(e.g. optim.lr_schedule=cosine); repeatable")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    units = ("", "versions", "rounds") if args.repeat else ("",)
    bad = [m for m in modes if m.partition(":")[0] not in MODES or m.partition(":")[2] not in units]
    if bad or not modes:
        parser.error(f"--modes: {', '.join(bad) or 'none given'}; choose from {', '.join(MODES)} (with --repeat, "
                     f"MODE:versions or MODE:rounds sets parallel.param_server.staleness_unit)")
    if args.seconds <= 0 or args.slow < 1 or args.eval_every < 1 or args.hidden < 1 or args.batch % 4:
        parser.error("--seconds must be positive, --slow at least 1, --eval-every and --hidden at least 1, "
                     "--batch a multiple of 4")
    if args.repeat < 0 or args.steps < 1 or not 1 <= args.servers <= 3:
        parser.error("--repeat must be at least 0, --steps at least 1, --servers 1 to 3 (the model's 3 layers)")
    if args.set and not args.repeat:
        parser.error("--set goes with --repeat")
    if args.repeat:
        out = measure_repeat(modes, args.repeat, args.steps, args.servers, args.slow, args.hidden, args.batch,
                             tuple(args.set))
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print_repeat(out)
        return 0
    out = measure(modes, args.seconds, args.slow, args.eval_every, args.hidden, args.batch)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"bench ps: digits, 2 servers, 4 workers, worker 5 {args.slow:g}x slower (emulated), "
                        f"{args.seconds:g} s per mode; CPU ledger (simulated devices)")
    for col in ("mode", f"to {TARGET:.2f}", "x bsp", f"acc at {args.seconds:g}s", "vs bsp", "steps",
                "iterations per worker", "window workers", "staleness"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for mode, row in out["modes"].items():
        reached = f"{row['time_to_target_s']:.1f} s" if row["time_to_target_s"] is not None else "not reached"
        table.add_row(mode, reached, f"{row['time_vs_bsp']:.2f}" if row["time_vs_bsp"] is not None else "-",
                      f"{row['final_accuracy']:.4f}",
                      f"{row['accuracy_minus_bsp']:+.4f}" if row["accuracy_minus_bsp"] is not None else "-",
                      str(row["steps"]), "/".join(str(n) for n in row["iterations"].values()),
                      "/".join(str(n) for n in row["window_workers"].values()),
                      "/".join(f"{x:g}" for x in row["mean_staleness"].values()))
    Console(width=max(Console().width, 130)).print(table)
    return 0
