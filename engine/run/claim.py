"""A run folder belongs to one live run: each host's launcher and its workers hold a lock in it.

    claim = Claim.take(run_dir, node_rank)    # the launcher, before it touches the folder; RunSetupError if live
    hold_as_worker(run_dir, node_rank)        # every worker, for its life
    live(run_dir)                             # whether any host of this machine runs in the folder now
    claim.release()                           # the run's end (the kernel releases it however the process ends)

Two flock(2) locks per host, in `pids/`: the launcher holds `nodeR.gate` exclusively for its life, and the
workers hold `nodeR.lock` shared. A second launcher must take the gate (refused while the first launcher
lives) and then find no worker holding the lock (refused while a worker of a launcher that died is still
alive: the lifeline ends it within parallel.shutdown_timeout_s, engine/processes/lifeline.py). The kernel
releases a lock however its holder ends, so a crashed run's locks are never stale, and only then are its
leftovers (a socket, a registry entry) removed. The folder may be on a filesystem the hosts share (each host
locks its own pair); a filesystem whose locks do not work (one that takes a lock twice) is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

_held: list = []   # a worker's lock files, open for its life


class RunSetupError(RuntimeError):
    """The run cannot start as asked (a live run's folder, a checkpoint, a check before launch: engine/run/
    checks.py); exit status 2. Here, so that a second run of a live run's name is refused before torch loads."""


def gate_path(run_dir: Path, node_rank: int) -> Path:
    return Path(run_dir) / "pids" / f"node{node_rank}.gate"


def lock_path(run_dir: Path, node_rank: int) -> Path:
    return Path(run_dir) / "pids" / f"node{node_rank}.lock"


def _open(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a+")


def _try(f, how: int) -> bool:
    """flock(f, how | LOCK_NB): True once taken, False where another holds it; OSError where locks fail."""
    try:
        fcntl.flock(f.fileno(), how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _no_locks(run_dir: Path, why: str) -> RunSetupError:
    return RunSetupError(f"the filesystem holding {run_dir} has no working file locks ({why}), so trainyard cannot "
                         f"keep two runs out of one folder: put run.dir on a filesystem with locks (a local disk, "
                         f"or NFS with its lock service running)")


def _locks_work(path: Path) -> bool:
    """Whether another process is refused the lock this one holds on `path` (an open file description
    of another process must conflict; a filesystem whose locks are local no-ops lets it through)."""
    probe = ("import fcntl, sys\nf = open(sys.argv[1], 'a+')\ntry:\n    fcntl.flock(f.fileno(), "
             "fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(0)\nsys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, timeout=60)
    return done.returncode == 0


class Claim:
    """This host's claim on a run folder, held by its launcher."""

    def __init__(self, gate, run_dir: Path, node_rank: int, made: bool = False):
        self._gate, self.run_dir, self.node_rank = gate, Path(run_dir), node_rank
        self.made = made   # the folder did not exist before this claim

    @classmethod
    def take(cls, run_dir: Path, node_rank: int, name: str) -> "Claim":
        """Claim `run_dir` for this host's part of run `name`; RunSetupError naming the live run (and how to
        reach it) where one holds it, or naming the filesystem where its locks do not work."""
        run_dir = Path(run_dir)
        made = not run_dir.exists()
        gate = _open(gate_path(run_dir, node_rank))
        try:
            if not _try(gate, fcntl.LOCK_EX):
                raise RunSetupError(_live_message(run_dir, node_rank, name))
            if not _locks_work(gate_path(run_dir, node_rank)):
                raise _no_locks(run_dir, "another process took a lock this one holds")
            with _open(lock_path(run_dir, node_rank)) as lock:   # no worker of an earlier launcher is left
                if not _try(lock, fcntl.LOCK_EX):
                    raise RunSetupError(_orphans_message(run_dir, node_rank, name))
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
            gate.seek(0)
            gate.truncate()
            gate.write(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
            gate.flush()
        except OSError as e:
            gate.close()
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise _no_locks(run_dir, e.strerror or str(e)) from None
            raise
        except BaseException:
            gate.close()
            raise
        return cls(gate, run_dir, node_rank, made)

    def release(self) -> None:
        if self._gate is not None:
            self._gate.close()   # closing the last descriptor releases the lock
            self._gate = None

    def abandon(self) -> None:
        """A run refused before it started: the folder this claim made goes (nothing else was in it), and the
        claim with it."""
        if self.made and self._gate is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.release()


def _holder(run_dir: Path, node_rank: int) -> str:
    try:
        info = json.loads(gate_path(run_dir, node_rank).read_text())
        return f"launcher pid {int(info['pid'])} on {info.get('host', 'this host')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a launcher"


def _live_message(run_dir: Path, node_rank: int, name: str) -> str:
    host = f" (host {node_rank})" if node_rank else ""
    return (f"run {name!r} is live in {run_dir}{host}, held by {_holder(run_dir, node_rank)}: watch it with "
            f"`trainyard console {name}`, stop it with `trainyard ctl {name} stop`, or start this one under "
            f"another name (--set run.name=...); a live run's folder is never shared or overwritten")


def _orphans_message(run_dir: Path, node_rank: int, name: str) -> str:
    pids = sorted(p.read_text().strip() for p in (run_dir / "pids").glob("rank*.pid") if p.is_file())
    which = f" (pids {', '.join(pids)})" if pids else ""
    return (f"workers of an earlier run {name!r} still hold {run_dir}{which}, though its launcher is gone; they "
            f"end within parallel.shutdown_timeout_s of it: wait, or end them, then start again")


def hold_as_worker(run_dir: Path, node_rank: int) -> None:
    """A worker's share of its host's claim, for its life. Refused (RuntimeError) only where a new launcher
    holds the folder, which it takes only once this worker's launcher is gone."""
    f = _open(lock_path(run_dir, node_rank))
    try:
        if not _try(f, fcntl.LOCK_SH):
            raise RuntimeError(f"{run_dir} was claimed by another run while this worker started; its launcher "
                               f"is gone")
    except OSError:
        f.close()
        raise
    _held.append(f)


def live(run_dir: Path, node_rank: int = 0) -> bool:
    """Whether a launcher or a worker of this host holds `run_dir` now (a probe: nothing is kept)."""
    for path in (gate_path(run_dir, node_rank), lock_path(run_dir, node_rank)):
        if not path.exists():
            continue
        try:
            with open(path, "a+") as f:
                if not _try(f, fcntl.LOCK_EX):   # held, shared or not
                    return True
        except OSError:
            continue
    return False


def remove_leftovers(name: str) -> list[Path]:
    """With the claim taken: the registry entries, sockets and token files of earlier runs called `name` on
    this machine whose process is gone (a run killed before it could remove them). Returns what was removed."""
    from engine.telemetry.protocol import RuntimeDirError, pid_alive, runtime_dir
    try:
        folder = runtime_dir()
    except (RuntimeDirError, OSError):
        return []
    removed = []
    for entry in folder.glob("*.json"):
        try:
            info = json.loads(entry.read_text())
            if info.get("run") != name or pid_alive(int(info.get("pid", 0))):
                continue
        except (OSError, ValueError, TypeError):
            continue
        for path in (info.get("socket"), info.get("token_file"), str(entry)):
            if path and Path(path).parent == folder and os.path.lexists(path):
                Path(path).unlink(missing_ok=True)
                removed.append(Path(path))
    return removed
