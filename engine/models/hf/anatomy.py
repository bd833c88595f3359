"""Where a Hugging Face causal LM keeps its parts, and what its forward does with them, found without
per-family code.

    anatomy = read_anatomy(model)   # HFError names what is not reproduced
    anatomy.runner                  # what the causal LM's forward calls, the blocks inside (LlamaModel, OPTDecoder)
    anatomy.before, anatomy.after   # the runner's modules its forward calls before the first block, after the last
    anatomy.runner_args, runner_kwargs   # what the causal LM hands the runner besides the tokens

Found from the modules: the blocks are the shallowest ModuleList of at least `num_hidden_layers` modules.
Found from one forward of a copy of the model on the meta device (no memory, no arithmetic), its blocks
replaced by stubs that record what they are handed (`trace`): the runner (the outermost module around the
blocks that the causal LM calls: its base model, OPT's decoder), how many blocks run, which of the runner's
modules run before the blocks and which after, whether the runner takes a block's output as the hidden state
or as a tuple holding it, and what the causal LM passes the runner. The masks are off in that copy (NO_MASKS):
on the meta device they cannot be made (transformers reads the positions' values to find packed sequences),
and nothing here depends on them.

The runner's modules, named by their path from the runner ("embed_tokens", "decoder.final_layer_norm"), are
those beside the path from the runner down to the blocks: a BERT-style model's embeddings sit in the base model
and its blocks in base.encoder, and both are found.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

# an attention implementation no mask interface is registered for: transformers' mask functions then return
# None at once (masking_utils._preprocess_mask_arguments), without reading the positions' values
NO_MASKS = "trainyard-no-masks"
TRACE_TOKENS = 3
TOKENS = "<trainyard: the token ids>"   # where the causal LM hands its runner the token ids positionally
PLAIN = (str, int, float, bool, type(None))


class HFError(ValueError):
    """A Hugging Face model trainyard does not reproduce, with the reason named."""


@dataclass
class Anatomy:
    model: nn.Module               # the causal LM as given
    base_path: str                 # its base model: "model", "transformer", "gpt_neox"
    runner_path: str               # what its forward calls, the blocks inside: "model", "model.decoder", "bert"
    blocks_path: str               # the blocks' ModuleList, from the runner: "layers", "h", "encoder.layer"
    n_blocks: int                  # the blocks the forward runs
    before: list[str] = field(default_factory=list)    # the runner's modules called before the first block
    after: list[str] = field(default_factory=list)     # ... after the last, in call order (a chain)
    runner_args: list = field(default_factory=list)    # what the causal LM hands the runner, TOKENS for the ids
    runner_kwargs: dict = field(default_factory=dict)  # ... by keyword, the tokens and embeddings left out
    as_tuple: bool = False         # a block returns (hidden, ...) rather than the hidden state

    @property
    def name(self) -> str:
        return type(self.model).__name__

    def sub(self, path: str) -> nn.Module:
        return self.model.get_submodule(path) if path else self.model

    @property
    def runner(self) -> nn.Module:
        return self.sub(self.runner_path)

    @property
    def block_list(self) -> nn.ModuleList:
        return self.runner.get_submodule(self.blocks_path)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.block_list)[:self.n_blocks]

    def part(self, path: str) -> nn.Module:
        """One of the runner's modules, by its path from the runner."""
        return self.runner.get_submodule(path)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def read_anatomy(model: nn.Module) -> Anatomy:
    """The parts of `model` and what its forward does with them; HFError where trainyard cannot take it."""
    refuse_by_config(model)
    name, config = type(model).__name__, text_config(model.config)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise HFError(f"{name}: its config has no num_hidden_layers, so its blocks cannot be found; wrap its "
                      f"layers in an engine.LayerList yourself (docs/models.md)")
    lists = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) >= n]
    if not lists:
        raise HFError(f"{name}: no list of its {n} blocks (a ModuleList of num_hidden_layers modules) was found; "
                      f"wrap its layers in an engine.LayerList yourself (docs/models.md)")
    path, _ = min(lists, key=lambda item: item[0].count("."))   # the shallowest: not a block's experts
    base = getattr(model, "base_model", None)
    base_path = next((p for p, m in model.named_modules() if m is base and m is not model), None)
    if base_path is None:
        base_path = path.split(".")[0]   # a causal LM that names no base model: the child holding the blocks
    if not path.startswith(base_path + "."):
        raise HFError(f"{name}: its blocks ({path}) are outside its base model ({base_path})")
    anatomy = Anatomy(model, base_path, base_path, path[len(base_path) + 1:], n)
    trace(anatomy, path)
    return anatomy


# --- what is refused by its config, before anything runs -------------------------------------------------
def refuse_by_config(model: nn.Module) -> None:
    """Config attributes whose effect trainyard does not reproduce, named with what to do instead."""
    name, config = type(model).__name__, model.config
    text = text_config(config)

    def says(attr) -> bool:
        return bool(getattr(config, attr, None) or getattr(text, attr, None))

    if says("is_encoder_decoder") or says("add_cross_attention"):
        raise HFError(f"{name} has cross-attention (is_encoder_decoder / add_cross_attention): trainyard "
                      f"trains decoder-only causal LMs")
    if says("use_bidirectional_attention") or getattr(text, "is_causal", True) is False:
        raise HFError(f"{name}: use_bidirectional_attention / is_causal = false lets a token attend to later "
                      f"ones, so next-token training would see its own targets; trainyard trains causal LMs")
    if says("output_router_logits"):
        raise HFError(f"{name}: output_router_logits = true adds the router's load-balancing loss "
                      f"(router_aux_loss_coef) to the model's training loss, and trainyard's loss does not add "
                      f"it; set output_router_logits = false, or give engine.train a loss_fn of your own")
    if getattr(text, "hidden_size_per_layer_input", None):
        raise HFError(f"{name}: hidden_size_per_layer_input: its blocks take per-layer inputs computed from "
                      f"the token ids, which a pipeline stage without the embedding cannot compute")


# --- stand-ins --------------------------------------------------------------------------------------------
def plain_attributes(module: nn.Module) -> dict:
    """A module's own plain settings (a block's attention_type, a base model's lm_head_multiplier): what a
    forward may read of a module a stub stands in for."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, PLAIN)}


class Stand(nn.Module):
    """A stand-in that carries the plain settings of the module it replaces."""

    def __init__(self, like: nn.Module | None = None):
        super().__init__()
        for k, v in (plain_attributes(like) if like is not None else {}).items():
            setattr(self, k, v)


class _TraceStub(Stand):
    """Stands in for block `index` in the traced copy: notes what it was handed, passes the hidden state on."""

    def __init__(self, like: nn.Module, index: int, log: list, as_tuple: bool):
        super().__init__(like)
        self.index, self.log, self.as_tuple = index, log, as_tuple

    def forward(self, hidden, *args, **kwargs):
        self.log.append(("block", self.index, hidden, args, kwargs))
        return (hidden,) if self.as_tuple else hidden


def meta_copy(module: nn.Module, replace: dict | None = None) -> nn.Module:
    """A deep copy of `module` with every parameter and buffer on the meta device (no memory), and the
    modules in `replace` (id -> module) put in place of those."""
    memo = dict(replace or {})
    for p in module.parameters():
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))
    for b in module.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(module, memo)


def candidates(model: nn.Module, runner_path: str, blocks_path: str) -> dict[str, nn.Module]:
    """The modules beside the path from the runner down to the blocks, by their path from the runner."""
    out, here, prefix = {}, model.get_submodule(runner_path) if runner_path else model, ""
    steps = blocks_path.split(".")
    for i, step in enumerate(steps):
        for child_name, child in here.named_children():
            if child_name != step:
                out[prefix + child_name] = child
        here, prefix = getattr(here, step), prefix + step + "."
    return out


# --- one forward on the meta device, its blocks stubbed -----------------------------------------------------
def _traced(anatomy: Anatomy, full_path: str, as_tuple: bool):
    model, log = anatomy.model, []
    original = model.get_submodule(full_path)
    stubs = nn.ModuleList([_TraceStub(block, i, log, as_tuple) for i, block in enumerate(original)])
    twin = meta_copy(model, {id(original): stubs})
    twin.config._attn_implementation = NO_MASKS   # the copy's config, which every module of the copy reads
    hooks = []
    ancestors = full_path.split(".")[:-1]   # base ... the blocks' parent: which of them the causal LM calls
    for depth in range(len(ancestors)):
        path = ".".join(ancestors[:depth + 1])
        hooks.append(twin.get_submodule(path).register_forward_pre_hook(
            lambda m, a, kw, path=path: log.append(("call", path, a, kw)), with_kwargs=True))
        hooks.append(twin.get_submodule(path).register_forward_hook(
            lambda m, a, out, path=path: log.append(("out", path, out))))
    for path, child in candidates(twin, anatomy.base_path, full_path[len(anatomy.base_path) + 1:]).items():
        hooks.append(child.register_forward_hook(lambda m, a, out, path=path: log.append(("child", path, a, out))))
    ids = torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device="meta")
    twin.eval()
    try:
        twin(input_ids=ids, use_cache=False)
        error = None
    except Exception as e:   # a wrong guess of the blocks' output form breaks the forward after them
        error = e
    finally:
        for h in hooks:
            h.remove()
    return log, error, ids


def _hidden_of(out):
    return getattr(out, "last_hidden_state", out[0] if isinstance(out, (tuple, list)) else out)


def runner_inputs(anatomy_or_part, ids, embeds) -> tuple[list, dict]:
    """The arguments the causal LM hands its runner, with `ids` as the token ids and `embeds` as the input
    embeddings (one of them None), as the trace recorded them."""
    args = [ids if isinstance(a, str) and a == TOKENS else a for a in anatomy_or_part.runner_args]
    kwargs = dict(anatomy_or_part.runner_kwargs, inputs_embeds=embeds)
    if TOKENS not in anatomy_or_part.runner_args:
        kwargs["input_ids"] = ids
    return args, kwargs


def trace(anatomy: Anatomy, full_path: str) -> None:
    """Fill in the runner, the blocks that run, `before`, `after`, what the runner is handed and `as_tuple`,
    from one forward of a meta copy."""
    name = anatomy.name
    for as_tuple in (False, True):
        log, error, ids = _traced(anatomy, full_path, as_tuple)
        received = [entry[2] for entry in log if entry[0] == "block"]
        ok = (error is None and received and all(torch.is_tensor(h) and h.dim() == 3 for h in received))
        if ok:
            break
    else:
        first = received[0] if received else None
        if torch.is_tensor(first) and first.dim() != 3:
            raise HFError(f"{name}: its blocks take a {first.dim()}-D hidden state (trainyard's layers pass "
                          f"[batch, tokens, hidden] between them)")
        raise HFError(f"{name}: a forward with its blocks stubbed did not run through "
                      f"({type(error).__name__ + ': ' + str(error) if error else 'no block was called'}); "
                      f"wrap its layers in an engine.LayerList yourself (docs/models.md)")
    anatomy.as_tuple = as_tuple
    order = [e[1] for e in log if e[0] == "block"]
    listed = len(anatomy.model.get_submodule(full_path))
    if order != list(range(len(order))):
        raise HFError(f"{name}: its forward does not call its blocks once each, in order")
    if len(order) < listed:
        raise HFError(f"{name}: {full_path} holds {listed} modules and its forward runs {len(order)} "
                      f"(multi-token-prediction or other extra layers): the others are not reproduced")
    anatomy.n_blocks = len(order)
    # the runner: the outermost module around the blocks that the causal LM calls (OPT calls its decoder)
    _, runner_path, args, kwargs = next(e for e in log if e[0] == "call")
    anatomy.runner_path = runner_path
    anatomy.blocks_path = full_path[len(runner_path) + 1:]
    _runner_inputs(anatomy, args, kwargs, ids)
    first_block = next(i for i, e in enumerate(log) if e[0] == "block")
    last_block = max(i for i, e in enumerate(log) if e[0] == "block")
    prefix = runner_path[len(anatomy.base_path):].lstrip(".")
    prefix = prefix + "." if prefix else ""
    children = [(i, e[1][len(prefix):], e) for i, e in enumerate(log) if e[0] == "child" and e[1].startswith(prefix)]
    outside = {e[1] for i, e in enumerate(log) if e[0] == "child" and not e[1].startswith(prefix)}
    if any(i > first_block for i, e in enumerate(log) if e[0] == "child" and e[1] in outside):
        raise HFError(f"{name}: {', '.join(sorted(outside))} runs outside {runner_path} after its blocks")
    anatomy.before = list(dict.fromkeys(path for i, path, _ in children if i < first_block))
    anatomy.after = [path for i, path, _ in children if i > last_block]
    weighed = {path for path in anatomy.before + anatomy.after if next(anatomy.part(path).parameters(), None) is not None}
    both = set(anatomy.before) & set(anatomy.after) & weighed
    during = {path for i, path, _ in children if first_block < i < last_block}
    if both or during:
        raise HFError(f"{name}: {', '.join(sorted(both | during))} runs both before and after (or between) "
                      f"its blocks; trainyard splits the model at its blocks")
    outs = [e[2] for e in log if e[0] == "out" and e[1] == runner_path]
    _check_chain(anatomy, [e for i, _, e in children if i > last_block], received[-1], _hidden_of(outs[-1]))


def _runner_inputs(anatomy: Anatomy, args: tuple, kwargs: dict, ids) -> None:
    """What the causal LM handed the runner: the token ids (by identity) marked TOKENS, no other tensor."""
    anatomy.runner_args = [TOKENS if a is ids else a for a in args]
    anatomy.runner_kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs_embeds")}
    if kwargs.get("input_ids") is not ids and TOKENS not in anatomy.runner_args:
        raise HFError(f"{anatomy.name}: its forward hands {anatomy.runner_path} something else than the token "
                      f"ids it was given; trainyard replays its forward from the ids")
    tensors = [k for k, v in anatomy.runner_kwargs.items() if torch.is_tensor(v)]
    tensors += [f"positional argument {i + 1}" for i, a in enumerate(anatomy.runner_args) if torch.is_tensor(a)]
    if tensors:
        raise HFError(f"{anatomy.name}: its forward hands {anatomy.runner_path} the tensor argument(s) "
                      f"{', '.join(tensors)} besides the token ids, which trainyard does not reproduce")


def _check_chain(anatomy: Anatomy, calls: list, last_hidden, result) -> None:
    """What runs after the blocks must be a chain: each module takes the previous one's output (the first the
    last block's), and the runner returns the last one's (or a view of it)."""
    x = last_hidden
    for e in calls:
        arg = e[2][0] if e[2] else None
        if arg is not x or len(e[2]) != 1:
            raise HFError(f"{anatomy.name}: after its blocks, {anatomy.runner_path}.{e[1]} is not applied to the "
                          f"previous step's output alone; trainyard reproduces a chain of modules there")
        x = e[3]
    same = result is x or (getattr(result, "_base", None) is x and result.shape == x.shape)
    if not same:
        steps = " -> ".join(anatomy.after) or "nothing"
        raise HFError(f"{anatomy.name}: its runner's output is not what its last block's output becomes through "
                      f"{steps}: it does more after its blocks than apply those modules, which is not reproduced")
