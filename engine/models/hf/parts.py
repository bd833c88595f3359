"""The layers a Hugging Face causal LM becomes: each runs the model's own code, so each computes what the
model computes there, whatever the family.

    Embed(anatomy)          # the runner's forward up to its first block: embeddings, positions, scales, norms
    DecoderBlock(...)       # one of the model's blocks, handed what the model's forward hands it (inputs.py)
    after_blocks(anatomy)   # the modules the runner applies after its last block (the final norm, project_out)
    Head(anatomy)           # the causal LM's forward after its base model: lm_head, logit caps and scales

Why replay the model's own forward rather than rebuild its pieces: what a family does around its blocks
differs in ways a table misses (Granite multiplies its embeddings in the model's forward, Gemma scales them
in its embedding module, Bloom normalises them and builds ALiBi inline, OPT adds learned positions and a
projection, Gemma2 caps its logits, Cohere scales them), and what a block is handed differs too (a mask per
layer type, a rotary table per layer type, ALiBi, positions). Each part here runs a copy of the model's own
forward with the blocks replaced by stubs:
- `Embed` runs the runner's forward on the tokens and stops at the first block, taking the hidden state it
  was handed. Its copy of the runner holds the model's own modules that run before the blocks (the same
  parameters) and makes no masks (NO_MASKS: they would be thrown away).
- `BlockInputs` (engine/models/hf/inputs.py) runs the runner's forward on a placeholder, every block a stub
  that records its arguments, once per input shape; every block reads its own arguments from that record.
- `Head` runs the causal LM's forward with its base model a stub that hands back the hidden state it is given.
What the blocks are handed must depend on the input's shape alone: engine/models/hf/check.py compares the
parts with the model's own forward before a run starts, and where they differ records the model's arguments
on two token sequences to name one that depends on the tokens.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.models.hf.anatomy import NO_MASKS, Anatomy, Stand, candidates, runner_inputs


class _Reached(Exception):
    """Raised by the first block's stub in Embed: the forward has made the hidden state the blocks take."""

    def __init__(self, hidden):
        super().__init__("reached the first block")
        self.hidden = hidden


class _Absent(Stand):
    """A module of the model this part never runs (one after the blocks, in a copy of the forward before them)."""

    def __init__(self, name: str, like: nn.Module | None = None):
        super().__init__(like)
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} ran where trainyard's split of the model says it does not")


class _StopAtFirst(Stand):
    def forward(self, hidden, *args, **kwargs):
        raise _Reached(hidden)


def runner_copy(anatomy: Anatomy, blocks: nn.Module, keep: set[str], params_to_meta: bool) -> nn.Module:
    """A deep copy of the runner with `blocks` in place of its blocks, its modules named in `keep` the model's
    own (not copies), its other modules holding parameters replaced by _Absent (or, with `params_to_meta`,
    kept as copies whose parameters are on the meta device; those after the blocks _Absent all the same)."""
    runner = anatomy.runner
    memo = {id(anatomy.block_list): blocks}
    if not params_to_meta:   # the runner's own parameters (if it has any) are the model's, not copies
        memo.update({id(p): p for p in runner.parameters(recurse=False)})
    for path, module in candidates(anatomy.model, anatomy.runner_path, anatomy.blocks_path).items():
        has_params = next(module.parameters(), None) is not None
        if path in keep:
            memo[id(module)] = module
        elif has_params and (path in anatomy.after or not params_to_meta):
            memo[id(module)] = _Absent(f"{anatomy.runner_path}.{path}", module)
    if params_to_meta:
        for p in runner.parameters():
            memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
    return copy.deepcopy(runner, memo)


class Embed(nn.Module):
    """Everything the model's forward does between the token ids and its first block, by the model's own
    code: its runner's forward, stopped at the first block."""

    def __init__(self, anatomy: Anatomy):
        super().__init__()
        stubs = nn.ModuleList([_StopAtFirst(block) for block in anatomy.block_list])
        self.runner = runner_copy(anatomy, stubs, keep=set(anatomy.before), params_to_meta=False)
        self.runner.config._attn_implementation = NO_MASKS   # the copy's config: the masks would be thrown away
        self.runner_args, self.runner_kwargs = list(anatomy.runner_args), dict(anatomy.runner_kwargs)

    compile_part = None   # `[model] compile` (engine/models/compile.py)
    eager_why = "it runs the model's forward up to its first block and stops it there by an exception"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        args, kwargs = runner_inputs(self, ids, None)
        try:
            self.runner(*args, **kwargs)
        except _Reached as reached:
            return reached.hidden
        raise RuntimeError("the model's forward returned without calling its first block")


class DecoderBlock(nn.Module):
    """One of the model's blocks (the module itself): a tensor in, the hidden state out, handed what the
    model's forward would hand it."""
    # `[model] compile` compiles the model's own block, handed its inputs by this eager wrapper
    # (engine/models/compile.py): the cache of shared inputs is no graph's business
    compile_part = "block"

    def __init__(self, block: nn.Module, index: int, inputs, as_tuple: bool):
        super().__init__()
        self.block, self.inputs, self.index, self.as_tuple = block, inputs, index, as_tuple
        self._probe: list | None = None   # [the block's first floating parameter, or None]: its weights' dtype

    def arguments(self, hidden: torch.Tensor) -> tuple[tuple, dict]:
        """What the model's forward hands this block with `hidden` (computed once per shape, shared)."""
        # a cast (Module.to, bf16 working weights) changes a parameter in place, so the one found first tells
        # the weights' dtype at every step, with no walk over the block's parameters on each call (a list: a
        # Parameter held as an attribute would be registered)
        if self._probe is None:
            self._probe = [next((p for p in self.block.parameters() if p.is_floating_point()), None)]
        probe = self._probe[0]
        return self.inputs.arguments(self.index, hidden, probe.dtype if probe is not None else hidden.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.arguments(hidden)
        out = self.block(hidden, *args, **kwargs)
        return out[0] if self.as_tuple else out


class Chain(nn.Module):
    """Modules applied one after another (OPT's final norm, then its project_out)."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.steps = nn.ModuleList(modules)

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x


def after_blocks(anatomy: Anatomy) -> nn.Module | None:
    """What the runner applies after its last block: its own module where there is one (the final norm),
    a Chain of them where there are several, None where there is none."""
    modules = [anatomy.part(path) for path in anatomy.after]
    if not modules:
        return None
    return modules[0] if len(modules) == 1 else Chain(modules)


class _Output(dict):
    """A base model's output holding only its last hidden state: any other field a causal LM reads of it
    (cache, attentions, cross_attentions, router_logits) is None; [0] is the hidden state, as in ModelOutput."""

    def __init__(self, hidden):
        super().__init__(last_hidden_state=hidden)

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return dict.__getitem__(self, "last_hidden_state" if key == 0 else key)

    def to_tuple(self):
        return (self["last_hidden_state"],)


class _GivenHidden(Stand):
    """The runner's stand-in in Head: hands back the hidden state it is given as its output."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:   # handed positionally
            inputs_embeds = next(a for a in args if torch.is_tensor(a) and a.is_floating_point())
        return _Output(inputs_embeds)


class Head(nn.Module):
    """Everything the causal LM's forward does after its base model (lm_head, then whatever the family does
    to the logits: Gemma2's cap, Cohere's scale, Granite's division), by its own code."""

    def __init__(self, anatomy: Anatomy):
        super().__init__()
        model, runner = anatomy.model, anatomy.runner
        base = anatomy.sub(anatomy.base_path)
        memo = {id(runner): _GivenHidden(runner)}   # what the causal LM calls: its base model (OPT: its decoder)
        for child in model.children():
            if child is not base:
                memo[id(child)] = child   # lm_head itself: the same parameters (a tied one stays tied)
        if base is not runner:   # the rest of the base (OPT's model around its decoder): never run here
            for name, m in base.named_modules():
                inside = anatomy.runner_path.startswith(f"{anatomy.base_path}.{name}".rstrip("."))
                if m is not base and not inside and next(m.parameters(), None) is not None:
                    memo.setdefault(id(m), _Absent(f"{anatomy.base_path}.{name}"))
        self.model = copy.deepcopy(model, memo)

    compile_part = None   # `[model] compile` (engine/models/compile.py)
    eager_why = "it runs the causal LM's whole forward around a stand-in for its base model"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=hidden, use_cache=False).logits
