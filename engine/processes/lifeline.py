"""A worker's lifeline to its launcher: once the launcher is gone, whatever ended it (a SIGKILL included), the
worker stops as if signalled and is gone within `grace_s`.

    launcher = lifeline.identity()                # in the launcher: (pid, start time), carried by the Job
    lifeline.hold(launcher, grace_s=5.0)          # first thing in a worker
    lifeline.finished()                           # the worker's work is done: a stop now ends it at once

On the CPU the workers are forks of the fork server, not the launcher's children, so neither their parent
nor PR_SET_PDEATHSIG tells them of the launcher's end: a thread of theirs waits on a pidfd of the launcher
(polled where pidfd_open is missing). When it returns, the worker sends itself SIGTERM, which the step loop
takes as a stop at its next boundary (engine/runtime/lifecycle.py StopRequest: the final checkpoint where
it fits), and `grace_s` later it exits whatever it was doing. The fork server follows by itself: every
process it forks holds its liveness pipe, so once the launcher and the workers are gone, it reads EOF and
exits, and the resource tracker after it. Imports no torch.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

POLL_S = 0.5   # where there is no pidfd: how often the launcher's pid is looked at
_gone: list[int] = []   # the launcher's pid, once this process saw it gone


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process `pid` (/proc/PID/stat fields 3 and 22), None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """Process `pid`'s start time, None where unknown: with the pid, what tells a process from a later one that
    reuses its number."""
    stat = _stat(pid)
    return stat[1] if stat else None


def identity(pid: int | None = None) -> tuple[int, int | None]:
    """(pid, start time) of process `pid`, this one by default."""
    pid = os.getpid() if pid is None else pid
    return pid, start_time(pid)


def alive(who: tuple[int, int | None]) -> bool:
    pid, started = who
    stat = _stat(pid)
    if stat is None:   # no /proc entry to read: by its pid alone
        from engine.telemetry.protocol import pid_alive
        return pid_alive(pid)
    state, now = stat
    return state != "Z" and (started is None or now == started)   # a zombie has ended; a reused pid is another


def _wait_gone(who: tuple[int, int | None]) -> None:
    pid = who[0]
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):   # no pidfd (an old kernel), or already gone
        fd = None
    try:
        if not alive(who):   # after opening: the pidfd is then the launcher's, not a later process's
            return
        if fd is not None:
            while not select.select([fd], [], [], None)[0]:
                pass
            return
        while alive(who):
            time.sleep(POLL_S)
    finally:
        if fd is not None:
            os.close(fd)


def hold(launcher: tuple[int, int | None], grace_s: float, who: str = "worker", stop: bool = True
         ) -> threading.Thread:
    """Watch `launcher` from a daemon thread: once it is gone, SIGTERM this process, and `grace_s` later
    exit it (status 1) whatever it is doing. `stop` False: exit at once, as a lost host's workers do (a run
    over several hosts goes on without this one, or restarts, rather than stop with it)."""

    def watch() -> None:
        _wait_gone(launcher)
        _gone.append(launcher[0])
        how = f"stopping, gone within {grace_s:g} s" if stop else "leaving its host's part of the run"
        print(f"trainyard: {who} (pid {os.getpid()}): its launcher (pid {launcher[0]}) is gone; {how}",
              file=sys.stderr, flush=True)
        if stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        sys.stderr.flush()
        os._exit(1)

    thread = threading.Thread(target=watch, name="trainyard-lifeline", daemon=True)
    thread.start()
    return thread


def launcher_gone() -> bool:
    """Whether this process's launcher was seen gone (its stop is the lifeline's SIGTERM)."""
    return bool(_gone)


def finished() -> None:
    """The worker's work is done: SIGTERM and SIGINT end it at once from now on (the elastic agent may keep it
    waiting for its result to be read, and a stop must still end it)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


MARK = "TRAINYARD_RUN"


def mark_run(run_dir) -> None:
    """Put the run's folder in this process's environment (TRAINYARD_RUN), which every process it starts
    inherits: the fork server (started once per process: the first run's), the workers, their helpers. What
    finds a run's processes whoever their parent is now (an orphan's is init): tests/test_faults.py."""
    os.environ[MARK] = str(os.path.abspath(run_dir))
