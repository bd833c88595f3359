"""What a command starts, it owns: child runs, each in a process session of its own, the temporary
folders made for them, and anything else that must be undone (an emulated cluster).

    with ChildRuns() as runs:
        work = runs.temp_dir("trainyard-bench-ps-")             # removed when the block ends
        proc = runs.start([sys.executable, "-m", "engine.cli", "run", CONFIG, "--headless", ...],
                          stderr=subprocess.PIPE, text=True)     # a subprocess.Popen, its own session
        proc.wait(timeout=600)
        code = runs.stop(proc)            # whatever of its session is still there: SIGINT, then SIGKILL
        runs.callback(down, "ty")         # called when the block ends, after the children are stopped

However the block ends (done, an exception, or SIGTERM, SIGINT or SIGHUP to this process) every child
still owned is stopped with its whole session and every folder removed. A child's session is stopped
as an operator would: SIGINT first (a run writes its final checkpoint on SIGINT), SIGKILL to what is
left STOP_GRACE_S later. A run that is meant to outlive this process is `release`d (the demo's detach).

While the block runs in the main thread, those three signals raise `Signalled` (a KeyboardInterrupt)
where the main thread is, so the command unwinds through its own `finally`s too; a second signal
is only noted. Once everything is stopped and removed, the handlers that were there before come
back and the first signal is raised again: the process then ends as it would have without us (dies
by SIGTERM or SIGHUP, a KeyboardInterrupt for SIGINT), only later and with nothing left behind. A
signal that was ignored before (nohup's SIGHUP) is left ignored. Off the main thread, where Python
cannot handle signals, only the ends of the block by return or exception stop the children.
Nothing here runs during training: only when a child starts or stops.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

# After SIGINT, how long a child's session gets to end on its own before SIGKILL. A run's launcher
# gives its workers parallel.shutdown_timeout_s (5 s by default) to write the final checkpoint, then
# kills them and exits: 8 s covers that with room for a slow machine, and keeps a stopped command
# under 15 s from the signal to the last process gone.
STOP_GRACE_S = 8.0
KILL_WAIT_S = 5.0        # after SIGKILL: how long to wait for the processes to be gone
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_S = 0.05


class Signalled(KeyboardInterrupt):
    """SIGTERM, SIGINT or SIGHUP arrived while child runs were owned; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def session_pids(sid: int) -> list[int]:
    """The live processes of process session `sid` (zombies left out), this one never among them."""
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except (OSError, psutil.Error):   # gone meanwhile, or not ours to see
            pass
    return found


def _signal_session(sid: int, sig: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _session_ended(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `proc` to exit (reaped) and its session to be empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None and not session_pids(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def _call_all(callbacks) -> None:
    """fn(*args) for each, every one called even when one raises; the first error is raised after."""
    error = None
    for fn, args in callbacks:
        try:
            fn(*args)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


def torch_cache_out_of_temp() -> None:
    """torch._dynamo, which every torch optimizer imports, makes `torchinductor_USER` in the system temp dir
    (TORCHINDUCTOR_CACHE_DIR's default): our processes, and the workers and runs they start, keep it in the
    runtime directory instead (the sockets' private folder). A cache dir set by the user is left as it is."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    from engine.telemetry.protocol import RuntimeDirError, runtime_dir
    try:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(runtime_dir() / "inductor")
    except (RuntimeDirError, OSError):
        pass   # the run goes on without the hub; torch's default then


# glibc's allocator, as its own environment variables set it (docs/training.md): allocations up to 32 MiB from the
# heap, and up to 256 MiB of it kept once freed, rather than its dynamic thresholds
HOST_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def steady_host_allocator(env: dict) -> dict:
    """`env` for processes that allocate on the host without a page fault per tensor (bench step's variants, all
    of them alike). glibc's dynamic thresholds hand a freed top of the heap back to the kernel and fault it in
    again at the next step, or not, by the luck of the heap's layout: at bench step's host size a worker took
    5,300 page faults a second (3-5% of its step) where another, identical but for a check before step 1, took
    15. Fixed thresholds, read by each process's allocator when it starts. Settings of the user's own are left
    as they are; only where the C library is glibc. Not set for runs: each process would keep up to 256 MiB it
    has freed (docs/training.md)."""
    import platform
    if platform.libc_ver()[0] == "glibc" and not any(key in env for key in HOST_ALLOCATOR):
        env.update(HOST_ALLOCATOR)
    return env


class ChildRuns:
    """The child runs, folders and clean-ups of one command (see the module's docstring)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.temp_dirs: list[Path] = []
        self._callbacks: list[tuple] = []
        self._previous: dict[int, object] = {}   # signal -> the handler before ours
        self._signalled: int | None = None        # the first signal that arrived
        self._hold = 0                           # > 0: a signal is noted, not raised (starting, unwinding)
        self._lock = threading.Lock()            # stop() from two threads (the demo's hang-up)

    def __enter__(self) -> "ChildRuns":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                previous = signal.getsignal(sig)
                if previous in (signal.SIG_IGN, None):   # ignored, or not set from Python: leave it be
                    continue
                self._previous[sig] = previous
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        first = self._signalled is None
        if first:
            self._signalled = signum
        if first and not self._hold:
            raise Signalled(signum)

    def start(self, argv: list[str], **popen_kw) -> subprocess.Popen:
        """subprocess.Popen(argv, **popen_kw) in a new process session, owned from this moment on."""
        self._hold += 1   # a signal now is raised once the child is ours to stop
        try:
            proc = subprocess.Popen(argv, start_new_session=True, **popen_kw)
            self.procs.append(proc)
        finally:
            self._hold -= 1
        if self._signalled is not None and not self._hold:
            raise Signalled(self._signalled)
        return proc

    def stop(self, proc: subprocess.Popen, finish_s: float = 0.0, grace_s: float | None = None) -> int | None:
        """End `proc` and every process of its session: wait `finish_s` for it to end by itself (a run told to
        stop), then SIGINT the session, and SIGKILL whatever is left `grace_s` (default STOP_GRACE_S) later.
        Returns its exit status (None only if a process outlived SIGKILL). An ended child costs one scan."""
        with self._lock:
            if not _session_ended(proc, finish_s):
                _signal_session(proc.pid, signal.SIGINT)
                if not _session_ended(proc, STOP_GRACE_S if grace_s is None else grace_s):
                    deadline = time.monotonic() + KILL_WAIT_S
                    while not _session_ended(proc, 0) and time.monotonic() < deadline:
                        _signal_session(proc.pid, signal.SIGKILL)   # again: a process forked meanwhile
                        time.sleep(_POLL_S)
            if proc in self.procs and _session_ended(proc, 0):
                self.procs.remove(proc)
            return proc.poll()

    def release(self, proc: subprocess.Popen) -> None:
        """Give `proc` up: it goes on when this block ends (a demo run the operator detached from)."""
        self.procs.remove(proc)

    def temp_dir(self, prefix: str, dir: str | Path | None = None) -> Path:
        """A new folder (tempfile.mkdtemp: private to this user) in the temp dir or `dir`, removed when the
        block ends."""
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
        self.temp_dirs.append(path)
        return path

    def callback(self, fn, *args) -> None:
        """fn(*args) when the block ends, after the children are stopped and the folders removed (the last
        registered first)."""
        self._callbacks.append((fn, args))

    def __exit__(self, *exc) -> None:
        self._hold += 1   # nothing interrupts the clean-up; a signal now is raised again after it
        try:
            for proc in reversed(list(self.procs)):   # stop() takes each out of the list
                self.stop(proc)
            for path in self.temp_dirs:
                shutil.rmtree(path, ignore_errors=True)
            _call_all(reversed(self._callbacks))
        finally:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            if self._signalled is not None:
                os.kill(os.getpid(), self._signalled)   # as it would have acted without us
