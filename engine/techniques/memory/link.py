"""The host link: copies between the device and host memory, off the compute stream.

    link = HostLink(torch.device("cpu"), pace_gbps=5.0)   # the CPU: a thread per direction
    link.submit("out", fn)                            # fn runs on the link's "out" thread, in order
    host = link.copy("out", device_buf)               # on a link thread: a host copy, landed on return
    link.flush("out"); link.close()

    link = StreamLink(torch.device("cuda", 0))        # a GPU: copies issued by the thread that needs them
    host, event = link.copy_out(device_buf)           # on the "out" side stream, after the kernels so far
    link.done(event)                                  # landed? (never blocks)
    back, event = link.copy_in(host); link.use(event, back)   # the compute stream waits for it, on the GPU
    gbps = measure_link_gbps(device)                  # the device-to-host rate the plan assumes

On the CPU host and "device" are the same memory: a copy is a memcpy on a link thread, paced to
`host_link_gbps` when that is set (an emulated PCIe link). On a GPU no Python thread waits for a
copy: each is queued on its direction's side CUDA stream into pinned memory with a CUDA event
(`CudaCopies`), so copies run behind the compute stream (stream_swap.py books them). Host buffers
come from a pool kept across steps. This module knows nothing of layers or the ledger, and imports
only torch.
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
    """Copies between the "device" and host memory on the CPU, off the compute thread: one thread per
    direction (a real link is full duplex), each working through its queue in order, each copy a
    memcpy paced to `pace_gbps` when given."""

    def __init__(self, device: torch.device, pace_gbps: float | None = None):
        self.device = device
        self.pace_bytes_per_s = pace_gbps * 1e9 if pace_gbps else None
        self._queues = {"out": queue.Queue(), "in": queue.Queue()}
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"trainyard-host-link-{d}", daemon=True)
                         for d, q in self._queues.items()]
        self.pool = HostBufferPool(pinned=False)
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


class CudaCopies:
    """The CUDA calls of a StreamLink: a side stream per direction, an event per copy. (Tests prove the
    StreamLink's logic on the CPU with a stand-in that has these methods.)"""

    pinned = True

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {d: torch.cuda.Stream(device) for d in ("out", "in")}

    def copy(self, direction: str, src: torch.Tensor, dst: torch.Tensor | None = None):
        """Queue a copy of `src` on `direction`'s side stream (into `dst`, else a new device buffer);
        returns (dst, its event). A copy out starts after the kernels queued so far on the current
        (compute) stream, which wrote `src`; a copy in reads a host buffer already landed."""
        stream = self.streams[direction]
        if direction == "out":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if dst is None:   # allocated on the side stream: `use` hands it to the compute stream
                dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return dst, event

    def done(self, event) -> bool:
        return event.query()

    def block(self, event) -> None:
        event.synchronize()

    def use(self, event, tensor: torch.Tensor) -> None:
        """The current (compute) stream waits for the copy, on the GPU; the host does not."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        tensor.record_stream(compute)


class StreamLink:
    """Copies between a GPU and pinned host memory, issued by the thread that needs them (the forward's
    pack, the backward's prefetch and unpack): no Python thread waits for a copy to land. `copies` is
    the CUDA calls (CudaCopies) or a stand-in with its methods."""

    def __init__(self, device: torch.device, copies=None):
        self.device = device
        self.copies = copies if copies is not None else CudaCopies(device)
        self.pool = HostBufferPool(pinned=self.copies.pinned)

    def copy_out(self, src: torch.Tensor):
        """(a pool buffer the copy lands in, its event)."""
        return self.copies.copy("out", src, self.pool.take(src.numel()))

    def copy_in(self, host: torch.Tensor):
        """(a new device buffer the copy lands in, its event)."""
        return self.copies.copy("in", host)

    def done(self, event) -> bool:
        return self.copies.done(event)

    def block(self, event) -> None:
        self.copies.block(event)

    def use(self, event, tensor: torch.Tensor) -> None:
        self.copies.use(event, tensor)

    def close(self) -> None:
        pass   # nothing runs on a thread of its own; a copy in flight finishes on its stream


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
