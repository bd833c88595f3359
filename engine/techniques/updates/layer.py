"""One layer's optimizer update, on the device or the host (LayerUpdate); the threads that run host updates
are host.py's. LayerUpdates (engine/techniques/updates/updater.py) decides which side each update runs on.

    update = LayerUpdate(name, index, params, optim_cfg)
    update.move("host")                        # fp32 master weights and state to host memory
"""

from __future__ import annotations

import threading
import time

import torch

from engine.config import OptimConfig
from engine.training.optim import make_optimizer, step
from engine.runtime.devices import tensor_bytes
from engine.training.timing import Clock


class LayerUpdate:
    """One layer's parameters (those this rank updates) and its optimizer, on one side at a time.

    The optimizer always steps fp32 weights. With fp32 parameters on the device side those are the
    parameters themselves; with narrower working weights (`precision.params = "bf16"`) they are an fp32
    master copy beside them, kept where the update runs, and each update widens the gradient, steps the
    master and writes it back narrowed (engine/training/precision.py says which dtype is where).

    On the host side the layer keeps the fp32 master weights and gradient buffers in host memory, made
    once when it moves there and reused every step (pinned on a GPU, so the copies are DMA on a side
    stream of their own: gradients down, then weights up, while the compute stream goes on). The link
    carries the working dtype both ways: bf16 gradients down and bf16 weights up when the parameters are
    bf16, half the bytes of fp32 (`link_bytes()`)."""

    def __init__(self, name: str, index: int, params: list[torch.nn.Parameter], optim_cfg: OptimConfig):
        self.name, self.index, self.params, self.cfg = name, index, params, optim_cfg
        self.side = "device"
        # bf16 working weights: the update runs on an fp32 master (on the device while the side is)
        self.wide = bool(params) and params[0].dtype != torch.float32
        self.master: list[torch.Tensor] | None = [p.detach().float() for p in params] if self.wide else None
        self.optimizer = make_optimizer(optim_cfg, self.master if self.wide else params)
        self.grads: list[torch.Tensor] | None = None    # host side: gradients as they come down (working dtype)
        self.grads32: list[torch.Tensor] | None = None  # host side, bf16 working weights: widened for the step
        self.up: list[torch.Tensor] | None = None       # host side, bf16 working weights: narrowed for the link
        self.done = threading.Event()   # set when this step's update has landed
        self.done.set()
        self.cuda = bool(params) and params[0].is_cuda
        self.stream = torch.cuda.Stream(params[0].device) if self.cuda else None   # the layer's copies
        self.landed = None              # CUDA: an event after the weights' copy up; the gate waits on it
        self.grads_final = None         # CUDA: an event after the gradients are final on the compute stream
        self.host_ms = self.copy_ms = 0.0   # the last measurement of each
        self.clock = Clock(params[0].device if params else None)   # the device step: events on a GPU
        self._device_marks = None   # (before, after) the last device step, read by device_ms
        self._device_share = 1.0    # of a step run with others' in one launch: this layer's part by elements
        self.elements = sum(p.numel() for p in params)   # what that part is taken by
        self._device_ms = 0.0
        # clipping and skipping (engine/techniques/step_guard.py): a guarded update keeps a copy of what its
        # step changes until the global gradient norm says whether the step stands (undo, redo)
        self.guard = False          # this step's update speculates (set by the hybrid updater each step)
        self.device_copy = False    # on the device side it would keep a rollback copy there (the planners' figure)
        self._snap: list[torch.Tensor] | None = None   # the weights it steps, then its state tensors
        self._snap_layout: list | None = None          # per optimizer parameter: its state's non-tensor values
        self.speculated = False                        # stepped this step, not settled yet
        # a device update's gradients freed after it, not zeroed in place (the next backward then writes them
        # afresh rather than adding to zeros: a read and a write of every gradient less, and their memory free
        # until then); set by a strategy whose gradients are no views into its buffers (a world of one's ddp),
        # called with the parameters whose gradients went (the ledger's count)
        self.release_grads = None

    def move(self, side: str) -> None:
        """Carry the optimizer state and the fp32 master weights to `side`."""
        if side == self.side:
            return
        self._snap = self._snap_layout = None   # a rollback copy lives on its side: the next guarded step makes one
        state = self.optimizer.state_dict()
        if side == "host":
            weights = self.master if self.wide else [p.detach() for p in self.params]
            self.master = [self._host_copy(w, torch.float32) for w in weights]
            self.grads = [self._host_copy(torch.zeros_like(p), p.dtype) for p in self.params]   # filled in place
            if self.wide:
                self.grads32 = [torch.zeros_like(m) for m in self.master]
                self.up = [self._host_copy(p.detach(), p.dtype) for p in self.params]
            self.optimizer = make_optimizer(self.cfg, self.master)
        else:
            self.wait_landed()
            with torch.no_grad():
                if self.wide:
                    self.master = [m.to(self.params[0].device) for m in self.master]
                else:
                    for p, m in zip(self.params, self.master):
                        p.copy_(m)
                    self.master = None
            self.grads = self.grads32 = self.up = None
            self.optimizer = make_optimizer(self.cfg, self.master if self.wide else self.params)
        self.optimizer.load_state_dict(state)   # casts the state to the new side's device and dtype
        self.side = side

    def _host_copy(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype, pin_memory=self.cuda)
        out.copy_(t)
        return out

    def refresh_master(self) -> None:
        """The device weights changed outside an update (fp32 weights loaded from a checkpoint): copy them
        to the master. (bf16 working weights take their master from the checkpoint: load_weights.)"""
        if self.master is not None and not self.wide:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    m.copy_(p.detach())

    @torch.no_grad()
    def load_weights(self, values: list[torch.Tensor]) -> None:
        """The weights from a checkpoint (fp32: the master where there is one): into the master and the
        working copy alike, at a step boundary."""
        self.wait_landed()
        for i, (p, v) in enumerate(zip(self.params, values)):
            p.copy_(v)
            if self.master is not None:
                self.master[i].copy_(v)

    def weights(self) -> list[torch.Tensor]:
        """The weights as the update keeps them: the fp32 master where there is one (for checkpoints)."""
        return list(self.master) if self.master is not None else [p.detach() for p in self.params]

    @torch.no_grad()
    def step_device(self) -> None:
        t0 = self.clock.mark()
        if self.guard:   # its gradients stay until the step is settled: a redo steps on them again
            self._save()
        self._optimizer_step_device()
        if not self.guard:
            self.grads_done()
        self.device_marks(t0, self.clock.mark())

    def device_marks(self, t0, t1, share: float = 1.0) -> None:
        """The device step ran from mark t0 to t1 (`share`: this layer's part of a launch with others')."""
        self._device_marks, self._device_share = (t0, t1), share

    def grads_done(self) -> None:
        if self.release_grads is not None:   # nothing holds a view of them: freed, as zero_grad(set_to_none)
            for p in self.params:
                p.grad = None
            self.release_grads(self.params)
        else:
            self._zero_grads()

    @property
    def joins(self) -> bool:   # may step in one launch with others' (step_device_together): no copy, no master
        return not self.guard and not self.wide and bool(self.params)

    def _optimizer_step_device(self) -> None:
        if self.wide:   # widen each gradient for the step, narrow the master back into the working weights
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
            step(self.optimizer)
            for p, m in zip(self.params, self.master):
                m.grad = None
                p.copy_(m)
        else:
            step(self.optimizer)

    @property
    def device_ms(self) -> float:
        """The last device step's time, on the device's clock (waiting for its work to have run); of a step run
        with others' in one launch, its share by elements."""
        if self._device_marks is not None:
            self._device_ms, self._device_marks = self.clock.ms(*self._device_marks) * self._device_share, None
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
        self._had_grad = [p.grad is not None for p in self.params]
        if self.guard:   # the gradients stay in their host buffers for a redo
            self._save()
        t1 = time.perf_counter()
        self._optimizer_step_host()
        t2 = time.perf_counter()
        self._weights_up()
        t3 = time.perf_counter()
        self.host_ms, self.copy_ms = (t2 - t1) * 1000, ((t1 - t0) + (t3 - t2)) * 1000

    def _optimizer_step_host(self) -> None:
        for had, m, came, wide in zip(self._had_grad, self.master, self.grads, self.grads32 or self.grads):
            # the step runs on fp32: bf16 gradients are widened on the host, after the link
            m.grad = None if not had else (wide.copy_(came) if self.wide else came)
        step(self.optimizer)

    def _weights_up(self) -> None:
        """The host's master weights up into the working weights (narrowed on the host, so the link carries
        bf16); the device's gradients zeroed."""
        if self.cuda:   # weights up and gradients zeroed on the side stream; the gate waits on `landed`
            with torch.cuda.stream(self.stream):
                for p, u in zip(self.params, self._narrowed()):
                    p.copy_(u, non_blocking=True)
                self._zero_grads()
                self.landed = torch.cuda.Event()
                self.landed.record(self.stream)
        else:
            self._host_weights_up()
            self._zero_grads()

    def _narrowed(self) -> list[torch.Tensor]:
        """The master weights as the link carries them: narrowed on the host into `up` under bf16 weights."""
        return [u.copy_(m) for u, m in zip(self.up, self.master)] if self.wide else self.master

    def _host_weights_up(self) -> None:
        """The master weights up into the working weights, now, on this thread."""
        for p, u in zip(self.params, self._narrowed()):
            p.copy_(u)

    # --- a guarded step: kept until the global norm decides (engine/techniques/step_guard.py) ----------------
    def grad_sq(self) -> torch.Tensor | None:
        """The sum of squares of this update's gradients (fp64, on their device), before its step: its part of
        the global gradient norm. None without gradients."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).double().square().sum()

    def _stepped(self) -> tuple[list[torch.Tensor], list, list[torch.Tensor]]:
        """What a step changes: the weights it steps (the master where there is one), each optimizer
        parameter's state (its non-tensor values, or None without state), and the state's tensors in order."""
        weights = list(self.master) if self.master is not None else [p.detach() for p in self.params]
        layout, tensors = [], []
        for p in self.optimizer.param_groups[0]["params"]:
            state = self.optimizer.state.get(p)
            if not state:
                layout.append(None)
                continue
            layout.append({k: v for k, v in state.items() if not torch.is_tensor(v)})
            tensors += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
        return weights, layout, tensors

    @torch.no_grad()
    def _save(self) -> None:
        weights, layout, tensors = self._stepped()
        now = weights + tensors
        if self._snap is None or len(self._snap) != len(now) or any(
                a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in zip(self._snap, now)):
            self._snap = [t.detach().clone() for t in now]   # once (and when the state first appears or moves)
        else:
            torch._foreach_copy_(self._snap, now)
        self._snap_layout = layout
        self.speculated = True

    @torch.no_grad()
    def _restore(self) -> None:
        """The weights and optimizer state as they were before this step's update (exactly: copies)."""
        params = self.optimizer.param_groups[0]["params"]
        for p, kept in zip(params, self._snap_layout):
            if kept is None:   # the step made this state: it goes
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p].update(kept)
        weights, _, tensors = self._stepped()
        torch._foreach_copy_(weights + tensors, self._snap[:len(weights) + len(tensors)])
        if self.master is not None:   # the working weights from the restored master
            if self.side == "host":
                self._host_weights_up()
            else:
                for p, m in zip(self.params, self.master):
                    p.copy_(m)

    @torch.no_grad()
    def undo(self) -> None:
        """A skipped step: as if this update never ran (or it did not run: clip_mode "wait"); its gradients zeroed.
        (Its host update has landed.)"""
        if self.speculated:
            self._restore()
        self._zero_grads()
        self.speculated = False

    @torch.no_grad()
    def redo(self, coef: float) -> None:
        """A clipped step: undone, and run again on the gradient times `coef` (on the same side, on this
        thread; its host update has landed). The same operations as a step that waited for the norm: the
        gradient scaled in place in its own dtype, then the optimizer step."""
        self._restore()
        if self.side == "host":
            for had, came in zip(self._had_grad, self.grads):
                if had:
                    came.mul_(coef)
            self._optimizer_step_host()
            self._host_weights_up()
        else:
            self.scale_grads(coef)
            self._optimizer_step_device()
        self._zero_grads()
        self.speculated = False

    def settle(self) -> None:
        """The step stands: a device update's gradients, kept for a redo, are zeroed now."""
        if self.speculated and self.side == "device":
            self._zero_grads()
        self.speculated = False

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef)

    def rollback_bytes(self) -> int:
        """The copy a speculating update keeps on its side (weights and optimizer state), as allocated."""
        return sum(tensor_bytes(t) for t in self._snap) if self._snap is not None else 0

    def _copy_bytes(self) -> int:
        """What a rollback copy takes: the weights the update steps and its optimizer state."""
        weights = self.master if self.master is not None else self.params
        return sum(tensor_bytes(w) for w in weights) + self.state_bytes()

    def _grads_down(self, non_blocking: bool) -> None:
        """Each gradient into its host buffer, in its own dtype (a parameter without one is left alone by the
        step)."""
        for p, buffer in zip(self.params, self.grads):
            if p.grad is not None:
                buffer.copy_(p.grad, non_blocking=non_blocking)

    def link_bytes(self) -> int:
        """What a host update of this step moves over the host link: its gradients down and its weights up,
        both in the working dtype (bf16 weights: half the bytes of fp32)."""
        return sum(tensor_bytes(p.grad) for p in self.params if p.grad is not None) + \
            sum(tensor_bytes(p) for p in self.params)

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

    def stepped_state_bytes(self) -> int:
        """The optimizer state this update keeps once it has stepped (AdamW: two fp32 moments a weight), from one
        step of its own optimizer on meta tensors (no memory), by the ledger's rule; and a guarded update's
        rollback copy on the device beside it (before step 1 there is no state to count: engine/run/fit.py)."""
        weights = self.master if self.master is not None else self.params
        meta = [torch.nn.Parameter(torch.empty_like(w, device="meta", dtype=torch.float32)) for w in weights]
        for m in meta:
            m.grad = torch.empty_like(m)
        optimizer = make_optimizer(self.cfg, meta, kernel="foreach")
        with torch.no_grad():
            optimizer.step()
        state = sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        return state + (sum(tensor_bytes(m) for m in meta) + state if self.device_copy else 0)

    def device_bytes(self) -> int:
        """What this update holds on the device while placed there: its optimizer state, beside bf16 working
        weights the fp32 master, and a guarded update's rollback copy (what placing it on the host frees; the
        planner's figure)."""
        return self.state_bytes() + (sum(tensor_bytes(m) for m in self.master) if self.wide else 0) + \
            (self._copy_bytes() if self.device_copy else 0)

    def master_bytes(self) -> int:
        """The fp32 master's bytes on the device (bf16 working weights, device side); 0 otherwise."""
        return sum(tensor_bytes(m) for m in self.master) if self.wide and self.side == "device" else 0

    def host_bytes(self) -> int:
        if self.side == "device":
            return 0
        return self.state_bytes() + self.rollback_bytes() + \
            sum(tensor_bytes(t) for t in self.master + self.grads + (self.grads32 or []) + (self.up or []))
