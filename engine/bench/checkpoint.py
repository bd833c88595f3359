"""`trainyard bench checkpoint`: how long a checkpoint takes to write and to load, and what a resume holds.

Three runs of an MLP of about `--params` parameters (AdamW: its two moments per parameter) on the CPU:

    write    `--write-world` ranks of `--strategy`, a checkpoint after every step (the checkpoint events'
             write_ms: rank 0's time from its start to the published folder, every rank's file in it)
    fresh    `--read-world` ranks, no checkpoint to resume: each rank's peak RSS (VmHWM) when its first
             step is logged (the model built, one step) and at its end (training)
    resumed  `--read-world` ranks of `--read-strategy` resumed from the write run's last checkpoint: the resume
             event's load_ms (the slowest rank's), each rank's peak RSS when the resume event is logged (the
             load) and when its first step is, and how much later than the fresh run's its first step came
             (the launcher's checksums and the load)

The resumed ranks' peak minus the fresh ones' is what loading held beyond training's start; the goal
(docs/checkpoints.md) is no more than one layer in flight. `--root DIR` runs another checkout of trainyard
(an earlier version, which resumes only at the shape that wrote it) with the same figures, side by side.

    trainyard bench checkpoint [--params 100M] [--write-world 4] [--read-world 2] [--strategy ddp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine.processes.children import ChildRuns

ROOT = Path(__file__).resolve().parents[2]
DEPTH = 7   # fc0 .. fc6 and the head: six hidden x hidden layers hold nearly all the parameters


def hidden_for(params: float) -> int:
    """The MLP width whose DEPTH - 1 square layers hold about `params` parameters (a multiple of 64)."""
    return max(64, round((params / (DEPTH - 1)) ** 0.5 / 64) * 64)


def _hwm(pid: int) -> int | None:
    """A process's peak resident memory so far (VmHWM, bytes), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else None


class Peaks(threading.Thread):
    """Every rank's VmHWM, read every 20 ms from its pid file's process: the value when the resume event is
    logged (the load done), when the run's first step is, and the last one before the rank is gone."""

    def __init__(self, run_dir: Path, log: Path):
        super().__init__(daemon=True)
        self.run_dir, self.log = run_dir, log
        self.at_resume: dict[int, int] = {}
        self.at_first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        pids: dict[int, int] = {}
        first_seen, offset = False, 0
        while not self.done.is_set():
            for f in (self.run_dir / "pids").glob("rank*.pid") if (self.run_dir / "pids").is_dir() else []:
                try:
                    pids.setdefault(int(f.stem[4:]), int(f.read_text()))
                except (OSError, ValueError):
                    pass
            for rank, pid in pids.items():
                value = _hwm(pid)
                if value is not None:
                    self.last[rank] = value
            text = ""
            if self.log.exists() and not first_seen:   # the lines logged since the last look, whole ones only
                with self.log.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                whole = chunk[:chunk.rfind(b"\n") + 1]
                offset += len(whole)
                text = whole.decode(errors="replace").replace(" ", "")
            if not self.at_resume and '"kind":"resume"' in text:
                self.at_resume = dict(self.last)
            if '"type":"step"' in text:
                first_seen = True
                self.at_first = dict(self.last)
            time.sleep(0.02)


def _run(runs: ChildRuns, root: Path, workdir: Path, name: str, world: int, strategy: str, steps: int,
         hidden: int, every: int, resume: Path | None = None) -> tuple[list[dict], Peaks]:
    log = workdir / f"{name}.jsonl"
    run_dir = workdir / "runs" / name
    config = root / "demo" / "configs" / "digits_ddp.toml"
    sets = [f"run.dir={workdir / 'runs'}", f"run.name={name}", f"run.steps={steps}", "run.eval_every=0",
            f"model.hidden={hidden}", f"model.depth={DEPTH}", "optim.name=adamw", "optim.lr=0.0001",
            "data.batch_size=32", "device.memory=64GiB", f"parallel.world_size={world}",
            f"parallel.strategy={strategy}", f"checkpoint.every={every}", "checkpoint.keep=2"]
    cmd = [sys.executable, "-m", "engine.cli", "run", str(config), "--headless", "--telemetry-log", str(log),
           *[a for s in sets for a in ("--set", s)], *(["--resume", str(resume)] if resume else [])]
    peaks = Peaks(run_dir, log)
    peaks.start()
    peaks.started = time.time()
    proc = runs.start(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
    try:
        _, err = proc.communicate(timeout=1800)
    finally:
        runs.stop(proc)
        peaks.done.set()
        peaks.join()
    if proc.returncode != 0:
        raise RuntimeError(f"bench checkpoint: the {name} run failed (exit {proc.returncode}): {err.strip()[-800:]}")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    peaks.first_step_s = next(r["time"] for r in records if r.get("type") == "step") - peaks.started
    return records, peaks


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2 ** 20, 1)


def measure(runs: ChildRuns, root: Path, params: float, write_world: int, read_world: int, strategy: str,
            read_strategy: str, workdir: Path) -> dict:
    hidden = hidden_for(params)
    written, _ = _run(runs, root, workdir, "write", write_world, strategy, 3, hidden, every=1)
    writes = [e["write_ms"] for e in written if e.get("kind") == "checkpoint" and "write_ms" in e]
    checkpoints = sorted((workdir / "runs" / "write" / "checkpoints").glob("step_*"))
    on_disk = sum(f.stat().st_size for f in checkpoints[-1].iterdir())
    _, fresh = _run(runs, root, workdir, "fresh", read_world, read_strategy, 2, hidden, every=0)
    resumed, loaded = _run(runs, root, workdir, "resumed", read_world, read_strategy, 5, hidden, every=0,
                           resume=checkpoints[-1])
    event = next((e for e in resumed if e.get("kind") == "resume"), {})
    layer = hidden * hidden * 4
    ranks = [{"rank": r, "resumed_loaded_mib": _mib(loaded.at_resume.get(r)),
              "fresh_first_step_mib": _mib(fresh.at_first.get(r)),
              "resumed_first_step_mib": _mib(loaded.at_first.get(r)),
              "load_extra_mib": _mib(loaded.at_first.get(r, 0) - fresh.at_first.get(r, 0)),
              "fresh_end_mib": _mib(fresh.last.get(r)), "resumed_end_mib": _mib(loaded.last.get(r))}
             for r in range(read_world)]
    return {"root": str(root), "params_m": round((DEPTH - 1) * hidden * hidden / 1e6, 1), "hidden": hidden,
            "strategy": strategy, "write_world": write_world, "read_strategy": read_strategy,
            "read_world": read_world, "checkpoint_mib": _mib(on_disk),
            "write_ms": writes, "write_ms_median": statistics.median(writes) if writes else None,
            "load_ms": event.get("load_ms"),
            # from the command to the first step, resumed less fresh: the launcher's checksums, the workers' load
            "resume_overhead_s": round(loaded.first_step_s - fresh.first_step_s, 2),
            "layer_mib": _mib(layer), "ranks": ranks}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="trainyard bench checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="100M", help="the model's parameters, e.g. 100M, 20M (default 100M)")
    ap.add_argument("--write-world", type=int, default=4)
    ap.add_argument("--read-world", type=int, default=2)
    ap.add_argument("--strategy", default="ddp", choices=("ddp", "sharded", "pipeline"))
    ap.add_argument("--read-strategy", default=None, choices=("ddp", "sharded", "pipeline"),
                    help="the resumed run's strategy (default: --strategy)")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="the trainyard checkout to run (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    m = re.fullmatch(r"([\d.]+)([MG]?)", args.params.strip().upper())
    if not m:
        ap.error(f"--params {args.params!r}: a count such as 100M or 2G")
    params = float(m.group(1)) * {"": 1, "M": 1e6, "G": 1e9}[m.group(2)]
    with ChildRuns() as runs, tempfile.TemporaryDirectory(prefix="trainyard-bench-ckpt-") as tmp:
        result = measure(runs, args.root.resolve(), params, args.write_world, args.read_world, args.strategy,
                         args.read_strategy or args.strategy, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['params_m']}M parameters (hidden {result['hidden']}, AdamW), checkpoint "
          f"{result['checkpoint_mib']} MiB, one layer {result['layer_mib']} MiB; {result['root']}")
    print(f"write: {result['write_world']} x {result['strategy']}, write_ms {result['write_ms']} "
          f"(median {result['write_ms_median']})")
    print(f"load:  {result['write_world']} x {result['strategy']} -> {result['read_world']} x "
          f"{result['read_strategy']}, load_ms {result['load_ms']} (the workers'), first step "
          f"{result['resume_overhead_s']} s later than a fresh start's (the launcher's checksums too)")
    print("rank  loaded  fresh@step1  resumed@step1  load extra  fresh end  resumed end   (peak RSS, MiB)")
    for r in result["ranks"]:
        print(f"{r['rank']:>4}  {r['resumed_loaded_mib']:>6}  {r['fresh_first_step_mib']:>11}  "
              f"{r['resumed_first_step_mib']:>13}  {r['load_extra_mib']:>10}  {r['fresh_end_mib']:>9}  "
              f"{r['resumed_end_mib']:>11}")
    return 0
