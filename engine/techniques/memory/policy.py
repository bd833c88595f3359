"""ActivationPolicy: the per-layer activation policy of the layers this rank runs, as the step loop sees it.

    policy = ActivationPolicy(model, device, cfg.memory, owned=lambda: model.names, in_flight=lambda: 1)
    policy.before_step(step)           # arms the measurement when a plan is due
    loss = strategy.train_step(x, y)   # runs inside device.ledger.saved_activations()
    plan = policy.after_step(step)     # a Plan when one was made (auto), else None
    policy.set("block0.mlp", "swap")   # an operator's choice: pinned, applies from the next step

Each layer of the LayerList runs through `ActivationPolicy._forward` (installed as the
layer's `forward`, so module hooks and state_dict keys are untouched):

- keep: the ledger's saved-tensor hooks count what autograd saves; it stays on the device.
- swap: the same hooks hand each saved storage to the Swapper (swap.py; on a GPU StreamSwapper,
  stream_swap.py), which sends it to host memory over the host link (link.py) and brings it back
  for the layer's backward; this module starts the prefetch of the nearest earlier swap layer when
  a layer's output gradient is ready.
- recompute: `torch.utils.checkpoint` (non-reentrant, RNG state preserved, so dropout
  draws the same mask): nothing the layer computes is saved, only its input, which
  the ledger counts until the layer's backward has run. While the forward is rerun in
  backward, the layer's activations are briefly back on the device; the ledger counts
  that moment in its peak.

`auto` starts with every layer on swap (measurable, and far under keep's peak from the first
step), measures the second step (measure.py) and plans after it (planner.py); a pipeline stage
plans again after its layers change. When the model refuses every plan, one step runs with every
free layer recomputed and its measured peak decides (the refusal floor, `_measured_floor`).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from engine.config import format_size
from engine.training.timing import Clock, tensors
from engine.techniques.memory.cost import POLICIES, ActivationCost, estimate
from engine.techniques.memory.link import HostLink, StreamLink, measure_link_gbps
from engine.techniques.memory.measure import Measure
from engine.techniques.memory.planner import Plan, PlanError, plan, round_up_mib
from engine.techniques.memory.room import Room
from engine.techniques.memory.stream_swap import StreamSwapper
from engine.techniques.memory.swap import SwapEntry, Swapper


class ActivationPolicy:
    """Applies, measures and (in `auto`) plans the per-layer policies of the layers this rank runs."""

    def __init__(self, model, device, cfg, owned: Callable[[], list[str]] | None = None,
                 in_flight: Callable[[], int] | None = None, copies=None, clock: Clock | None = None):
        self.model, self.device, self.cfg = model, device, cfg
        self.copies = copies   # a stand-in for the CUDA copy calls (tests): swap as on a GPU
        self.clock = clock or Clock(device.torch_device)   # times the measuring step on the device
        self.ledger = device.ledger
        self.names = list(model.names)
        self.owned = owned or (lambda: self.names)
        self.in_flight = in_flight or (lambda: 1)
        self.auto = cfg.policy == "auto"
        if isinstance(cfg.policy, dict):
            unknown = sorted(set(cfg.policy) - set(self.names))
            if unknown:
                raise ValueError(f"memory.policy names unknown layer {unknown[0]!r}; layers are "
                                 f"{', '.join(self.names)}")
            self.policy = {n: cfg.policy.get(n, "keep") for n in self.names}
        else:   # auto starts by swapping everything: far under keep's peak (backpressure), and measurable
            self.policy = dict.fromkeys(self.names, "swap" if self.auto else cfg.policy)
        self.pinned: dict[str, str] = {}
        self.provisional = set(self.names) if self.auto else set()   # swapped until measured and planned
        self.link_gbps = cfg.host_link_gbps
        self.link = None
        self.swapper = None
        self._ensure_link("swap" in self.policy.values())   # measures the link when no rate is given
        self.known: dict[str, ActivationCost] = {}     # measured costs, by layer
        self.plan: Plan | None = None
        self.plan_due = self.auto
        self._warm = False        # the run's first step is not measured (one-off costs)
        self._measure: Measure | None = None
        self._last_owned = list(self.owned())
        self._pass = (-1, None)   # (index of the last layer run, the last swap group of this forward pass)
        self.loss_bytes = 0       # saved outside any layer per micro-batch (the loss), as last measured
        self.last_error: PlanError | None = None
        self._model_error: PlanError | None = None   # the model's refusal, while a measured floor is due
        # a layer's own forward (an instance attribute of a user's layer is kept and restored on close)
        self._replaced = {i: layer.__dict__.get("forward") for i, layer in enumerate(model.layers)}
        for i, layer in enumerate(model.layers):
            forward = self._replaced[i] or type(layer).forward.__get__(layer)
            layer.forward = partial(self._forward, i, self.names[i], forward)

    def settle_keep(self, note: str, estimate_bytes: int) -> None:
        """`auto` before step 1, where keep was estimated to fit the capacity (engine/run/fit.py): every layer not
        pinned keeps, with no measured step and no link (nothing swaps), as `memory.policy = "keep"` runs. Layers
        that migrate in later are measured and planned as usual."""
        owned = list(self.owned())
        self.policy.update({n: "keep" for n in owned if n not in self.pinned})
        self.provisional -= set(owned)
        self.plan = Plan(policies={n: self.policy[n] for n in owned}, estimate_bytes=estimate_bytes,
                         capacity_bytes=self.ledger.capacity_bytes, planner=self.cfg.planner, budget_ms=0.0,
                         note=note)
        self.plan_due = False
        if self.link is not None and "swap" not in self.policy.values():   # no hook on every saved tensor
            self.link.close()
            self.link = self.swapper = self.ledger.swapper = None

    def _ensure_link(self, needed: bool) -> None:
        if needed and self.link is None:
            if not self.link_gbps:
                self.link_gbps = measure_link_gbps(self.device.torch_device)
            device = self.device.torch_device
            if device.type == "cuda" or self.copies is not None:   # copies on side streams, booked by event
                self.link = StreamLink(device, self.copies)
                self.swapper = self.ledger.swapper = StreamSwapper(self.ledger, self.link)
                self.swapper.clock = self.clock
            else:   # the CPU: a thread per direction, paced to host_link_gbps
                self.link = HostLink(device, self.cfg.host_link_gbps)
                self.swapper = self.ledger.swapper = Swapper(self.ledger, self.link)

    @property
    def link_bytes_per_ms(self) -> float:
        return self.link_gbps * 1e6

    # --- running a layer ---------------------------------------------------------------------------
    def _forward(self, index: int, name: str, forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        policy = self.policy[name]
        measure = self._measure
        waited = self.swapper.waited_s if measure is not None and self.swapper is not None else 0.0
        last, prev_group = self._pass
        if index <= last:      # a new forward pass (the next micro-batch)
            prev_group = None
        group = None
        ledger = self.ledger
        ledger.current_layer = name
        t0 = measure.clock.mark() if measure is not None else None
        try:
            if policy == "recompute":
                out = self._recompute(name, forward, args, kwargs)
            elif policy == "swap" and self.swapper is not None:
                group = []
                self.swapper.group = group
                try:
                    out = forward(*args, **kwargs)
                finally:
                    self.swapper.group = None
            else:
                out = forward(*args, **kwargs)
        finally:
            ledger.current_layer = None
        self._pass = (index, group if group else prev_group)
        if measure is None and not prev_group:   # the common case: nothing to time, nothing to prefetch
            return out
        first = next(iter(tensors(out)), None)
        if measure is not None:
            link_wait_s = self.swapper.waited_s - waited if self.swapper is not None else 0.0
            measure.forward_ran(name, t0, link_wait_s, args)
            if first is not None and first.requires_grad:
                measure.time_backward(name, first, args, self.swapper)
        if prev_group and first is not None and first.requires_grad:
            # this layer's backward is about to start: bring the previous swap layer's storages back
            first.register_hook(self._prefetcher(prev_group))
        return out

    def _prefetcher(self, group: list[SwapEntry]):
        def hook(grad):
            self.swapper.prefetch(group)
        return hook

    def _recompute(self, name: str, forward, args, kwargs):
        ledger = self.ledger
        # the inputs stay alive for the rerun: count them, until the layer's backward has run
        held = [ledger.pack_tensor(t) for t in tensors(args)]
        cost = self.known.get(name)

        def rerun_context():
            @contextlib.contextmanager
            def noting():
                yield
                if cost is not None:   # the rerun's activations, alive until this layer's backward ends
                    ledger.note_transient(cost.act_bytes)
            return contextlib.nullcontext(), noting()

        out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                         context_fn=rerun_context, **kwargs)
        first = next((t for t in tensors(out) if t.grad_fn is not None), None)
        if first is not None:   # the rerun has run once the layer's last operation has had its backward
            first.grad_fn.register_hook(lambda grad_inputs, grad_outputs: held.clear())
        return out

    # --- steps and plans ---------------------------------------------------------------------------
    def recomputes(self) -> bool:
        """Some layer this rank runs recomputes its forward in backward (a step that is not all useful work)."""
        return any(self.policy[n] == "recompute" for n in self.owned())

    def set(self, layer: str, policy: str) -> None:
        """An operator's choice (`set-policy`): it stays (an auto plan works around it) from the next step."""
        if layer not in self.policy:
            raise ValueError(f"no layer named {layer!r}; layers are {', '.join(self.names)}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._ensure_link(policy == "swap")
        self.policy[layer] = policy
        self.pinned[layer] = policy
        self.provisional.discard(layer)
        if self.auto:
            self.plan_due = True

    def before_step(self, step: int) -> None:
        owned = list(self.owned())
        if owned != self._last_owned:   # layers migrated in or out: plan again (auto)
            self._last_owned = owned
            for name in owned:
                if name not in self.known and name not in self.pinned and self.auto:
                    self.policy[name] = "swap"   # swapped (so within the capacity) until measured and planned
                    self.provisional.add(name)
            self.plan_due = self.plan_due or self.auto
        self._pass = (-1, None)
        # where every layer keeps its activations, the ledger may count a pipeline's micro-batch at once
        self.ledger.all_keep = all(self.policy[n] == "keep" for n in owned)
        if self.plan_due and self._warm:
            self.ledger.exact_due = True   # measured per layer: every saved tensor counted
            self._measure = Measure(self.clock)
            if self.swapper is not None:   # the compute stream's waits for the link, marked (a GPU)
                self.swapper.device_waits = []
            self.ledger.activations_by_layer = {}
            self.ledger.shared_bytes = {}
            self.ledger.reset_peak()

    def after_step(self, step: int) -> Plan | None:
        """After the step's train_step: a plan, when one was due and measured."""
        self._warm = True
        measure, self._measure = self._measure, None
        if measure is None:
            return None
        if self.swapper is not None:
            self.swapper.device_waits = None   # read through the marks the measure holds
        self.plan_due = False
        costs = measure.costs(self._last_owned, self.policy, self.known, self.ledger)
        owned = self._last_owned
        if self._model_error is not None:   # this step ran every free layer recomputed: the measured floor
            return self._measured_floor(owned)
        flight = self.in_flight()
        current = {n: self.policy[n] for n in owned}
        # what the stage holds besides its layers' saved activations: parameters, gradients, optimizer
        # state, and what is saved outside any layer (the loss), for every micro-batch in flight
        self.ledger.refresh()
        self.loss_bytes = self.ledger.activations_by_layer.get("", 0) // max(1, measure.passes())
        base = self._static_bytes() + flight * self.loss_bytes
        self.last_error = None
        replan = estimate(costs, current, base, flight, self.link_bytes_per_ms) >= self.ledger.capacity_bytes \
            or any(p == "recompute" and n not in self.pinned for n, p in current.items()) \
            or bool(self.provisional & set(owned)) or self.plan is None
        if not replan:
            return None
        self.plan_costs, self.plan_base = costs, base   # what the last plan (or refusal) was made from
        try:
            made = plan(costs, capacity_bytes=self.ledger.capacity_bytes, base_bytes=base, in_flight=flight,
                        link_bytes_per_ms=self.link_bytes_per_ms, planner=self.cfg.planner,
                        pinned={n: p for n, p in self.pinned.items() if n in owned})
        except PlanError as e:
            # the model's floor is a model: measure a step with every free layer recomputed before
            # refusing (on an H100 the model said 43.2 MiB where recompute trained at a 27.1 MiB peak)
            self._model_error = e
            free = [n for n in owned if n not in self.pinned]
            if all(self.policy[n] == "recompute" for n in free):
                return self._measured_floor(owned)   # this step was that one (after a migration planned ahead)
            self.policy.update(dict.fromkeys(free, "recompute"))
            self.plan_due = True
            return None
        self._ensure_link("swap" in made.policies.values())
        self.policy.update(made.policies)
        self.provisional -= set(made.policies)
        self.plan = made
        self.ledger.reset_peak()
        return made

    def room(self, layer_static: dict[str, int]) -> Room:
        """What this stage tells a rebalance check (room.py): its capacity, micro-batches in flight, the
        bytes it holds besides its layers (`layer_static`: each layer's weights, gradients and device
        optimizer state), and the measured costs and pinned policies of its layers."""
        self.ledger.refresh()
        extra = max(0, self._static_bytes() - sum(layer_static.values())) + self.in_flight() * self.loss_bytes
        return Room(capacity_bytes=self.ledger.capacity_bytes, in_flight=self.in_flight(), extra_bytes=extra,
                    costs=self.own_costs(), static=dict(layer_static),
                    pinned={n: p for n, p in self.pinned.items() if n in layer_static})

    def own_costs(self) -> dict[str, ActivationCost]:
        """The measured costs of the layers this rank runs (what a migration's target plans with)."""
        return {n: self.known[n] for n in self._last_owned if n in self.known}

    def plan_ahead(self, held: list[str], costs: dict[str, ActivationCost], arriving_bytes: int) -> Plan | None:
        """Before layers migrate (`auto`): plan the policies of every layer this rank holds during the
        migration step, its own and those arriving (`held`, in model order), from the costs measured where
        each ran, against the static bytes it will hold then: its own, plus `arriving_bytes` (the arriving
        layers' weights, gradients and optimizer state, from their sources). The arriving layers run with
        these policies from the step they arrive in, so the migration step stays within the capacity;
        the step after it measures and plans the new layout as usual. A layer never measured anywhere
        is recomputed. None (policies unchanged) when nothing can be planned: not `auto`."""
        if not self.auto:
            return None
        missing = [n for n in held if n not in costs and n not in self.pinned]
        known = [costs[n] for n in held if n in costs]
        self.ledger.refresh()
        flight = self.in_flight()
        base = self._static_bytes() + arriving_bytes
        pinned = {n: p for n, p in self.pinned.items() if n in held}
        pinned.update(dict.fromkeys(missing, "recompute"))
        try:
            made = plan(known, capacity_bytes=self.ledger.capacity_bytes, base_bytes=base, in_flight=flight,
                        link_bytes_per_ms=self.link_bytes_per_ms or 1.0, planner=self.cfg.planner,
                        pinned={n: p for n, p in pinned.items() if n in {c.name for c in known}})
        except PlanError:   # nothing fits the model: recompute every free layer, the least it can hold
            made = Plan(policies={c.name: pinned.get(c.name, "recompute") for c in known}, estimate_bytes=0,
                        capacity_bytes=self.ledger.capacity_bytes, planner=self.cfg.planner, budget_ms=0.0,
                        note="planned ahead of a migration: no plan fits the model; every free layer recomputed")
        policies = {**made.policies, **{n: "recompute" for n in missing}}
        self._ensure_link("swap" in policies.values())
        self.policy.update(policies)
        self.known.update({n: c for n, c in costs.items() if n in held})
        self.provisional -= set(policies)
        return made   # the step after the move sees its layers changed: measured and planned as always

    def _measured_floor(self, owned: list[str]) -> Plan | None:
        """After the step that recomputed every free layer: that is the plan if its measured peak fits;
        else the run is refused, naming the measured peak as the smallest capacity that fits."""
        model_error, self._model_error = self._model_error, None
        measured, capacity = self.ledger.peak_bytes, self.ledger.capacity_bytes
        if measured > capacity:
            need = round_up_mib(measured)
            why = " with the operator's set-policy choices" if set(self.pinned) & set(owned) else ""
            self.last_error = PlanError(
                f"the layers {owned[0]}..{owned[-1]} need {format_size(measured)} ({measured} bytes), measured "
                f"with every layer recomputed{why}, more than the capacity of {format_size(capacity)} ({capacity} "
                f"bytes): the smallest capacity that fits is {format_size(need)} "
                f"(device.memory = \"{need // 2**20}MiB\")", need)
            return None
        self.plan = Plan(policies={n: self.policy[n] for n in owned}, estimate_bytes=measured, capacity_bytes=capacity,
                         planner=self.cfg.planner, budget_ms=self.plan.budget_ms if self.plan else 0.0,
                         note=f"the model put every plan over the capacity ({model_error.min_capacity_bytes} bytes "
                              f"at least); every layer recomputed measured {format_size(measured)}, within it")
        self.provisional -= set(owned)
        self.ledger.reset_peak()
        return self.plan

    def _static_bytes(self) -> int:
        b = self.ledger.bytes
        return b["parameters"] + b["gradients"] + b["optimizer_state"] + b["master"]

    def policies(self) -> dict[str, str]:
        return {n: self.policy[n] for n in self._last_owned}

    def swapped_out_bytes(self) -> int:
        return self.swapper.out_bytes if self.swapper is not None else 0

    def swap_stalls(self) -> int:
        """Unpacks so far that found their storage not back on the device (backward waited for the link)."""
        return self.swapper.stalls if self.swapper is not None else 0

    def link_wait_s(self) -> float:
        """Seconds the compute thread has waited for the host link (for room, or for a swapped storage)."""
        return self.swapper.waited_s if self.swapper is not None else 0.0

    def close(self) -> None:
        for i, layer in enumerate(self.model.layers):
            if self._replaced[i] is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = self._replaced[i]
        self.ledger.swapper = None
        if self.link is not None:
            self.link.close()
