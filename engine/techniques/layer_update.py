"""One layer's optimizer update, on the device or the host (LayerUpdate), and the host executor: the
threads that run host updates while backward goes on (HostExecutor). The hybrid updater
(engine/techniques/hybrid.py) decides which side each layer's update runs on.

    update = LayerUpdate(name, index, params, optim_cfg)
    update.move("host")                        # fp32 master weights and state to host memory
    executor = HostExecutor(default_host_threads()); executor.submit(update)
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

from engine.config import OptimConfig
from engine.optim import make_optimizer
from engine.runtime.devices import tensor_bytes
from engine.timing import Clock


class LayerUpdate:
    """One layer's parameters (those this rank updates) and its optimizer, on one side at a time.

    On the host side the layer keeps fp32 master weights and gradient buffers in host memory, made
    once when it moves there and reused every step (pinned on a GPU, so the copies are DMA on a side
    stream of their own: gradients down, then weights up, while the compute stream goes on)."""

    def __init__(self, name: str, index: int, params: list[torch.nn.Parameter], optim_cfg: OptimConfig):
        self.name, self.index, self.params, self.cfg = name, index, params, optim_cfg
        self.side = "device"
        self.optimizer = make_optimizer(optim_cfg, params)
        self.master: list[torch.Tensor] | None = None   # host side: fp32 weights the host optimizer steps
        self.grads: list[torch.Tensor] | None = None    # host side: their gradient buffers
        self.done = threading.Event()   # set when this step's update has landed
        self.done.set()
        self.cuda = bool(params) and params[0].is_cuda
        self.stream = torch.cuda.Stream(params[0].device) if self.cuda else None   # the layer's copies
        self.landed = None              # CUDA: an event after the weights' copy up; the gate waits on it
        self.grads_final = None         # CUDA: an event after the gradients are final on the compute stream
        self.host_ms = self.copy_ms = 0.0   # the last measurement of each
        self.clock = Clock(params[0].device if params else None)   # the device step: events on a GPU
        self._device_marks = None   # (before, after) the last device step, read by device_ms
        self._device_ms = 0.0

    def move(self, side: str) -> None:
        """Carry the optimizer state (and, to the host, fp32 master weights) to `side`."""
        if side == self.side:
            return
        state = self.optimizer.state_dict()
        if side == "host":
            self.master = [self._host_copy(p.detach()) for p in self.params]
            self.grads = [self._host_copy(torch.zeros_like(p)) for p in self.params]   # filled in place
            self.optimizer = make_optimizer(self.cfg, self.master)
        else:
            self.wait_landed()
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
            self.master = self.grads = None
            self.optimizer = make_optimizer(self.cfg, self.params)
        self.optimizer.load_state_dict(state)   # casts the state to the new side's device and dtype
        self.side = side

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=torch.float32, pin_memory=self.cuda)
        out.copy_(t)
        return out

    def refresh_master(self) -> None:
        """The device weights changed outside an update (a checkpoint was loaded): copy them down."""
        if self.master is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    m.copy_(p.detach())

    def step_device(self) -> None:
        t0 = self.clock.mark()
        self.optimizer.step()
        self._zero_grads()
        self._device_marks = (t0, self.clock.mark())

    @property
    def device_ms(self) -> float:
        """The last device step's time, on the device's clock (waiting for its work to have run)."""
        if self._device_marks is not None:
            self._device_ms, self._device_marks = self.clock.ms(*self._device_marks), None
        return self._device_ms

    def device_ms_known(self) -> float:
        """The latest device step's time that has run, without waiting (telemetry: on a GPU the step
        just queued may still be running, and then the one before it is reported)."""
        if self._device_marks is not None and self.clock.done(self._device_marks[1]):
            return self.device_ms
        return self._device_ms

    def mark_grads_final(self) -> None:
        """CUDA, when the layer is dispatched to the host: what the compute stream has queued so far
        (its gradients among it) must land before the copy down reads them."""
        if self.cuda:
            self.grads_final = torch.cuda.Event()
            self.grads_final.record(torch.cuda.current_stream(self.params[0].device))

    @torch.no_grad()
    def step_host(self) -> None:
        t0 = time.perf_counter()
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.grads_final)
                self._grads_down(non_blocking=True)
                down = torch.cuda.Event()
                down.record(self.stream)
            down.synchronize()   # this layer's copy only: the host step reads what it brought
        else:
            self._grads_down(non_blocking=False)
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        if self.cuda:   # weights up and gradients zeroed on the side stream; the gate waits on `landed`
            with torch.cuda.stream(self.stream):
                for p, m in zip(self.params, self.master):
                    p.copy_(m, non_blocking=True)
                self._zero_grads()
                self.landed = torch.cuda.Event()
                self.landed.record(self.stream)
        else:
            for p, m in zip(self.params, self.master):
                p.copy_(m)
            self._zero_grads()
        t3 = time.perf_counter()
        self.host_ms, self.copy_ms = (t2 - t1) * 1000, ((t1 - t0) + (t3 - t2)) * 1000

    def _grads_down(self, non_blocking: bool) -> None:
        """Each gradient into its host buffer; a parameter without one is left alone by the step."""
        for p, m, buffer in zip(self.params, self.master, self.grads):
            m.grad = None if p.grad is None else buffer.copy_(p.grad, non_blocking=non_blocking)

    def wait_landed(self) -> None:
        """The compute stream goes on only after this layer's weights are back (CUDA; a no-op on the CPU,
        where the copy up is done when the update is)."""
        if self.landed is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(self.landed)
            self.landed = None

    def _zero_grads(self) -> None:
        for p in self.params:   # in place: strategies keep gradients as views into their buffers
            if p.grad is not None:
                p.grad.zero_()

    def state_bytes(self) -> int:
        return sum(tensor_bytes(v) for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))

    def host_bytes(self) -> int:
        if self.side == "device":
            return 0
        return self.state_bytes() + sum(tensor_bytes(t) for t in self.master + self.grads)


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

    def submit(self, update: LayerUpdate) -> None:
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
