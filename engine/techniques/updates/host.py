"""The host executor: the threads that run host updates while backward goes on, each layer as soon as a
thread is free.

    executor = HostExecutor(default_host_threads()); executor.submit(update)   # a LayerUpdate (layer.py)

Imports nothing of the engine.
"""

from __future__ import annotations

import os
import queue
import threading
import time


def default_host_threads() -> int:
    """The cores this worker may use for host updates: its share of the host's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class HostExecutor:
    """`threads` threads that run host updates, each layer as soon as a thread is free (layers are
    independent: each has its own optimizer, and its gate waits for it alone)."""

    def __init__(self, threads: int = 1):
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.busy_s = 0.0   # summed over the threads
        self._lock = threading.Lock()
        self.threads = max(1, threads)   # the host's servers in the update plan's cost model
        self._threads = [threading.Thread(target=self._run, name=f"trainyard-host-updates-{i}", daemon=True)
                         for i in range(self.threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, update) -> None:
        update.done.clear()
        update.mark_grads_final()
        self._queue.put(update)

    def _run(self) -> None:
        while True:
            update = self._queue.get()
            if update is None:
                return
            t0 = time.perf_counter()
            try:
                update.step_host()
            except BaseException as e:   # noqa: BLE001 - reported on the compute thread at the gate
                self.error = e
            finally:
                with self._lock:
                    self.busy_s += time.perf_counter() - t0
                update.done.set()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
