"""Whether keep and all-device fit a rank's device, estimated before step 1, and `auto` settled on them where they do
(docs/memory.md, docs/hybrid.md: "Where everything fits").

    estimate = estimate_fit(cfg, model, x, y, device, strategy, loss_fn)   # x, y: rank_batch(cfg, data, ...)
    events = settle_auto(cfg, model, data, device, memory, strategy, loss_fn, first_step)   # Worker, before step 1

The estimate is what the rank's ledger would count at its steady peak with every layer on keep and every update
on the device: its parameters and their gradients, the fp32 masters of bf16 working weights, the optimizer state
(a step of each layer's own optimizer on meta tensors: AdamW's two fp32 moments), the inputs its blocks share
(masks, rotary tables) and keep's saved activations, counted by the ledger's byte rule (each storage once,
parameters and shared inputs not) through saved-tensor hooks around a forward and the loss on a copy of the model
whose tensors hold no memory (torch's FakeTensorMode on the rank's device, so that bf16 autocast saves the dtypes
it saves in training), at the rank's share of the batch, a micro-batch per micro-batch in flight. `FIT_MARGIN`
more is asked of the capacity for what the ledger does not count (temporaries, the allocator's rounding).

Where it fits, `memory.policy = "auto"` keeps every layer and `update.placement = "auto"` puts every update on the
device before step 1: no swap start, no measured step, no trial. Where only the optimizer state does not fit, the
activations keep from step 1 and the update trial runs. Otherwise the trials run as before. An `auto_fit` event
says which, with the figures.

Imports engine.training (data, precision), engine.models.layers, engine.runtime (devices, events) and the strategies'
registry (engine.strategies.specs: a pipeline's micro-batches); the memory policy, the updates and the strategy are
handed in.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import asdict, dataclass

import torch

from engine.config import format_size
from engine.models.layers import SharedInputs
from engine.runtime.devices import tensor_bytes
from engine.runtime.events import Event
from engine.strategies.specs import STRATEGIES
from engine.training.data import batch_for
from engine.training.precision import compute_in

FIT_MARGIN = 0.25   # asked beyond the estimate: what no ledger counts (temporaries, the allocator's rounding)


@dataclass(frozen=True)
class FitEstimate:
    """A rank's steady peak under keep and all-device, by the ledger's categories, in bytes."""

    parameters: int
    gradients: int
    master: int
    optimizer_state: int   # the updates' state (and rollback copies) were they all on the device
    inputs: int
    activations: int       # keep's, every micro-batch in flight
    margin: float = FIT_MARGIN

    def total(self, with_state: bool = True) -> int:
        return (self.parameters + self.gradients + self.master + self.inputs + self.activations
                + (self.optimizer_state if with_state else 0))

    def need(self, with_state: bool = True) -> int:
        """The capacity asked: the estimate and its margin."""
        return int(self.total(with_state) * (1 + self.margin))

    def fits(self, capacity_bytes: int, with_state: bool = True) -> bool:
        return self.need(with_state) <= capacity_bytes


def rank_batch(cfg, data, strategy, first_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's share of the first step's batch, as the step loop takes it (engine/run/worker.py)."""
    rank, world = _rank_world()
    share = strategy.parallel_groups(rank, world).share(rank)
    return batch_for(data, first_step, cfg.data.batch_size, cfg.run.seed, *share)


def estimate_fit(cfg, model, x: torch.Tensor, y: torch.Tensor, device, strategy, loss_fn) -> FitEstimate:
    """This rank's FitEstimate at the batch (x, y) (see the module's docstring). Raises what the copy's forward
    raises (a model that reads its values in forward cannot run without them)."""
    owned = set(strategy.owned_layers())
    flight = max(1, strategy.in_flight())
    spec = STRATEGIES[cfg.parallel.strategy]
    # a pipeline's micro-batches: of the batch's parts, each replica's (its data-parallel group's share)
    shares = len(strategy.parallel_groups(*_rank_world()).data)
    micro = 1 if spec.per_rank else max(1, spec.split(cfg)[0] // shares)
    size = max(1, x.shape[0] // max(1, micro))
    by_layer, loss_bytes, inputs = saved_bytes(model, x[:size], y[:size], loss_fn, cfg.precision,
                                               device.torch_device)
    last = model.names[-1] in owned
    activations = flight * (sum(b for n, b in by_layer.items() if n in owned) + (loss_bytes if last else 0))
    ledger = device.ledger
    ledger.refresh()
    tracked = strategy.tracked_module()
    grads = sum(tensor_bytes(p) for p in tracked.parameters() if p.requires_grad)
    return FitEstimate(parameters=ledger.bytes["parameters"], gradients=grads + ledger.extra.get("gradients", 0),
                       master=ledger.bytes["master"], optimizer_state=strategy.updater.device_state_bytes(),
                       inputs=inputs, activations=activations)


def _rank_world() -> tuple[int, int]:
    """(rank, world size) of the compute group, whose groups say the share of the global batch this rank takes."""
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def saved_bytes(model, x: torch.Tensor, y: torch.Tensor, loss_fn, precision, torch_device,
                outputs: dict[str, int] | None = None) -> tuple[dict[str, int], int, int]:
    """(bytes each layer saves for its backward, bytes the loss saves, bytes of the blocks' shared inputs) for one
    forward of `model` on (x, y), by the ledger's rule, on a copy whose tensors hold no memory. A model on the meta
    device is copied onto `torch_device` (`trainyard plan`); `outputs`, where given, gets each layer's output
    bytes (what recompute keeps of the next layer: its input)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(model, mode, torch_device)
    params = {p.untyped_storage()._cdata for p in fake.parameters()}
    shared = [m for m in fake.modules() if isinstance(m, SharedInputs)]
    seen: set[int] = set()
    by_layer: dict[str, int] = {}
    current = [""]

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in params or key in seen or t.device.type != torch_device.type:
            return t
        if any(key == s.untyped_storage()._cdata for m in shared for s in m.tensors()):
            return t   # counted under "inputs"
        seen.add(key)
        by_layer[current[0]] = by_layer.get(current[0], 0) + storage.nbytes()
        return t

    handles = []
    for name, layer in zip(fake.names, fake.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, name=name: current.__setitem__(0, name)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, "")))
        if outputs is not None:
            handles.append(layer.register_forward_hook(
                lambda m, a, o, name=name: outputs.__setitem__(name, tensor_bytes(o) if torch.is_tensor(o) else 0)))
    try:
        with mode, compute_in(precision, torch_device), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fx = mode.from_tensor(x).to(torch_device)
            fy = mode.from_tensor(y).to(torch_device)
            out = fake(fx)
            loss_fn(out, fy)
        inputs = sum({s.untyped_storage()._cdata: s.untyped_storage().nbytes()
                      for m in shared for s in m.tensors()}.values())
    finally:
        for h in handles:
            h.remove()
    return by_layer, by_layer.pop("", 0), inputs


def _fake_copy(model, mode, torch_device):
    """A copy of `model` whose parameters and buffers are fake tensors of the same shapes, dtypes and devices (no
    memory; a meta tensor's on `torch_device`), without the forwards others installed on its layers (the memory
    policy's, an emulated slow layer's): the plain forward is what keep runs."""
    from torch._subclasses.fake_tensor import FakeTensor
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        fake = FakeTensor(mode, t.detach(), torch_device) if t.is_meta else mode.from_tensor(t.detach())
        memo[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else fake
    for m in model.modules():
        forward = m.__dict__.get("forward")
        if isinstance(forward, functools.partial):
            memo[id(forward)] = _PLAIN
        for p in m._parameters.values():
            if p is not None and p.grad is not None:
                memo[id(p.grad)] = None
    fake = copy.deepcopy(model, memo)
    for m in fake.modules():
        if m.__dict__.get("forward") is _PLAIN:
            del m.__dict__["forward"]
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        m._backward_hooks.clear()
    return fake


_PLAIN = object()   # a wrapped forward, dropped from the copy


def settle_auto(cfg, model, data, device, memory, strategy, loss_fn, first_step: int = 0) -> list[Event]:
    """Before step 1: `auto` on keep and all-device where the estimate fits the capacity (the memory policy's
    `settle_keep`, the updates' `settle_device`), or keep alone where only the optimizer state does not fit.
    The `auto_fit` event says what was decided, with the figures; [] where no `auto` is asked."""
    memory_auto = cfg.memory.policy == "auto"
    update_auto = cfg.update.placement == "auto"
    if not (memory_auto or update_auto) or (update_auto and not memory_auto and cfg.memory.policy != "keep"):
        return []
    capacity = device.ledger.capacity_bytes
    try:
        est = estimate_fit(cfg, model, *rank_batch(cfg, data, strategy, first_step), device, strategy, loss_fn)
    except Exception as e:   # a model the copy cannot run: the trials measure it, as before
        return [Event("auto_fit", dict(capacity_bytes=capacity, memory="measured" if memory_auto else cfg.memory.policy,
                                       placement="trial" if update_auto else "as configured",
                                       reason=f"not estimated: {type(e).__name__}: {e}"[:300]),
                      note=f"auto: keep and all-device not estimated ({type(e).__name__}); the trials measure")]
    fits = est.fits(capacity)
    keep = memory_auto and (fits or (update_auto and est.fits(capacity, with_state=False)))
    if keep:
        memory.settle_keep(f"keep fits: estimated {format_size(est.need(fits))} with a {est.margin:.0%} margin, "
                           f"of {format_size(capacity)}", est.need(fits))
    if update_auto and fits:
        strategy.updater.settle_device()
    decided_memory = "keep" if keep else "measured" if memory_auto else cfg.memory.policy
    decided_placement = ("device" if fits else "trial") if update_auto else "as configured"
    said = {"keep": "every layer keeps", "measured": "activations measured and planned"}.get(
        decided_memory, f"memory.policy {decided_memory}")
    said_updates = {"device": "every update on the device", "trial": "update trial"}.get(decided_placement, "")
    return [Event("auto_fit", dict(estimate_bytes=est.total(), need_bytes=est.need(), capacity_bytes=capacity,
                                   margin=est.margin, parts=asdict(est), memory=decided_memory,
                                   placement=decided_placement),
                  note=f"auto: estimated {format_size(est.total())} (+{est.margin:.0%}: {format_size(est.need())}) "
                       f"under keep and all-device, of {format_size(capacity)}: "
                       + "; ".join(s for s in (said, said_updates) if s) + " from step 1")]
