"""`trainyard bench step`'s interleaved turns, the CPU's default: every variant's process is alive at once, and
they take turns of half a second (`SLICE_S`) while the others are stopped (SIGSTOP on the whole process tree), so
every variant is timed in the same minutes of a shared machine, seconds apart, and on the same CPU (each
process tree is pinned to one, once warm).

Why: on this project's shared 2-core machines a variant's figure moved by up to 30% from one turn of a minute to
the next (the neighbours' load changes over tens of seconds), so turns of a process each could not tell 0.97x
from 0.80x in three rounds. A slice of half a second sees the machine its neighbours' slices see. And a virtual
machine's CPUs run at speeds of their own that change over seconds (a 256 x 256 matmul loop pinned to each of
this machine's two CPUs in turn: 134 to 180 ms, the slower CPU changing from one second to the next): unpinned,
two processes can sit on different ones for many slices (trainyard's slices 27-29 ms for ten seconds while the
plain loop's, in the slices between them, were 19-20 ms). Four trainyard configurations that run the same
steps, interleaved: with 2 s slices, 5 cycles a round, their ratios to one of them moved 0.886-1.112 from round
to round; with 0.5 s slices, 20 cycles a round, 1.005-1.069.

    per_round, failed = interleaved(make, rounds, warm_steps, log)   # make(r): round r's {variant: Contender}

Each round starts every variant afresh: new processes, `make(r)`'s. With one process per variant for every
round, two identical trainyard configurations measured 1.007 apart (rounds 1.005-1.022), every round above 1, and
two that differed only in weight decay (which costs the fused kernel nothing measurable) 0.987 (0.971-0.991),
every round below: where a process's code and heap happen to lie moves its speed by a percent or two for its
whole life, so rounds of the same processes repeat that offset and their spread hides it. With fresh processes
the identical two measured 1.004 (0.973-1.010): the median centred, the spread as wide as the offsets are.
Each round, a variant warms up alone (imports, its first steps, a compile from the cache kept in the bench's
folder) and is stopped once it has made `warm_steps` steps. Then, cycle after cycle, each variant runs one slice
in turn (who goes first rotates). A step is kept when it began and ended inside one of its own slices: the step a
stop cut in two is not. A round is `CYCLES_PER_ROUND` cycles (`--cycles`), and a variant's figure in it is the
median of the steps it kept there; then the round's processes end. A step's time is the one its user sees: the
plain loop's from one `loss.item()` to the next (engine/bench/step_plain.py `--stream`), trainyard's between step
records (the log's `time` and `samples_per_s`).

On a GPU six variants of a 1B model do not fit at once: there bench step keeps its turns of a process each.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import psutil

SLICE_S = 0.5
CYCLES_PER_ROUND = 20
EDGE_S = 0.002           # a step is kept when it began at least this long after its slice began
WARM_TIMEOUT_S = 600.0   # imports, a model's build and a compile on a busy 2-core machine
STOP_GRACE_S = 120.0     # a trainyard run's stop: its final checkpoint, then the launcher's exit


class Contender:
    """One variant's process tree, stopped and continued as a whole, and its steps so far as (end, ms): the plain
    loop's from its stdout (`--stream`), a trainyard run's from its telemetry log (`log`)."""

    def __init__(self, variant: str, cmd: list[str], env: dict, cwd: Path, batch: int, log: Path | None = None):
        self.variant, self.cmd, self.env, self.cwd, self.batch, self.log = variant, cmd, env, cwd, batch, log
        self.proc: subprocess.Popen | None = None
        self._streamed: list[tuple[float, float]] = []
        self._errors = cwd / f"{variant}.stderr"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, text=True,
                                     stdout=subprocess.DEVNULL if self.log else subprocess.PIPE,
                                     stderr=self._errors.open("w"))
        if not self.log:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{") and '"end"' in line:
                got = json.loads(line)
                self._streamed.append((got["end"], got["ms"]))

    def steps(self) -> list[tuple[float, float]]:
        if not self.log:
            return list(self._streamed)
        if not self.log.exists():
            return []
        steps = []
        for line in self.log.read_text().splitlines():
            if '"type":"step"' in line.replace(" ", ""):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:   # the line being written
                    continue
                steps.append((record["time"], 1000 * self.batch / record["samples_per_s"]))
        return steps

    def check(self) -> None:
        """Raises (with the end of its stderr) if the process has ended."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.variant} ended (exit {self.proc.returncode}):\n"
                               f"{self._errors.read_text()[-3000:]}")

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _signal(self, sig) -> None:
        for p in self._tree():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def pin(self, cpu: int) -> None:
        """Every process of the tree on this one CPU (a virtual machine's CPUs run at their own, changing speeds)."""
        for p in self._tree():
            try:
                p.cpu_affinity([cpu])
            except (psutil.NoSuchProcess, OSError):   # ended, or affinity not supported
                pass

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def peak_bytes(self) -> int | None:
        """The largest resident set in the tree now (the process that trains)."""
        sizes = []
        for p in self._tree():
            try:
                sizes.append(p.memory_info().rss)
            except psutil.NoSuchProcess:
                pass
        return max(sizes, default=None)

    def close(self) -> None:
        """Ends the tree: the plain loop killed; a trainyard run stopped as a user stops it (SIGTERM to its
        launcher), killed if it outlives STOP_GRACE_S."""
        if self.proc is None:
            return
        self.resume()
        tree = self._tree()
        if self.log and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


def _warm(contender: Contender, warm_steps: int, cpu: int) -> None:
    contender.start()
    t0 = time.monotonic()
    while len(contender.steps()) < warm_steps:
        contender.check()
        if time.monotonic() - t0 > WARM_TIMEOUT_S:
            raise RuntimeError(f"{contender.variant}: {warm_steps} steps not made in {WARM_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
    contender.pause()
    contender.pin(cpu)


def interleaved(make, rounds: int, warm_steps: int, log=print,
                cycles: int = CYCLES_PER_ROUND) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """({variant: [{"step_ms", "peak_bytes", "kept", "slices_ms"} per round]}, {variant: why it failed}); `make(r)`:
    round r's contenders, {variant: Contender}, fresh processes each round; a round is `cycles` cycles; see the
    module. A variant that fails is left out of the rounds after."""
    failed: dict[str, str] = {}
    cpu = max(os.sched_getaffinity(0))   # every contender on the same CPU: each sees the speed the others saw
    per_round: dict[str, list[dict]] = {}
    for r in range(rounds):
        contenders = {v: c for v, c in make(r).items() if v not in failed}
        try:
            for v, contender in contenders.items():
                log(f"  round {r + 1}/{rounds}: warming up {v}")
                try:
                    _warm(contender, warm_steps, cpu)
                except (RuntimeError, OSError) as e:
                    failed[v] = str(e)[-2000:]
                    log(f"  {v} failed: {failed[v]}")
            alive = [v for v in contenders if v not in failed]
            log(f"  round {r + 1}/{rounds}: {SLICE_S:g} s slices of {', '.join(alive)}, {cycles} cycles")
            windows: dict[str, list[tuple[float, float]]] = {v: [] for v in alive}
            for cycle in range(cycles):
                order = alive[cycle % len(alive):] + alive[:cycle % len(alive)]
                for v in order:
                    contenders[v].resume()
                    start = time.time()
                    time.sleep(SLICE_S)
                    contenders[v].pause()
                    windows[v].append((start, time.time()))
            for v in alive:
                steps = contenders[v].steps()
                slices = [[ms for end, ms in steps if end - ms / 1000 >= t0 + EDGE_S and end <= t1]
                          for t0, t1 in windows[v]]
                kept = [ms for one in slices for ms in one]
                if len(kept) < 3:
                    raise RuntimeError(f"{v}: {len(kept)} whole steps in round {r + 1}'s slices; a step must take "
                                       f"well under {SLICE_S:g} s to be timed this way (--mode turns)")
                per_round.setdefault(v, []).append(
                    {"step_ms": statistics.median(kept), "peak_bytes": contenders[v].peak_bytes(), "kept": len(kept),
                     "slices_ms": [round(statistics.median(one), 3) if one else None for one in slices]})
        finally:
            for contender in contenders.values():
                contender.close()
    for v, turns in per_round.items():
        if v in failed:   # failed in a later round: its earlier rounds judge nothing against the others
            continue
        figures = ", ".join(f"{t['step_ms']:.2f}" for t in turns)
        log(f"    {v}: {figures} ms a step by round ({sum(t['kept'] for t in turns)} steps kept)")
    return {v: turns for v, turns in per_round.items() if v not in failed}, failed
