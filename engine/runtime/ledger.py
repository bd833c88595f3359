"""The memory ledger: what a worker holds on its device, by category, counted from the tensors themselves against
the configured capacity (docs/memory.md). On the CPU it is the device's memory; on CUDA it runs beside the
allocator's figures.

    ledger = MemoryLedger(capacity_bytes)
    ledger.track_module(model, optimizer)      # parameters, gradients, optimizer state, masters, shared inputs
    with ledger.saved_activations(): ...       # live saved activations

Imports engine.models.layers (a model's shared inputs).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from engine.models.layers import shared_input_bytes, shared_input_ptrs, shared_inputs

# "inputs": tensors a model's blocks share per input shape besides the hidden state (a Hugging Face model's
# attention masks and rotary tables, engine/models/hf/parts.py), each counted once however many blocks take it
CATEGORIES = ("parameters", "gradients", "optimizer_state", "master", "activations", "inputs", "swapped")
_BYTES_NAMES = tuple((k, f"{k}_bytes") for k in CATEGORIES)   # breakdown()'s keys, every step's


_PLAIN = (torch.Tensor, torch.nn.Parameter)   # no local shard to look for: the ledger counts these every step


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes `t` holds here: a DTensor's (FSDP2's sharded parameters and their state) are its local shard's."""
    if type(t) in _PLAIN:
        return t.nbytes
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    return t.numel() * t.element_size()


class MemoryLedger:
    """Bytes the engine holds for one device, by category, with a peak and a capacity."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        # the peak since reset_peak before that step's first gradients were counted as made (FreedGradients), None
        # until then: the update planner's steady peak holds kept gradients from the step's start (trial.py)
        self.peak_before_grads: int | None = None
        self.over_capacity = False
        self._lock = threading.RLock()   # RLock: a handle freed by the GC inside a locked section
        self._modules: list[torch.nn.Module] = []
        self._shared: list = []   # the tracked modules' SharedInputs (engine/models/layers.py), found as tracked
        self._params: list = []   # the tracked modules' parameters, found as tracked
        self._optimizers: list[torch.optim.Optimizer] = []
        self._saved: dict[int, list] = {}   # storage pointer -> [bytes, references]
        self.extra: dict[str, int] = {}     # bytes a strategy holds outside parameters/.grad/state, by category
        self.freed_as_held: set[int] = set()   # ids of parameters whose freed gradient counts as held (count_as_held)
        self.current_layer: str | None = None          # set by the layer profiler during forward
        self.activations_by_layer: dict[str, int] = {}  # bytes first saved while that layer ran
        self.shared_bytes: dict[tuple[str, str], int] = {}  # (first saver, later saver) -> bytes of both
        self.swapper = None          # engine.techniques.memory.swap.Swapper, once a layer may swap
        # the kind of device whose memory this is ("cuda" on a GPU; None: everything is, as on the CPU). A
        # tensor autograd saves elsewhere (the RNG seed and offset an attention kernel keeps on the host) is
        # neither counted nor swapped: a swap would bring it back on the device, where the kernel's
        # backward reads a host pointer
        self.device_type: str | None = None
        self._param_ptrs: set | None = None   # inside saved_activations()
        # count saved activations through autograd's saved-tensor hooks. They cost every saved tensor a call
        # into Python (3-5% of a small model's step on this CPU, trivial hooks alone 3%): a bench turns them
        # off to measure that share; a swapping layer needs them whatever this says
        self.count_activations = True
        # counting by unit (a pipeline's micro-batch) instead of by tensor, once a unit's bytes are known
        self.exact_due = False   # this step reads per-layer bytes (layer profiler, memory planner): hooks on
        # the layer profiler's step: per-layer bytes wanted, which a unit key's first such step counts by tensor
        # and the next ones take from `_layer_bytes` (the same layers keeping the same shapes save the same)
        self.layers_due = False
        self._layer_bytes: dict = {}
        self.all_keep = True     # every layer this rank runs keeps its activations (set by the memory policy)
        self._unit_bytes: dict = {}   # what decides a unit's saved bytes -> those bytes, counted by the hooks
        self._varies: set = set()     # keys whose units saved different bytes: always counted by tensor
        self._last_unit: dict = {}    # key -> the last unit the hooks counted, until two in a row agree

    # --- what the engine holds -------------------------------------------------
    def track_module(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._modules.append(module)
        self._modules_changed()
        if optimizer is not None:
            self._optimizers.append(optimizer)
        self.refresh()

    def track_optimizer(self, optimizer) -> None:
        """Count an optimizer's state (and, where it has them, `master_bytes()`) without a module."""
        self._optimizers.append(optimizer)
        self.refresh()

    def retrack(self, module: torch.nn.Module, index: int = 0) -> None:
        """Count `module` in place of the `index`th tracked one (a pipeline stage whose layers changed)."""
        if index < len(self._modules):
            self._modules[index] = module
        else:
            self._modules.append(module)
        self._modules_changed()
        self.refresh()

    def _modules_changed(self) -> None:
        """The tracked modules' parameters and shared inputs, found once (walking a model's modules costs more
        than counting its tensors; a tracked module's layers change only through retrack)."""
        self._shared = shared_inputs(self._modules)
        self._params = [p for module in self._modules for p in module.parameters()]

    def refresh(self) -> None:
        """Recount parameters, gradients and optimizer state (they change size lazily)."""
        params = grads = state = master = 0
        plain = _PLAIN   # every step: a plain tensor's bytes read in place (tensor_bytes for a DTensor)
        held = self.freed_as_held
        for p in self._params:
            size = p.nbytes if type(p) in plain else tensor_bytes(p)
            params += size
            grad = p.grad
            if grad is not None:
                grads += grad.nbytes if type(grad) in plain else tensor_bytes(grad)
            elif held and id(p) in held:   # freed by its update, counted as held (count_as_held)
                grads += size
        for opt in self._optimizers:
            for per_param in opt.state.values():
                for v in per_param.values():
                    if isinstance(v, torch.Tensor):
                        state += v.nbytes if type(v) in plain else tensor_bytes(v)
            if hasattr(opt, "master_bytes"):   # fp32 masters beside bf16 working weights (engine/training/precision.py)
                master += opt.master_bytes()
            if hasattr(opt, "rollback_bytes"):   # speculative updates' copies, until the step is decided
                state += opt.rollback_bytes()
        extra = self.extra
        inputs = shared_input_bytes(self._shared)
        with self._lock:
            self.bytes["inputs"] = inputs
            self.bytes["parameters"] = params + extra.get("parameters", 0)
            self.bytes["gradients"] = grads + extra.get("gradients", 0)
            self.bytes["optimizer_state"] = state + extra.get("optimizer_state", 0)
            self.bytes["master"] = master + extra.get("master", 0)
            self._note_peak()

    def add(self, category: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[category] += nbytes
            if nbytes > 0:   # what is given back raises no peak
                self._note_peak()

    @property
    def used_bytes(self) -> int:
        # swapped-out bytes live on the host, not on the device
        return sum(self.bytes.values()) - self.bytes["swapped"]

    def _note_peak(self) -> None:
        used = self.used_bytes
        self.peak_bytes = max(self.peak_bytes, used)
        if used > self.capacity_bytes:
            self.over_capacity = True

    def count_as_held(self, params) -> None:
        """These parameters' gradients, freed by their updates (LayerUpdates' `release_grads`), count as held all
        step, as when they were zeroed in place: a pipeline stage's, made by its first backward and alive across
        the micro-batches' forwards after it until the update (under 1F1B most of the step), which the memory
        planners and a rebalance's room read at a step boundary. `refresh` counts a tracked parameter whose
        gradient is freed and not made again as holding its bytes (a gradient has its parameter's shape and
        dtype): never twice, and never a layer that migrated away (the ledger tracks the stage's layers only)."""
        self.freed_as_held.update(id(p) for p in params)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.used_bytes
            self.peak_before_grads = None
            self.over_capacity = self.peak_bytes > self.capacity_bytes

    # --- saved activations, counted through saved-tensor hooks -----------------
    @contextmanager
    def saved_activations(self):
        """Count tensors autograd saves for backward while they are alive.

        Parameters saved for backward are not activations and are skipped (so are the inputs the blocks
        share, counted under "inputs" once they exist: from the second step on); a storage
        saved twice (a ReLU output kept by the ReLU and the next Linear) counts once.
        While a swap-policy layer runs (engine/techniques/memory/), what it saves goes to the host.
        """
        if not self.count_activations and self.swapper is None:
            yield
            return
        # parameters, and the tensors the blocks share (masks, rotary tables: counted under "inputs", kept
        # across steps, so neither counted again nor swapped out when a block saves them)
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._params}
        self._param_ptrs |= shared_input_ptrs(self._shared)

        def unpack(saved):
            return saved if torch.is_tensor(saved) else saved.unpack()   # _Saved, memory.swap._SwapHandle

        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack_tensor, unpack):
                yield
        finally:
            self._param_ptrs = None

    # --- counting a unit of work at once --------------------------------------------------------
    def unit_bytes(self, key) -> int | None:
        """The bytes one unit of work keyed `key` saves, where this step may count them at once (in
        `add("activations", ...)`) instead of through the saved-tensor hooks; None where the hooks must count: nothing
        measured for `key` yet, a step that reads per-layer bytes, a layer that swaps or recomputes (its
        tensors come and go inside the unit), or a key whose units were seen to differ (data-dependent
        shapes). The peak is the same either way: saved bytes only grow during a forward and only shrink
        during a backward, so the most a unit holds is what it holds at its forward's end."""
        if not self._units_apply() or self.exact_due or key in self._varies \
                or (self.layers_due and key not in self._layer_bytes):
            return None
        return self._unit_bytes.get(key)

    def _units_apply(self) -> bool:
        """Whether a unit's bytes mean anything now: counted at all, every layer keeping what it saves."""
        return self.count_activations and self.all_keep and self.swapper is None

    def unit_counted(self, key, units: list[int]) -> None:
        """What the hooks counted for each unit of a step keyed `key` (every layer keeping its activations). A
        unit's bytes are known once two units in a row agree (the run's first unit also saves what is made once,
        the inputs the blocks share); a known unit seen to differ makes `key` counted by tensor for good."""
        if not self._units_apply() or not units:
            return
        known = self._unit_bytes.get(key)
        if known is not None:
            if any(u != known for u in units):
                self._varies.add(key)
            return
        seen = ([self._last_unit[key]] if key in self._last_unit else []) + list(units)
        if len(seen) >= 2 and seen[-2] == seen[-1] and all(u == seen[-1] for u in units[1:]):
            self._unit_bytes[key] = seen[-1]
        self._last_unit[key] = units[-1]

    @contextmanager
    def by_units(self, key, exact: bool = False):
        """One step of equal units (a pipeline stage's micro-batches) keyed `key`: counted by tensor through the
        hooks until a unit's bytes are known (unit_bytes; always where `exact`), then booked a unit at a time.

            with ledger.by_units(key) as units:
                units.forward_begin(); ...forward...; units.forward_end()
                ...backward...; units.backward_end()
        """
        units = _Units(self, None if exact else self.unit_bytes(key))
        try:
            if units.unit is None:
                with self.saved_activations():
                    yield units
                if not exact:
                    self.unit_counted(key, units.counted)
                    known = self._unit_bytes.get(key)   # a step like the ones before (not the first: it saves
                    if self.layers_due and known is not None and self._units_apply() and key not in self._varies \
                            and all(u == known for u in units.counted):   # what is made once besides)
                        self._layer_bytes[key] = dict(self.activations_by_layer)   # counted from the step's start
            else:
                if self.layers_due:   # a step of a known unit, every layer keeping: what its first one counted
                    self.activations_by_layer = dict(self._layer_bytes[key])
                yield units
        finally:
            # asked for one step (engine/runtime/profiler.py, engine/techniques/memory/)
            self.exact_due = self.layers_due = False

    def pack_tensor(self, t: torch.Tensor):
        """Count `t` as a live activation until the returned handle is dropped (`t` itself outside
        `saved_activations()`, or for a parameter). It runs for every tensor autograd saves, parameters
        included (a Linear saves its weight), so it reads the storage once and takes the lock once."""
        params = self._param_ptrs
        if params is None:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or ptr == 0 or (self.device_type is not None and t.device.type != self.device_type):
            return t
        swapper = self.swapper
        if swapper is not None and ptr not in self._saved:
            swapper.make_room(storage.nbytes())
        with self._lock:
            entry = self._saved.get(ptr)
            if entry is not None:
                entry[1] += 1
                self.note_shared(entry[2], entry[0])
                return _Saved(self, ptr, t)
            if swapper is None or swapper.group is None:
                nbytes = storage.nbytes()
                self.attribute(nbytes)
                self._saved[ptr] = [nbytes, 1, self.current_layer or ""]
                self.bytes["activations"] += nbytes
                self._note_peak()
                return _Saved(self, ptr, t)
        return swapper.pack(t, ptr, storage.nbytes())

    def note_shared(self, first: str, nbytes: int) -> None:
        """A storage `first` saved is saved again by the layer running now: it leaves the device only
        when neither keeps it (engine/techniques/memory/ plans with these)."""
        layer = self.current_layer or ""
        if first and layer and layer != first:
            self.shared_bytes[(first, layer)] = self.shared_bytes.get((first, layer), 0) + nbytes

    def attribute(self, nbytes: int) -> None:
        """Book `nbytes` newly saved to the layer running now ("": outside any layer, e.g. the loss)."""
        layer = self.current_layer or ""
        self.activations_by_layer[layer] = self.activations_by_layer.get(layer, 0) + nbytes

    def note_transient(self, nbytes: int) -> None:
        """`nbytes` are on the device for a moment now (a recomputed layer's activations): peak only."""
        with self._lock:
            used = self.used_bytes + nbytes
            self.peak_bytes = max(self.peak_bytes, used)
            if used > self.capacity_bytes:
                self.over_capacity = True

    def _release(self, ptr: int) -> None:
        with self._lock:
            entry = self._saved.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.bytes["activations"] -= entry[0]
                del self._saved[ptr]

    def breakdown(self) -> dict:
        with self._lock:
            return {**{name: self.bytes[k] for k, name in _BYTES_NAMES},
                    "used_bytes": self.used_bytes, "peak_bytes": self.peak_bytes,
                    "capacity_bytes": self.capacity_bytes, "over_capacity": self.over_capacity}


class _Units:
    """A step's units for MemoryLedger.by_units: each unit's bytes as the hooks count them, or booked at once."""

    __slots__ = ("ledger", "unit", "counted", "_held")

    def __init__(self, ledger: MemoryLedger, unit: int | None):
        self.ledger, self.unit, self.counted, self._held = ledger, unit, [], 0

    def forward_begin(self) -> None:
        self._held = self.ledger.bytes["activations"]

    def forward_end(self) -> None:
        if self.unit is None:
            self.counted.append(self.ledger.bytes["activations"] - self._held)
        else:
            self.ledger.add("activations", self.unit)

    def backward_end(self) -> None:
        if self.unit is not None:
            self.ledger.add("activations", -self.unit)


class _Saved:
    """A saved tensor whose lifetime the ledger follows: autograd frees it after backward."""

    __slots__ = ("ledger", "ptr", "tensor")

    def __init__(self, ledger: MemoryLedger, ptr: int, tensor: torch.Tensor):
        self.ledger, self.ptr, self.tensor = ledger, ptr, tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor

    def __del__(self):
        self.ledger._release(self.ptr)
