"""Workers as forks of one server process that has imported torch and what its starter names (the launcher: the
engine, engine/run/preload.py).

    forkserver.start([PRELOAD])   # trainyard run: as soon as the config is read, before this process imports torch
    launch.start_method()         # "forkserver" where it can run, else "spawn" (launch() starts it if need be)

A worker spawned afresh spends 2.8 s of CPU before it does anything (torch 1.4 s, torch._dynamo 1.4 s more:
torch's optimizers import it on their first construction); forked from the server it starts at once, and the
server's own imports overlap the launcher's. Only where no GPU is visible (no /dev/nvidia* device node): a
process forked after anything touched the CUDA driver cannot use CUDA, so with a GPU every worker is spawned.

A launcher may instead fork its workers from a server another process started and shares: `TRAINYARD_FORK_SERVER`
(SHARED) holds what `share()` returns, "PID:SOCKET", and `start()` joins that server while it runs. The test
suite shares its own so that each run it starts saves the server's imports (4-5 s of CPU; docs/architecture.md).
Either way a worker takes from its launcher, as it is unpickled, what a spawned one would have (Inherit): the
launcher's environment, and from a shared server, which is not the launcher's child, its stdout and stderr.

The server's socket lives in the runtime directory (the sockets' private folder), in `forkserver-PID/`,
removed when the launcher ends; where the launcher died without that (SIGKILL), the server removes it as it
exits (engine/processes/forkserver_exit.py), and failing that the next launcher's start. Nothing goes to the system temp dir. Imports no torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

PREFIX = "forkserver-"
SHARED = "TRAINYARD_FORK_SERVER"
_started = False
_shared = False   # joined a server another process started (SHARED)


def gpu_visible() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*"))


# what the server imports whoever starts it (torch 1.4 s a process, torch._dynamo 1.4 s more)
TORCH = ("torch", "torch._dynamo", "torch.distributed")
# what a floor above asks every fork server of this process to import too: engine.run adds the engine's preload
# (engine/run/preload.py) when it is imported, so a pool started first forks workers that have it as well
PRELOADS: list[str] = []
# the server's socket: ROOT/forkserver-PID/pymp-XXXXXXXX/listener-XXXXXXXX, within a Unix socket path's bytes
SOCKET_TAIL = len("/forkserver-4194304/pymp-xxxxxxxx/listener-xxxxxxxx")


def _root():
    """The runtime directory, or None where a GPU is visible, that directory is not usable, or so deep that
    the server's socket path would be too long (then workers are spawned, as with a GPU)."""
    if gpu_visible():
        return None
    from engine.telemetry.endpoint import SOCKET_PATH_MAX
    from engine.telemetry.protocol import RuntimeDirError, runtime_dir
    try:
        root = runtime_dir()
    except (RuntimeDirError, OSError):
        return None
    return root if len(os.fsencode(str(root))) + SOCKET_TAIL <= SOCKET_PATH_MAX else None


def usable() -> bool:
    return _started or _root() is not None


def model_modules(model) -> list[str]:
    """transformers' modules that define `model`'s layers, for the server to import once rather than every
    worker when it loads the model (transformers costs 4.5 s a process here). A user's own modules are left
    to the workers: importing them may do anything, and the server must not fail."""
    names = {type(m).__module__ for m in model.modules()} if model is not None else set()
    return sorted(n for n in names if n.startswith("transformers."))


def config_modules(cfg) -> list[str]:
    """transformers' modules a `[model] name = "hf"` run's workers import (its config's model_type's)."""
    import json
    if cfg.model.name != "hf":
        return []
    path = cfg.model.hf_config or os.path.join(cfg.model.hf_weights, "config.json")
    try:
        with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
            kind = str(json.load(f).get("model_type", ""))
    except (OSError, ValueError):
        return []
    return [f"transformers.models.{kind}.modeling_{kind}"] if kind.isidentifier() else []


def start(preload: list[str] | tuple = ()) -> bool:
    """Start the fork server unless a GPU is visible or the runtime directory is not usable; True if it runs.
    `preload`: more modules for it to import (model_modules); one that fails to import is left to the workers."""
    global _started
    if _started:
        return True
    if os.environ.get(SHARED) and _join(os.environ[SHARED]):
        _started = True
        return True
    root = _root()
    if root is None:
        return False
    from engine.telemetry.protocol import pid_alive
    for old in root.glob(PREFIX + "*"):   # a launcher killed before it could remove its own
        pid = old.name[len(PREFIX):]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = root / f"{PREFIX}{os.getpid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    folder.chmod(0o700)   # one that was there already too (docs/protocol.md)
    import multiprocessing
    from multiprocessing import forkserver, util
    # removed at exit after multiprocessing has removed its pymp-* folder in it (priority -100 runs first)
    util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=-101)
    saved, tempfile.tempdir = tempfile.tempdir, str(folder)   # where multiprocessing makes the socket's folder
    try:
        first = ["engine.processes.forkserver_exit"]   # its folder goes with it once the launcher is gone
        multiprocessing.set_forkserver_preload(list(dict.fromkeys([*first, *TORCH, *PRELOADS, *preload])))
        forkserver.ensure_running()
    except OSError:
        return False   # launch() then spawns its workers
    finally:
        tempfile.tempdir = saved
    _started = True
    return True


def share() -> str:
    """This process's fork server (started if need be), as TRAINYARD_FORK_SERVER names it for the launchers it
    starts: "PID:SOCKET"; '' where none runs. The server ends with this process."""
    from multiprocessing import forkserver
    if not start():
        return ""
    server = forkserver._forkserver
    return f"{server._forkserver_pid}:{server._forkserver_address}"


def stop(timeout_s: float = 30.0) -> None:
    """End the fork server this process started, now rather than at its exit: it leaves once its imports are
    done and no fork of it holds its liveness pipe; after `timeout_s` it is killed. (The test session removes its
    temp dir after this: a server still importing torch._dynamo would make its cache folder there again.)"""
    import signal
    import time
    from multiprocessing import forkserver
    server = forkserver._forkserver
    if _shared or server._forkserver_pid is None:
        return
    pid, server._forkserver_pid = server._forkserver_pid, None
    os.close(server._forkserver_alive_fd)
    deadline = time.monotonic() + timeout_s
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.05)


def _join(value: str) -> bool:
    """Fork this process's workers from the running server `value` names (share()); False where it is gone, in
    other namespaces, or where this Python's multiprocessing keeps other state than 3.11's (3.14's authenticates
    its clients): then this process starts its own."""
    from multiprocessing import forkserver, resource_tracker
    from engine.telemetry.protocol import pid_alive
    pid, _, address = value.partition(":")
    server = forkserver._forkserver
    known = all(hasattr(server, name) for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"))
    if not (known and not hasattr(server, "_forkserver_authkey") and pid.isdigit() and pid_alive(int(pid))
            and os.path.exists(address) and _same_namespaces(int(pid))) or gpu_visible():
        return False

    def ensure_running():   # not a child of this process: waitpid cannot tell, its pid can
        resource_tracker.ensure_running()
        if not pid_alive(int(pid)):
            raise OSError(f"the shared fork server (pid {pid}, {SHARED}) is gone")

    global _shared
    alive_r, alive_w = os.pipe()   # the workers' liveness fd for servers of their own: this process's, not its
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, int(pid)
    server.ensure_running = ensure_running
    _shared = True
    return True


def _same_namespaces(pid: int) -> bool:
    """Whether process `pid` shares this one's network and mount namespaces: a launcher on an emulated host
    (engine/processes/cluster.py) forks its workers inside that host, from a server of its own."""
    try:
        return all(os.stat(f"/proc/{pid}/ns/{ns}").st_ino == os.stat(f"/proc/self/ns/{ns}").st_ino
                   for ns in ("net", "mnt"))
    except OSError:
        return False


class Inherit:
    """What a worker forked from a fork server takes from the process that starts it, as a spawned one would
    have it: its environment, and from a shared server its stdout and stderr. Passed among the worker's
    arguments, it acts as it is unpickled, before anything of the worker runs (torch's agent sets RANK and the
    rest after it)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return _inherit, (dict(os.environ), *((DupFd(1), DupFd(2)) if _shared else ()))


def _inherit(environ: dict, *stdio) -> None:
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None   # the server's, where it asked: the environment's TMPDIR now
    for fd, dup in zip((1, 2), stdio):
        new = dup.detach()
        os.dup2(new, fd)
        os.close(new)
