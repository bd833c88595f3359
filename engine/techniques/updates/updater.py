"""Technique 3: LayerUpdates, every strategy's optimizer: each layer's update on the device or on the host.

    updater = LayerUpdates(model, params_by_layer(model), optim_cfg, device, update_cfg)   # engine/models/
    updater.begin_step()                      # before forward
    updater.params_reduced(params)            # any thread: these gradients are final
    updater.run_device_ready()                # compute thread: device updates whose gradients are final
    updater.end_backward(group)               # compute thread: the rest is dispatched
    decision = updater.validate(group)        # clipping and skipping: the global norm decides (step_guard.py)
    updater.wait_host()                       # every host update of the step has landed

Every layer that has parameters gets its own optimizer (the same class and settings for every layer, so the
math is that of one optimizer over the whole model). A layer's update runs on one side at a time:

- **device**: inline on the compute thread, as soon as the layer's gradients are final (the strategy says
  when: DDP when the all-reduce of their bucket completes, sharded when the owner has summed them);
- **host**: on the host executor, a thread of its own with fp32 master copies of the layer's weights and its
  optimizer state in host memory: the gradients are copied down, the host optimizer steps, the weights are
  copied back up. It runs while the backward of earlier layers goes on. A forward pre-hook on the layer waits
  for it before the next forward uses the weights (the gate).

Both sides run the same optimizer on the same fp32 values, so the parameters are the same whichever side
updated them. With a step guard on (`optim.clip_grad_norm`, `skip_nonfinite`), each layer's part of the global
gradient norm is taken as it is dispatched, and `clip_mode` says what the updates do until the norm is known:
`speculate` runs host updates (and, with `speculate_device`, device ones) at once, each keeping a copy of what
it changes (on its own side: the device's copy in the ledger, the host's in host memory), and `validate` undoes
or redoes them and releases the others; `wait` holds them all until `end_backward` has decided. After a
clipped or skipped step the next ones wait, until SPECULATE_AFTER steps in a row have stood
(docs/training.md). Moving a layer (the plan, or `set-placement`) moves its optimizer state with it; the
ledger counts only device-side state.

On the CPU the "device" is the worker's compute thread and the "host" the executor thread, on another core;
the copies are memory copies. Nothing assumes a speed ratio: `placement = "auto"` measures both sides for
`update.profile_steps` trial steps and plans from what it measured (`self.trial`, trial.py). One layer's
update on either side: layer.py; the host executor's threads: host.py; a checkpoint's side: state.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from engine.config import OptimConfig, UpdateConfig
from engine.training.optim import set_lr
from engine.runtime import emulate
from engine.runtime.devices import LedgerDevice
from engine.techniques.updates.host import HostExecutor, default_host_threads
from engine.techniques.updates.layer import LayerUpdate
from engine.techniques.updates.together import step_device_together   # device updates in one launch
from engine.techniques.step_guard import GuardDecision, StepGuard
from engine.techniques.updates.state import UpdateCheckpoint
from engine.techniques.updates.trial import PlacementTrial

SIDES = ("device", "host")
SPECULATE_AFTER = 10   # clip_mode "speculate": steps that must stand in a row before updates speculate again


class LayerUpdates:
    def __init__(self, model, params_by_layer: dict[int, list[torch.nn.Parameter]], optim_cfg: OptimConfig,
                 device: LedgerDevice, cfg: UpdateConfig, clip_mode: str | None = None, speculate_device: bool = True,
                 release_grads=None):
        self.model, self.device, self.cfg, self.optim_cfg = model, device, cfg, optim_cfg
        self.release_grads = release_grads   # a device update frees its gradients, telling it (LayerUpdate.grads_done)
        self.guard = StepGuard(optim_cfg, clip_mode)
        self.mode = self.guard.mode   # this step's: "speculate" turns to "wait" after a clipped or skipped step
        self._stood = SPECULATE_AFTER  # steps in a row that neither clipped nor skipped (before the last begun)
        # whether device-side updates speculate too: where they would otherwise wait at the step's end (a pipeline
        # stage, in the bubble before the last stage's backward ends); ddp's run inline during backward either
        # way, so they wait for the norm and keep no copy on the device
        self.speculate_device = speculate_device
        self.decision = GuardDecision()   # the last step's
        self._parts: list[torch.Tensor] = []   # this step's partial sums of squares, one per dispatched update
        self._held: list[LayerUpdate] = []     # clip_mode "wait": dispatched, waiting for the decision
        self._decided = False
        self.lr = optim_cfg.lr   # the step loop sets each step's (engine/training/optim.py lr_at); updates take it when dispatched
        self.updates = {i: self._new_update(i, ps) for i, ps in params_by_layer.items() if ps}
        self.by_name = {u.name: u for u in self.updates.values()}
        self.layer_of = {id(p): u for u in self.updates.values() for p in u.params}
        self.executor: HostExecutor | None = None
        self._lock = threading.Lock()
        self._missing: dict[int, int] = {}
        self._dispatched: set[int] = set()
        self._device_ready: deque[LayerUpdate] = deque()
        self._device_ran: list[LayerUpdate] = []   # this step's device updates
        self._gate_s, self._link_bytes = 0.0, 0   # this step's wait in gates, host updates' bytes over the link
        self.trial = PlacementTrial(model, device, cfg, self.updates)   # auto: the trial, the plan and its check
        self.checkpoint = UpdateCheckpoint(self.updates)   # what a checkpoint reads and restores
        # a host-placed layer's gate: its forward waits for its update to land (a device update has landed
        # before the next forward begins: no hook on a layer that no host update touches)
        self._gate_handles: dict[int, object] = {}
        if isinstance(cfg.placement, dict):
            unknown = sorted(set(cfg.placement) - set(model.names))
            if unknown:
                raise ValueError(f"update.placement names unknown layer {unknown[0]!r}; layers are "
                                 f"{', '.join(model.names)}")
            self.place({n: s for n, s in cfg.placement.items() if n in self.by_name})
        elif cfg.placement == "host":
            self.place(dict.fromkeys(self.by_name, "host"))

    def _gates(self) -> None:
        """A gate on each host-placed layer, none on the others (after any change of placement or layers)."""
        for index, u in self.updates.items():
            if u.side == "host" and index not in self._gate_handles:
                self._gate_handles[index] = self.model.layers[index].register_forward_pre_hook(self._gate(index))
            elif u.side != "host" and index in self._gate_handles:
                self._gate_handles.pop(index).remove()

    def _new_update(self, index: int, params: list[torch.nn.Parameter]) -> LayerUpdate:
        u = LayerUpdate(self.model.names[index], index, params, self.optim_cfg)
        u.guard = self._speculates(u)
        u.device_copy = self.guard.on and self.guard.mode == "speculate" and self.speculate_device
        u.release_grads = self.release_grads
        return u

    def _speculates(self, u: LayerUpdate) -> bool:
        """This step, `u` runs before the norm is known and keeps a copy (else, with a guard on, it waits)."""
        return self.guard.on and self.mode == "speculate" and (u.side == "host" or self.speculate_device)

    # --- placement ---------------------------------------------------------------------------
    def placement(self) -> dict[str, str]:
        return {u.name: u.side for u in self.updates.values()}

    def place(self, placement: dict[str, str]) -> None:
        """Move layers to the sides named (at a step boundary: nothing in flight)."""
        self.wait_host()
        for name, side in placement.items():
            if side not in SIDES:
                raise ValueError(f"placement of {name!r} must be 'device' or 'host', got {side!r}")
            if name in self.by_name:
                self.by_name[name].move(side)
        if any(u.side == "host" for u in self.updates.values()) and self.executor is None:
            self.executor = HostExecutor(self.cfg.host_threads or default_host_threads())
        self._gates()
        self.device.ledger.refresh()

    def set_placement(self, layer: str, side: str) -> None:
        """An operator's `set-placement`: this layer stays there (a later plan does not move it)."""
        if layer not in self.model.names:
            raise ValueError(f"unknown layer {layer!r}")
        self.trial.stop()   # the operator decides: no trial, plan or plan's check goes over it
        self.place({layer: side})

    # --- layers that change hands (pipeline migration) ------------------------------------------
    def drop_layer(self, index: int) -> dict:
        """Stop updating layer `index` here; its optimizer state and side, for whoever takes it over."""
        if index not in self.updates:   # a layer without parameters has no update
            return {"state": None, "side": "device"}
        u = self.updates.pop(index)
        u.done.wait()   # a host update of the layer still in flight lands first
        self._raise_host_error()
        del self.by_name[u.name]
        for p in u.params:
            self.layer_of.pop(id(p), None)
        handle = self._gate_handles.pop(index, None)
        if handle is not None:
            handle.remove()
        self._missing.pop(index, None)
        return {"state": u.optimizer.state_dict(), "side": u.side,
                "master": [m.detach().cpu() for m in u.master] if u.wide else None}

    def add_layer(self, index: int, params: list[torch.nn.Parameter], state: dict | None = None,
                  side: str = "device", master: list[torch.Tensor] | None = None) -> None:
        """Update layer `index` here from now on, continuing from `state` (an optimizer state_dict) and,
        with bf16 working weights, from `master` (the fp32 master weights drop_layer gave)."""
        if not params:
            return
        u = self._new_update(index, params)
        if master is not None:
            u.load_weights(master)
        if state is not None:
            u.optimizer.load_state_dict(state)
        self.updates[index] = u
        self.by_name[u.name] = u
        self.layer_of.update({id(p): u for p in params})
        self._missing[index] = len(params)
        if side == "host":
            self.place({u.name: "host"})

    # --- the ledger's view: device-side optimizer state ----------------------------------------
    @property
    def state(self) -> dict:
        """Per-parameter optimizer state of the device-placed layers (what the ledger counts), by parameter id."""
        return {id(p): s for u in self.updates.values() if u.side == "device" for p, s in u.optimizer.state.items()}

    def host_bytes(self) -> int:
        return sum(u.host_bytes() for u in self.updates.values())

    def master_bytes(self) -> int:
        """fp32 master weights on the device (bf16 working weights; the ledger's `master`)."""
        return sum(u.master_bytes() for u in self.updates.values())

    def rollback_bytes(self) -> int:
        """The device-side updates' rollback copies (clip_mode "speculate"; counted with the optimizer state)."""
        return sum(u.rollback_bytes() for u in self.updates.values() if u.side == "device")

    # --- what a checkpoint holds (state.py), read and restored once every host update has landed -----
    def state_by_name(self, names: dict[int, str], copy: bool = True) -> dict[str, dict]:
        self.wait_host()
        return self.checkpoint.state_by_name(names, copy)

    def load_state_by_name(self, state: dict[str, dict], names: dict[int, str]) -> None:
        self.wait_host()
        self.checkpoint.load_state_by_name(state, names)

    def load_weights_by_name(self, read, names: dict[int, str]) -> None:
        self.wait_host()
        self.checkpoint.load_weights_by_name(read, names)

    def master_of(self) -> dict[int, torch.Tensor]:
        self.wait_host()
        return self.checkpoint.master_of()

    def weights_state(self, module: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
        self.wait_host()
        return self.checkpoint.weights_state(module, copy)

    # --- a step ------------------------------------------------------------------------------
    def settle_device(self) -> None:
        """`auto` before step 1, where every update's state was estimated to fit beside keep's peak
        (engine/run/fit.py): every update on the device, no trial, as `placement = "device"` runs."""
        self.trial.left = 0
        self.place(dict.fromkeys(self.by_name, "device"))

    def device_state_bytes(self) -> int:
        """The optimizer state (and rollback copies) every update of this rank would keep on the device once
        stepped: what all-device adds to the device (engine/run/fit.py)."""
        return sum(u.stepped_state_bytes() for u in self.updates.values())

    def begin_step(self) -> None:
        self._parts, self._held, self._decided = [], [], False
        # auto: a trial step's side, a plan just made, or the placement a checked plan goes back to
        moved = self.trial.begin_step(self.executor.threads if self.executor is not None else 1)
        if moved is not None:
            self.place(moved)
        self.trial.measure()   # a trial step: profiled from here
        if self.guard.on and self.guard.mode == "speculate":
            # speculation pays off when the step stands; after a step that clipped (or skipped), the next ones
            # are likely to clip too (a loss spike, early training at clip 1.0, a norm hovering at the threshold),
            # so they wait for the norm instead of redoing every layer, and speculate again once
            # SPECULATE_AFTER steps in a row have stood
            last = self.decision
            self._stood = 0 if last.clipped or last.skipped else self._stood + 1
            self.mode = "speculate" if self._stood >= SPECULATE_AFTER else "wait"
        for u in self.updates.values():   # after any placement of this step: a host update speculates
            u.guard = self._speculates(u)
        self._missing = {i: len(u.params) for i, u in self.updates.items()}
        self._dispatched, self._gate_s, self._device_ran, self._link_bytes = set(), 0.0, [], 0
        self.trial.start_clock()

    def params_reduced(self, params) -> None:
        """Called from any thread: these parameters' gradients are final for this step."""
        ready = []
        with self._lock:
            for p in params:
                u = self.layer_of.get(id(p))
                if u is None:
                    continue
                self._missing[u.index] -= 1
                if self._missing[u.index] == 0:
                    ready.append(u)
        for u in ready:
            self._dispatch(u)

    def _dispatch(self, u: LayerUpdate) -> None:
        with self._lock:
            if u.index in self._dispatched:
                return
            self._dispatched.add(u.index)
        set_lr(u.optimizer, self.lr)   # this step's (the step loop sets `lr`); its last update has landed
        # its gradients are final: its part of the global norm, read outside the lock other layers' dispatches take
        part = u.grad_sq() if self.guard.on else None
        with self._lock:
            if part is not None:
                self._parts.append(part)
            if self.guard.on and not u.guard and not self._decided:   # it waits for the norm
                self._held.append(u)
                return
            if u.side == "host":
                self._link_bytes += u.link_bytes()
        self._submit(u)

    def _submit(self, u: LayerUpdate) -> None:
        if u.side == "host":
            self.executor.submit(u)
            emulate.reached("host_update")   # emulate.kill_at: handed to the host thread, not landed
        else:
            self._device_ready.append(u)

    def run_device_ready(self) -> None:
        """Compute thread: the device updates whose gradients are final, inline, now (those that `join`: in one
        launch, together.py)."""
        while self._device_ready:
            ready = [self._device_ready.popleft() for _ in range(len(self._device_ready))]
            if len(together := [u for u in ready if u.joins]) > 1:
                step_device_together(together)
            for u in ready if len(together) < 2 else [u for u in ready if not u.joins]:
                u.step_device()
            self._device_ran.extend(ready)   # their time is read on the device's clock, in timings()

    def end_backward(self, group=None) -> None:
        """Compute thread, after backward: dispatch layers not dispatched yet (all layers, in backward
        order, when the strategy reports nothing itself) and run the device ones. clip_mode "wait": the
        step guard decides first, over `group` (step_guard.py), and the held updates go with its decision."""
        rows = self.trial.layer_rows()
        for index in sorted(self.updates, reverse=True):
            self._dispatch(self.updates[index])
        if self.guard.on and self.mode == "wait":
            self._release(self._decide(group))
        self.run_device_ready()
        if self.trial.left:
            self.wait_host()   # the step's host updates have landed: their times are the trial's
            self.trial.record(rows)

    def _decide(self, group) -> GuardDecision:
        self._decided = True
        self.decision = self.guard.decide(self._parts, group, self.device.torch_device)
        self._parts = []
        return self.decision

    def _release(self, decision: GuardDecision) -> None:
        """clip_mode "wait": the held updates run on the clipped gradient, or not at all on a skip."""
        held, self._held = self._held, []
        for u in held:
            if decision.skipped:
                u.undo()   # nothing ran: its gradients zeroed, the next step starts from none
                continue
            if decision.clipped:
                u.scale_grads(decision.coef)
            if u.side == "host":
                self._link_bytes += u.link_bytes()
            self._submit(u)

    def validate(self, group=None) -> GuardDecision:
        """Compute thread, after end_backward (and any gradients exchanged after it, before weights leave):
        clip_mode "speculate": the step guard decides over `group`, and every update that ran is settled,
        redone on the clipped gradient or undone (after its host update has landed). The step's GuardDecision."""
        if not (self.guard.on and self.mode == "speculate"):
            return self.decision
        decision = self._decide(group)
        ran = [u for u in self.updates.values() if u.index in self._dispatched and u.guard]
        self._release(decision)   # those that waited (device updates that do not speculate)
        self.run_device_ready()
        if decision.clipped or decision.skipped:
            self.wait_host()
            for u in ran:
                if decision.skipped:
                    u.undo()
                else:
                    u.redo(decision.coef)
            decision.redone_layers = len(ran)
        else:
            for u in ran:
                u.settle()
        return decision

    def _gate(self, index: int):
        return lambda module, args: self.wait_layer(index)

    def wait_layer(self, index: int) -> None:
        """Layer `index`'s update of this step has landed (a host one may still be in flight)."""
        u = self.updates.get(index)
        if u is None:
            return
        if not u.done.is_set():
            t0 = time.perf_counter()
            u.done.wait()
            self._gate_s += time.perf_counter() - t0
        self._raise_host_error()
        u.wait_landed()

    def wait_host(self) -> float:
        """Every host update dispatched so far has landed; the seconds waited."""
        t0 = time.perf_counter()
        for u in self.updates.values():
            u.done.wait()
            u.wait_landed()
        self._raise_host_error()
        return time.perf_counter() - t0

    def _raise_host_error(self) -> None:
        if self.executor is not None and self.executor.error is not None:
            error, self.executor.error = self.executor.error, None
            raise RuntimeError(f"a host update failed: {type(error).__name__}: {error}") from error

    def timings(self) -> dict:
        busy = 0.0
        if self.executor is not None:
            busy, self.executor.busy_s = self.executor.busy_s * 1000, 0.0
        device_ms = sum(u.device_ms_known() for u in self._device_ran)   # no wait for the GPU here
        link, self._link_bytes = self._link_bytes, 0
        return {"update_device_ms": device_ms, "host_busy_ms": busy, "host_gate_ms": self._gate_s * 1000,
                "host_bytes": self.host_bytes(), "host_link_bytes": link}

    def close(self) -> None:
        if self.executor is not None:
            self.wait_host()
            self.executor.close()
            self.executor = None
