"""A worker's error that a restart would meet again ends the run at once, and is never restarted.

    raise Refused("...")                    # or any error is_refusal() accepts: exit 2, "run refused: ..."
    transient(error)                        # a lost peer or link, a timed-out collective: restarted
    refuse(path, launcher, rank, error, stopped, where="step 12")   # worker_main: tell the launcher, wait

Only a worker that *dies* or loses a peer (a signal, a lost host, a collective timing out: `transient`) is
restarted by the elastic agent. Any other error is deterministic: a bad setting only a worker can check, a
plan that cannot fit, a damaged checkpoint (refusals: exit 2), or an error in the model or the data (an
IndexError, a shape mismatch, a full disk: failures, exit 1), which fail the same way after every restart,
so restarting them only delays the answer. The worker that meets one writes it to the launcher's refusal
file, signals the launcher (REFUSAL_SIGNAL) and waits; the launcher's handler (engine/run/launch.py) stops
the worker group and exits with the error's line, its rank and step. Under torchrun there is no launcher of
ours to tell, and the error is raised as before.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REFUSAL_SIGNAL = signal.SIGUSR2
WAIT_FOR_STOP_S = 30.0   # the launcher stops the group within its shutdown timeout; this is a backstop
REFUSED, FAILED = "refused", "failed"   # the refusal file's first line: exit 2 or exit 1

# what gloo, NCCL and the store say when a peer or the network is lost (their own text carries a source path)
_TRANSPORT = (("Connection closed by peer", "connection closed by peer"),
              ("Connection reset by peer", "connection reset by peer"),
              ("Broken pipe", "broken pipe"),
              ("Application timeout", "timed out (parallel.collective_timeout_s)"),
              ("Timed out", "timed out (parallel.collective_timeout_s)"),
              ("Socket Timeout", "timed out (parallel.collective_timeout_s)"),
              ("NCCL communicator was aborted", "NCCL communicator aborted"),
              ("ncclRemoteError", "NCCL: a remote peer failed"),
              ("ncclSystemError", "NCCL: a system or network error"))


class Refused(RuntimeError):
    """The run cannot go on as configured on this machine (e.g. too few GPUs for device.kind = "cuda")."""


def transport_failure(error: BaseException) -> str | None:
    """A lost peer or link in a few words, or None when `error` is not one."""
    text = str(error)
    for needle, words in _TRANSPORT:
        if needle in text:
            return words
    return None


def transient(error: BaseException) -> str | None:
    """What a restart may cure, in a few words: a peer, the network or the store lost, a collective timed out
    (torch's DistError, a connection error, gloo's and NCCL's own words, an error whose class says
    `transient = True`: e.g. the parameter server's PeerLost); None for anything else."""
    import torch.distributed as dist
    words = transport_failure(error)
    if words:
        return words
    if getattr(type(error), "transient", False) is True:   # a technique's own word for a lost peer
        return str(error).splitlines()[0][:160] if str(error) else type(error).__name__
    if isinstance(error, getattr(dist, "DistError", ())):
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    if isinstance(error, (ConnectionError, TimeoutError, EOFError)):
        return type(error).__name__
    return None


def is_refusal(error: BaseException) -> bool:
    """Errors that say the run is set up wrong (exit 2): settings and plans (ValueError, e.g. update_plan's
    InfeasibleCapacity), checkpoints (CheckpointError), Refused, and an error whose class says `refusal = True`
    (a technique's own, e.g. memory.PlanError: the ground imports no technique)."""
    from engine.runtime.checkpoint import CheckpointError
    return isinstance(error, (Refused, ValueError, CheckpointError)) or getattr(type(error), "refusal", False) is True


def refuse(path: str, launcher_pid: int, rank: int, error: BaseException, stopped, where: str = "") -> None:
    """Hand `error` to the launcher and wait for it to stop this worker; never returns. `stopped()` is
    true once the launcher's SIGTERM has arrived (engine/runtime/lifecycle.py: StopRequest). `where`: the
    step it came from, e.g. "step 12" (a failure's line names it)."""
    kind = REFUSED if is_refusal(error) else FAILED
    at = f", {where}" if where else ""
    said = f"{type(error).__name__}: {error}" if kind == FAILED else str(error)   # a refusal's line says all
    text = f"{kind}\nrank {rank}{at}: {said}"
    # The first rank to refuse is the one reported. Its text is written whole before the file takes the
    # path (a link fails where one exists): a second rank signalling meanwhile must not make the launcher
    # read an empty file ("run refused: " once came out alone).
    mine = f"{path}.rank{rank}"
    try:
        with open(mine, "w") as f:
            f.write(text)
        os.chmod(mine, 0o600)
        os.link(mine, path)
    except OSError:   # FileExistsError: another rank's is first; a full runtime dir: the launcher says so
        pass
    finally:
        try:
            os.unlink(mine)
        except OSError:
            pass
    os.kill(launcher_pid, REFUSAL_SIGNAL)
    deadline = time.monotonic() + WAIT_FOR_STOP_S
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(2)


def read_refusal(path: str) -> tuple[str, str]:
    """(kind, text) of the refusal file a worker wrote; a file it could not write is said as such."""
    try:
        with open(path) as f:
            kind, _, text = f.read().partition("\n")
    except OSError:
        return FAILED, "a worker stopped the run without saying why (its refusal file could not be read)"
    if kind not in (REFUSED, FAILED):   # an older worker's text
        return REFUSED, kind + ("\n" + text if text else "")
    return kind, text
