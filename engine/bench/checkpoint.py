"""`trainyard bench checkpoint`: how long a checkpoint takes to write and to load, what the step waits for it,
and what a resume holds.

The disk first: as many bytes as a checkpoint holds, written to the same folder and fsynced (`dd conv=fsync`),
its rate the one a checkpoint's write is compared with. Then three runs of an MLP of about `--params`
parameters (AdamW: its two moments per parameter) on the CPU:

    write    `--write-world` ranks of `--strategy`, a checkpoint every `--every` steps, each step paced
             (run.step_pause_ms) to take longer than a write: the checkpoint events' stall_ms (what the step
             waited: the snapshot in host memory), write_ms (the slowest rank's snapshot start to its file
             fsynced), the write's rate (the checkpoint's bytes over write_ms) against the disk's, and
             stall_ms / write_ms (after the first checkpoint, which allocates the host buffers). `--sync`: checkpoint.background = false, the step waits for the whole write
    fresh    `--read-world` ranks, no checkpoint to resume: each rank's peak RSS (VmHWM) when its first
             step is logged (the model built, one step) and at its end (training)
    resumed  `--read-world` ranks of `--read-strategy` resumed from the write run's last checkpoint: the resume
             event's load_ms (the slowest rank's), each rank's peak RSS when the resume event is logged (the
             load) and when its first step is, and how much later than the fresh run's its first step came
             (the launcher's checksums and the load)

The resumed ranks' peak minus the fresh ones' is what loading held beyond training's start; the goal
(docs/checkpoints.md) is no more than one layer in flight. `--root DIR` runs another checkout of trainyard
(an earlier version, which resumes only at the shape that wrote it) with the same figures, side by side.

    trainyard bench checkpoint [--params 100M] [--write-world 4] [--read-world 2] [--strategy ddp] [--every 2]
                               [--sync] [--json]
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


def peak_rss(pid: int | str = "self") -> int | None:
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
                value = peak_rss(pid)
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


def disk_rate(folder: Path, nbytes: int) -> float:
    """Bytes a second that `folder`'s disk takes: `nbytes` written in 64 MiB blocks and fsynced (what
    `dd if=/dev/urandom of=FILE bs=64M conv=fsync` measures; random bytes, which no filesystem compresses)."""
    block = os.urandom(64 << 20)
    path = folder / "disk-rate.bin"
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for at in range(0, nbytes, len(block)):
                f.write(memoryview(block)[:min(len(block), nbytes - at)])
            f.flush()
            os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)


def _run(runs: ChildRuns, root: Path, workdir: Path, name: str, world: int, strategy: str, steps: int,
         hidden: int, every: int, resume: Path | None = None, extra: tuple = ()) -> tuple[list[dict], Peaks]:
    log = workdir / f"{name}.jsonl"
    run_dir = workdir / "runs" / name
    config = root / "demo" / "configs" / "digits_ddp.toml"
    sets = [f"run.dir={workdir / 'runs'}", f"run.name={name}", f"run.steps={steps}", "run.eval_every=0",
            f"model.hidden={hidden}", f"model.depth={DEPTH}", "optim.name=adamw", "optim.lr=0.0001",
            "data.batch_size=32", "device.memory=64GiB", f"parallel.world_size={world}",
            f"parallel.strategy={strategy}", f"checkpoint.every={every}", "checkpoint.keep=2", *extra]
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
            read_strategy: str, workdir: Path, every: int = 2, sync: bool = False) -> dict:
    hidden = hidden_for(params)
    expected = 3 * 4 * ((DEPTH - 1) * hidden * hidden)   # fp32 weights and AdamW's two moments
    disk_bps = disk_rate(workdir, expected)
    # every step longer than a write at the disk's rate (twice it, and the snapshot): the writes never queue
    pause_ms = max(200, round(2000 * expected / disk_bps))
    steps = 1 + 4 * every   # four checkpoints in the background, and the run's last
    written, _ = _run(runs, root, workdir, "write", write_world, strategy, steps, hidden, every=every,
                      extra=(f"run.step_pause_ms={pause_ms}", f"checkpoint.background={str(not sync).lower()}"))
    events = [e for e in written if e.get("kind") == "checkpoint" and "write_ms" in e]
    periodic = events[:-1] or events   # the last is the run's end, synchronous
    writes = [e["write_ms"] for e in periodic]
    stalls = [e["stall_ms"] for e in periodic]
    checkpoints = sorted((workdir / "runs" / "write" / "checkpoints").glob("step_*"))
    on_disk = sum(f.stat().st_size for f in checkpoints[-1].iterdir())
    write_bps = statistics.median(e["bytes"] / (e["write_ms"] / 1000) for e in periodic) if periodic else None
    _, fresh = _run(runs, root, workdir, "fresh", read_world, read_strategy, 2, hidden, every=0)
    resumed, loaded = _run(runs, root, workdir, "resumed", read_world, read_strategy, steps + 2, hidden, every=0,
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
            "every": every, "step_pause_ms": pause_ms, "background": not sync,
            "write_ms": writes, "write_ms_median": statistics.median(writes) if writes else None,
            "stall_ms": stalls, "stall_ms_median": statistics.median(stalls) if stalls else None,
            # the first checkpoint allocates the host buffers (pinned, on a GPU); the later ones reuse them
            "first_stall_ms": stalls[0] if stalls else None,
            "stall_over_write": round(statistics.median(s / w for s, w in list(zip(stalls, writes))[1:]), 4)
            if len(writes) > 1 else None,
            "write_mb_s": round(write_bps / 1e6, 1) if write_bps else None, "disk_mb_s": round(disk_bps / 1e6, 1),
            "write_over_disk": round(write_bps / disk_bps, 3) if write_bps else None,
            "waited": sum(1 for e in written if e.get("kind") == "checkpoint_waited"),
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
    ap.add_argument("--every", type=int, default=2, help="checkpoint.every of the write run (default 2)")
    ap.add_argument("--sync", action="store_true", help="checkpoint.background = false: the step waits for the write")
    ap.add_argument("--dir", type=Path, default=None, help="the folder to write in (default: a temporary one): "
                                                           "the disk measured")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="the trainyard checkout to run (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    m = re.fullmatch(r"([\d.]+)([MG]?)", args.params.strip().upper())
    if not m:
        ap.error(f"--params {args.params!r}: a count such as 100M or 2G")
    params = float(m.group(1)) * {"": 1, "M": 1e6, "G": 1e9}[m.group(2)]
    with ChildRuns() as runs, tempfile.TemporaryDirectory(prefix="trainyard-bench-ckpt-", dir=args.dir) as tmp:
        result = measure(runs, args.root.resolve(), params, args.write_world, args.read_world, args.strategy,
                         args.read_strategy or args.strategy, Path(tmp), args.every, args.sync)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['params_m']}M parameters (hidden {result['hidden']}, AdamW), checkpoint "
          f"{result['checkpoint_mib']} MiB, one layer {result['layer_mib']} MiB; {result['root']}")
    mode = "synchronous" if args.sync else "in the background"
    print(f"write: {result['write_world']} x {result['strategy']}, {mode}, every {result['every']} steps of "
          f">= {result['step_pause_ms']} ms; write_ms {result['write_ms']} (median {result['write_ms_median']}), "
          f"stall_ms {result['stall_ms']} (median {result['stall_ms_median']}); {result['waited']} waited for a write")
    print(f"rate:  the write {result['write_mb_s']} MB/s, the disk (as many bytes, fsynced, in the same folder) "
          f"{result['disk_mb_s']} MB/s: {result['write_over_disk']}x; the step's stall / write_ms "
          f"{result['stall_over_write']} (median after the first, whose stall {result['first_stall_ms']} ms "
          f"allocates the host buffers)")
    print(f"load:  {result['write_world']} x {result['strategy']} -> {result['read_world']} x "
          f"{result['read_strategy']}, load_ms {result['load_ms']} (the workers'), first step "
          f"{result['resume_overhead_s']} s later than a fresh start's (the launcher's checksums too)")
    print("rank  loaded  fresh@step1  resumed@step1  load extra  fresh end  resumed end   (peak RSS, MiB)")
    for r in result["ranks"]:
        print(f"{r['rank']:>4}  {r['resumed_loaded_mib']:>6}  {r['fresh_first_step_mib']:>11}  "
              f"{r['resumed_first_step_mib']:>13}  {r['load_extra_mib']:>10}  {r['fresh_end_mib']:>9}  "
              f"{r['resumed_end_mib']:>11}")
    return 0
