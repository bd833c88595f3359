"""A run refused from inside a worker ends at once, with exit status 2, and is never restarted.

    raise Refused("...")                    # or any error is_refusal() accepts
    refuse(job, rank, error, stop)          # worker_main: tell the launcher, wait to be stopped

A deterministic error (a bad setting only a worker can check, an update or memory plan that
cannot fit, a damaged checkpoint) fails the same way after every restart, so restarting it only
delays the answer. The worker that meets one writes it to the launcher's refusal file, signals the
launcher (REFUSAL_SIGNAL) and waits; the launcher's handler (engine/run/launch.py) stops the worker
group and exits 2 with the error's line. A worker that *dies* (a signal, a lost peer, a collective
timing out) raises none of these and is restarted by the elastic agent as before. Under torchrun
there is no launcher of ours to tell, and the error is raised as before.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REFUSAL_SIGNAL = signal.SIGUSR2
WAIT_FOR_STOP_S = 30.0   # the launcher stops the group within its shutdown timeout; this is a backstop


class Refused(RuntimeError):
    """The run cannot go on as configured on this machine (e.g. too few GPUs for device.kind = "cuda")."""


def is_refusal(error: BaseException) -> bool:
    """Errors that a restart would meet again: settings and plans (ValueError, e.g. update_plan's
    InfeasibleCapacity), checkpoints (CheckpointError), Refused, and an error whose class says `refusal = True`
    (a technique's own, e.g. memory.PlanError: the ground imports no technique)."""
    from engine.runtime.checkpoint import CheckpointError
    return isinstance(error, (Refused, ValueError, CheckpointError)) or getattr(type(error), "refusal", False) is True


def refuse(path: str, launcher_pid: int, rank: int, error: BaseException, stopped) -> None:
    """Hand `error` to the launcher and wait for it to stop this worker; never returns. `stopped()` is
    true once the launcher's SIGTERM has arrived (engine/runtime/lifecycle.py: StopRequest)."""
    text = f"rank {rank}: {error}"
    # The first rank to refuse is the one reported. Its text is written whole before the file takes the
    # path (a link fails where one exists): a second rank signalling meanwhile must not make the launcher
    # read an empty file ("run refused: " once came out alone).
    mine = f"{path}.rank{rank}"
    try:
        with open(mine, "w") as f:
            f.write(text)
        os.chmod(mine, 0o600)
        os.link(mine, path)
    except FileExistsError:
        pass
    finally:
        try:
            os.unlink(mine)
        except FileNotFoundError:
            pass
    os.kill(launcher_pid, REFUSAL_SIGNAL)
    deadline = time.monotonic() + WAIT_FOR_STOP_S
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(2)
