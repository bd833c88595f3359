"""The host link: copies between the device and host memory, off the compute thread.

    link = HostLink(torch.device("cuda", 0))          # on the CPU: HostLink(device, pace_gbps=5.0)
    link.submit("out", fn)                            # fn runs on the link's "out" thread, in order
    host = link.copy("out", device_buf)               # on a link thread: a host copy, landed on return
    link.flush("out"); link.close()
    gbps = measure_link_gbps(device)                  # the device-to-host rate the plan assumes

One thread per direction (a real link is full duplex). On a GPU the copies run on a side CUDA stream
into pinned host buffers, each waiting on its own CUDA event. On the CPU host and "device" are the
same memory: a copy is a memcpy, paced to `host_link_gbps` when that is set (an emulated PCIe link);
unset, the rate is measured (and on the CPU not paced). Host buffers come from a pool kept across
steps. Swapper (swap.py) is what submits the copies; this module knows nothing of layers or the
ledger, and imports only torch.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

FETCH_TIMEOUT_S = 60         # a swapped storage not back by then is an error, not a hang


class HostBufferPool:
    """Host buffers for swapped storages, kept and reused across steps: a step saves storages of the
    same sizes again and again, and a new buffer costs page faults on the CPU and a cudaHostAlloc (page
    locking, milliseconds) on a GPU. Buffers are pinned on a GPU, so copies are DMA on a side stream.
    The pool holds at most what was in use at once (each buffer returns when its storage comes back
    or is freed)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.made = self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.reused += 1
                return free.pop()
            self.made += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class HostLink:
    """Copies between the device and host memory, off the compute thread: one thread per direction
    (a real link is full duplex), each working through its queue in order. On CUDA the copies run on a
    side stream into pinned memory; on the CPU they are memcpys, paced to `pace_gbps` when given."""

    def __init__(self, device: torch.device, pace_gbps: float | None = None):
        self.device = device
        self.pace_bytes_per_s = pace_gbps * 1e9 if pace_gbps else None
        self.cuda = device.type == "cuda"
        self._queues = {"out": queue.Queue(), "in": queue.Queue()}
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"trainyard-host-link-{d}", daemon=True)
                         for d, q in self._queues.items()]
        self._streams = {d: torch.cuda.Stream(device) for d in self._queues} if self.cuda else {}
        self.pool = HostBufferPool(pinned=self.cuda)
        self.error: Exception | None = None   # the last copy that failed on a link thread
        for t in self._threads:
            t.start()

    def submit(self, direction: str, fn: Callable[[], None]) -> None:
        self._queues[direction].put(fn)

    def flush(self, direction: str = "out", timeout: float = FETCH_TIMEOUT_S) -> None:
        """Wait until every copy queued so far in `direction` has landed."""
        done = threading.Event()
        self.submit(direction, done.set)
        if not done.wait(timeout):
            raise RuntimeError(f"the host link's {direction} queue did not drain within {timeout} s")

    def copy(self, direction: str, src: torch.Tensor) -> torch.Tensor:
        """On a link thread: a copy of the uint8 buffer `src` on the other side, complete on return. A copy
        out lands in a buffer of the pool (give it back when done with it)."""
        t0 = time.perf_counter()
        if self.cuda:
            stream, compute = self._streams[direction], torch.cuda.default_stream(self.device)
            # the copy out must not read before the kernels that wrote `src` have run
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                if direction == "out":
                    dst = self.pool.take(src.numel())
                else:
                    dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
                dst.copy_(src, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
            landed.synchronize()   # this copy only: the link thread books it when it has landed
            if direction == "in":   # allocated on the side stream, used by backward on the compute stream
                dst.record_stream(compute)
            return dst
        if direction == "out":
            dst = self.pool.take(src.numel())
            dst.copy_(src)
        else:
            dst = src.clone()
        if self.pace_bytes_per_s:
            rest = src.numel() / self.pace_bytes_per_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return dst

    def _loop(self, q: queue.Queue) -> None:
        while True:
            fn = q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception as e:   # a copy that failed: said by the backward that waits for it
                self.error = e

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)


def measure_link_gbps(device: torch.device, nbytes: int = 16 * 2**20, repeats: int = 5) -> float:
    """Device-to-host copy rate in GB/s: the median of a few copies of `nbytes` into a buffer already
    touched (the first copy, which also pays for page faults, is not counted)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    rates = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            rates.append(nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return sorted(rates)[len(rates) // 2]
