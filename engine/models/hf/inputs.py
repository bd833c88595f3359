"""What a Hugging Face model's forward hands each of its blocks besides the hidden state, computed by the
model's own forward for each input shape and shared by the blocks (engine/models/hf/parts.py runs them).

    inputs = BlockInputs(anatomy)                 # one per LayerList, a submodule of every block
    args, kwargs = inputs.arguments(i, hidden, dtype)
    inputs.nbytes()                               # what the record holds now (the ledger's "inputs")

How: a copy of the model's runner (LlamaModel, OPTDecoder) with every block a stub that records its arguments
is run on a placeholder of the input embeddings' shape, once per input shape, dtype, device and autocast
state. Its weights are zeros that occupy one element each (expanded), on the block's device and in the blocks'
dtype, so the masks, rotary tables, ALiBi and positions come out as the model's forward makes them there: a
pipeline stage computes them for its own blocks without the embedding or the head. The model's forward makes
one mask per layer type and one rotary table per type, and hands the same tensor to every block of that type,
so the record holds each once. On the meta device the masks are not made (transformers reads the positions'
values to find packed sequences): a shape-only forward gets None, which sdpa reads as causal.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import torch
from torch import nn

from engine.models.hf.anatomy import NO_MASKS, Anatomy, Stand, runner_inputs
from engine.models.hf.parts import runner_copy
from engine.models.layers import SharedInputs

SHAPES_KEPT = 4   # input shapes whose block arguments are kept (training uses one or two: a step, an evaluation)


class _Recorded(Exception):
    """Raised by the last block's stub in BlockInputs: every block's arguments are recorded."""


class _Record(Stand):
    """Block `index`'s stand-in in BlockInputs: records what it is handed, passes the hidden state on."""

    def __init__(self, like: nn.Module, index: int, last: bool, as_tuple: bool):
        super().__init__(like)
        self.index, self.last, self.as_tuple = index, last, as_tuple
        self.sink: dict | None = None

    def forward(self, hidden, *args, **kwargs):
        self.sink[self.index] = (args, kwargs)
        if self.last:
            raise _Recorded
        return (hidden,) if self.as_tuple else hidden


class BlockInputs(SharedInputs):
    """What the model's forward hands each of its blocks besides the hidden state, for each input shape (see
    the module's doc). One per LayerList, shared by every block: a submodule of each with no parameters or
    buffers of its own, so nothing of it is in state_dict or a checkpoint."""

    def __init__(self, anatomy: Anatomy):
        super().__init__()
        n = anatomy.n_blocks
        stubs = nn.ModuleList([_Record(block, i, i == n - 1, anatomy.as_tuple)
                               for i, block in enumerate(anatomy.block_list)])
        # a list, not an attribute: the template is no submodule (its meta parameters stay out of every count)
        self._template = [runner_copy(anatomy, stubs, keep=set(), params_to_meta=True)]
        self._template[0].eval()
        embedding = anatomy.model.get_input_embeddings()
        self.embed_dim = embedding.weight.shape[-1]
        self.built_dtype = embedding.weight.dtype
        self.runner_args, self.runner_kwargs = list(anatomy.runner_args), dict(anatomy.runner_kwargs)
        self._init_cache()

    def _init_cache(self) -> None:
        self._lock = threading.Lock()
        self._shells: dict = {}
        self._cache: OrderedDict = OrderedDict()
        # the cache's bytes, counted once per change (the ledger asks every step): (its version then, the bytes)
        self._version, self._counted = 0, (0, 0)

    def __getstate__(self):   # a pickled or copied model carries no computed tensors
        computed = ("_lock", "_shells", "_cache", "_version", "_counted")
        return {k: v for k, v in self.__dict__.items() if k not in computed}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._init_cache()

    def arguments(self, index: int, hidden: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, dict]:
        """Block `index`'s arguments for a hidden state of `hidden`'s shape and device, with weights in `dtype`."""
        device = hidden.device
        kind = device.type
        autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) if kind != "meta" else None
        key = (hidden.shape[0], hidden.shape[1], device, dtype, autocast)
        record = self._cache.get(key)
        if record is None:
            with self._lock:
                record = self._cache.get(key)
                if record is None:
                    record = self._record(hidden.shape[0], hidden.shape[1], device, dtype)
                    self._cache[key] = record
                    while len(self._cache) > SHAPES_KEPT:
                        self._cache.popitem(last=False)
                    self._version += 1   # counted again at the ledger's next refresh
        return record[index]

    def _shell(self, device: torch.device, dtype: torch.dtype):
        """The template on `device` with weights in `dtype` that occupy nothing (one zero, expanded); its
        floating buffers (rotary frequencies) cast as Module.to(dtype) casts the model's own."""
        made = self._shells.get((device, dtype))
        if made is not None:
            return made
        template = self._template[0]
        memo = {}
        for p in template.parameters():
            zero = torch.zeros((), dtype=dtype if p.is_floating_point() else p.dtype, device=device)
            memo[id(p)] = nn.Parameter(zero.expand(p.shape), requires_grad=False)
        for b in template.buffers():
            cast = dtype if b.is_floating_point() and dtype != self.built_dtype else b.dtype
            memo[id(b)] = b.to(device=device, dtype=cast)
        shell = copy.deepcopy(template, memo)
        if device.type == "meta":   # the masks read the positions' values (packed sequences): sizes only here
            shell.config._attn_implementation = NO_MASKS
        stubs = [m for m in shell.modules() if isinstance(m, _Record)]
        self._shells[(device, dtype)] = shell, stubs
        return shell, stubs

    def _record(self, batch: int, tokens: int, device: torch.device, dtype: torch.dtype) -> list:
        shell, stubs = self._shell(device, dtype)
        sink: dict = {}
        for stub in stubs:
            stub.sink = sink
        placeholder = torch.zeros(batch, tokens, self.embed_dim, dtype=dtype, device=device)
        args, kwargs = runner_inputs(self, None, placeholder)
        try:
            with torch.no_grad():
                shell(*args, **kwargs)
        except _Recorded:
            pass
        finally:
            for stub in stubs:
                stub.sink = None
        return [sink[i] for i in range(len(sink))]

    def tensors(self) -> list:
        """The arguments held now (a mask shared by 30 blocks is one tensor here, counted once)."""
        return [t for record in list(self._cache.values()) for t in _tensors(record)]

    def nbytes(self) -> int:
        version, nbytes = self._counted
        if version != self._version:   # read before counting: a shape added meanwhile is counted next time
            version = self._version
            nbytes = super().nbytes()
            self._counted = (version, nbytes)
        return nbytes


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


