"""What the launcher refuses before any worker starts (RunSetupError, exit status 2): what this host cannot
run (too few GPUs, a device.memory below what a rank holds whatever the plans choose), a Hugging Face
model that is not reproduced or a data.seq_len past its positions, a token file made with a tokenizer larger
than the model's vocabulary (its meta.json, `trainyard prepare`'s) or holding an id past it.

    check_machine(job); check_model(job)       # engine/run/launch.py: prepare_run_dir
    check_token_ids(job)                       # called by check_model: token ids within the model's vocabulary

Imports engine.config, engine.runtime (compat, devices, refusal), the strategies' registry (engine.strategies.specs:
who holds what; a pipeline's stages through the function its spec names), and late: engine.training.data,
engine.models.
"""

from __future__ import annotations

import os
import sys

from engine.config import format_size
from engine.runtime import compat
from engine.runtime.devices import choose_device, cuda_count, tensor_bytes
from engine.runtime.refusal import Refused
from engine.run.claim import RunSetupError
from engine.strategies.specs import STRATEGIES, resolve

__all__ = ["RunSetupError", "check_machine", "check_model", "check_token_ids"]


def check_model(job) -> None:
    """A `[model] name = "hf"` model is compared with its own forward before any worker starts, on a reduced
    copy built from its config (engine/models/hf/check.py): what is not reproduced, or a data.seq_len past
    its table of positions, is refused by name (RunSetupError, exit status 2). A model given to engine.train
    was checked when its LayerList was made. Then the token files' ids are checked against the model's
    vocabulary (check_token_ids)."""
    cfg = job.config
    if cfg.model.name == "hf" and job.model is None:
        from engine.models.hf import check_files
        seq_len = cfg.data.seq_len if cfg.data.name in ("tokens", "text") else None
        try:
            check_files(cfg.model.hf_config, cfg.model.hf_weights, seq_len)
        except ValueError as e:
            raise RunSetupError(str(e)) from None
    check_token_ids(job)


def check_token_ids(job) -> None:
    """`[data] name = "tokens"`: each file's largest id against the model's vocabulary, once, before any
    worker starts. An id past it is an IndexError in a worker when it is sampled, and trains unnoticed when
    it is not. The scan is kept beside the file (engine/training/token_scan.py: largest_id)."""
    cfg = job.config
    if cfg.data.name != "tokens" or job.data is not None:
        return
    vocab = model_vocabulary(job)
    if vocab is None:   # a model whose input embedding is not clear: its own business
        return
    size, source, remedy = vocab
    check_tokenizer_size(cfg.data, size, source, remedy)
    from engine.training.token_scan import largest_id
    for key in ("train", "val"):
        path = getattr(cfg.data, key)
        if not path:
            continue
        max_id, position = largest_id(path, cfg.data.dtype)
        if max_id >= size:
            raise RunSetupError(
                f'data.{key} = "{path}": token id {max_id} at token index {position} is past the model\'s '
                f"vocabulary of {size} ids ({source}); re-tokenize the file with a vocabulary of at most {size} "
                f"ids, or {remedy.format(need=max_id + 1)}")


def check_tokenizer_size(data, size: int, source: str, remedy: str) -> None:
    """A tokenizer larger than the model's vocabulary, which its meta.json names, is refused even where the files
    hold no id past it yet (a model padded to a larger vocabulary is fine)."""
    from engine.config.files import META, token_meta
    for key in ("train", "val"):
        path = getattr(data, key)
        try:
            meta = token_meta(path) if path else None
        except ValueError:   # engine/config/files.py refused it at load
            meta = None
        tokenizer_ids = meta.get("vocab_size") if meta else None
        if isinstance(tokenizer_ids, int) and tokenizer_ids > size:
            where = os.path.join(os.path.dirname(path) or ".", META)
            raise RunSetupError(
                f'data.{key} = "{path}" was made with a tokenizer of {tokenizer_ids} ids ({meta.get("tokenizer")}, '
                f"vocab_size in {where}), larger than the model's vocabulary of {size} ids ({source}); prepare the "
                f"data with the model's own tokenizer, or {remedy.format(need=tokenizer_ids)}")


def model_vocabulary(job) -> tuple[int, str, str] | None:
    """(the ids the model's input embedding takes, where that number comes from, how to make it larger), or
    None where it cannot be known."""
    cfg = job.config
    if job.model is not None:
        return _input_embedding_rows(job.model)
    if cfg.model.name == "transformer":
        if cfg.data.vocab_size:
            return cfg.data.vocab_size, "data.vocab_size", "set data.vocab_size to at least {need}"
        from engine.config.files import token_meta
        meta = token_meta(cfg.data.train) or {}   # a prepared file's tokenizer sizes the built-in transformer
        if isinstance(meta.get("vocab_size"), int):
            return meta["vocab_size"], "data.vocab_size = 0: the tokenizer's, in meta.json", \
                "set data.vocab_size to at least {need}"
        from engine.training.token_scan import largest_id
        return (largest_id(cfg.data.train, cfg.data.dtype)[0] + 1,
                "data.vocab_size = 0: the training file's largest id + 1", "set data.vocab_size to at least {need}")
    if cfg.model.name == "hf":
        from engine.models.hf import _config
        from engine.models.hf.anatomy import text_config
        where = cfg.model.hf_config or cfg.model.hf_weights
        size = getattr(text_config(_config(where)), "vocab_size", None)
        if os.path.isdir(where):
            where = os.path.join(where, "config.json")
        if isinstance(size, int):
            return size, f"vocab_size in {where}", "use a model whose vocab_size is at least {need}"
    return None


def _input_embedding_rows(model) -> tuple[int, str, str] | None:
    """A LayerList's input embedding, where one is clear: the built-in transformer's token embedding, a Hugging
    Face model's (get_input_embeddings), or the one nn.Embedding its first layer is or holds."""
    from torch import nn
    from engine.models.transformer import Embed
    name, first = model.names[0], model.layers[0]
    found = [first.token] if isinstance(first, Embed) else _hf_input_embedding(first)
    found = found or [m for m in first.modules() if isinstance(m, nn.Embedding)]
    if len(found) != 1 or not isinstance(found[0], nn.Embedding):
        return None
    return (found[0].num_embeddings, f"num_embeddings of layer {name!r} of the model given to engine.train",
            "give engine.train a model whose input embedding has at least {need} rows")


def _hf_input_embedding(layer) -> list:
    # engine.layers' `embed` runs a copy of the model's runner, which knows its own input embedding
    for m in layer.modules():
        if hasattr(m, "get_input_embeddings"):
            try:
                return [m.get_input_embeddings()]
            except (AttributeError, NotImplementedError):
                return []
    return []


def check_machine(job) -> None:
    """Refuse, before any worker starts, what this host cannot run (RunSetupError, exit status 2): too few
    GPUs for device.kind = "cuda", or a device.memory below what a rank holds whatever the plans choose
    (where the capacity binds: a GPU, or an `auto` memory or update plan).
    Says in one line when device.kind = "auto" leaves GPUs unused."""
    cfg = job.config
    old_torch = compat.below_floor()
    if old_torch:
        compat.say_once("floor", old_torch)
    local_world = cfg.parallel.world_size // cfg.cluster.nnodes
    try:
        kind, note = choose_device(cfg.device.kind, local_world)
    except Refused as e:
        raise RunSetupError(str(e)) from None
    if kind == "cpu" and cfg.device.kind == "auto" and cuda_count():
        print(f"trainyard: {note}", file=sys.stderr, flush=True)
    # On the CPU the capacity is a simulated figure: going over it is reported, not refused, unless a
    # plan must fit it. On a GPU it is the GPU's memory: going over it is an out-of-memory error.
    binding = ("on a GPU it is a hard limit" if kind == "cuda" else
               'memory.policy = "auto" plans against it' if cfg.memory.policy == "auto" else
               'update.placement = "auto" plans against it' if cfg.update.placement == "auto" else None)
    if cfg.capacity_bytes is not None and binding:
        _check_capacity(job, cfg.capacity_bytes, binding)


def _check_capacity(job, capacity: int, binding: str) -> None:
    """Every rank holds its layers' parameters and their gradients at once, whatever the memory policy
    (activations) and the update placement (optimizer state) decide: a capacity below that never fits."""
    import torch
    from engine.training.data import load_dataset
    from engine.models import build_model
    cfg = job.config
    if job.model is not None:
        model = job.model
    else:
        data = job.data if job.data is not None else load_dataset(cfg.data, cfg.run.seed)
        with torch.device("meta"):   # sizes only, no memory
            model = build_model(cfg.model, data.meta, cfg.run.seed)
    layer_bytes = [sum(tensor_bytes(p) for p in layer.parameters()) for layer in model.layers]
    spec = STRATEGIES[cfg.parallel.strategy]
    if spec.stages:   # each rank holds a stage of the model
        stages_of = resolve(spec.stages)
        # the fewest stages hold the most: with a range of hosts, the smallest count's world
        c = cfg.cluster
        fewest = c.host_counts[0] * (cfg.parallel.world_size // c.nnodes)
        try:
            if fewest < cfg.parallel.world_size:   # the most stages must split the model too
                stages_of(cfg, model, cfg.parallel.world_size)
            stages = stages_of(cfg, model, fewest)
        except ValueError as e:
            raise RunSetupError(f"parallel.{spec.name}: {e}") from None
        index = {name: i for i, name in enumerate(model.names)}
        # a stage naming unknown layers is the worker's to refuse, with the layers it has
        held = max(sum(layer_bytes[index[n]] for n in stage if n in index) for stage in stages)
        who = (f"the largest {spec.name} stage holds" if fewest == cfg.parallel.world_size else
               f"with {c.min_nnodes} of {c.nnodes} hosts ({fewest} stages) the largest {spec.name} stage holds")
    else:
        held = sum(layer_bytes)
        who = f"{spec.holder} holds"
    need = 2 * held   # parameters and their gradients
    if need > capacity:
        raise RunSetupError(
            f"device.memory = \"{cfg.device.memory}\" ({format_size(capacity)}; {binding}) is below the smallest "
            f"capacity this run fits: {who} {format_size(held)} of parameters and as much of gradients, whatever the "
            f"memory and update plans; set device.memory to at least {format_size(need)} ({need} bytes)")
