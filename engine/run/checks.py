"""What the launcher refuses before any worker starts (RunSetupError, exit status 2): what this host cannot
run (too few GPUs, a device.memory below what a rank holds whatever the plans choose), and a Hugging Face
model that is not reproduced or a data.seq_len past its positions.

    check_machine(job); check_model(job)       # engine/run/launch.py: prepare_run_dir

Imports engine.config, engine.runtime (compat, devices, refusal), engine.strategies.pipeline (the configured
stages), and late: engine.training.data, engine.models.
"""

from __future__ import annotations

import sys

from engine.config import format_size
from engine.runtime import compat
from engine.runtime.devices import choose_device, cuda_count, tensor_bytes
from engine.runtime.refusal import Refused
from engine.strategies.pipeline import configured_stages


class RunSetupError(RuntimeError):
    """The run cannot start as asked (run directory, checkpoint); exit status 2."""


def check_model(job) -> None:
    """A `[model] name = "hf"` model is compared with its own forward before any worker starts, on a reduced
    copy built from its config (engine/models/hf/check.py): what is not reproduced, or a data.seq_len past
    its table of positions, is refused by name (RunSetupError, exit status 2). A model given to engine.train
    was checked when its LayerList was made."""
    cfg = job.config
    if cfg.model.name != "hf" or job.model is not None:
        return
    from engine.models.hf import check_files
    seq_len = cfg.data.seq_len if cfg.data.name in ("tokens", "text") else None
    try:
        check_files(cfg.model.hf_config, cfg.model.hf_weights, seq_len)
    except ValueError as e:
        raise RunSetupError(str(e)) from None


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
    if cfg.parallel.strategy == "pipeline":
        # the fewest stages hold the most: with a range of hosts, the smallest count's world
        c = cfg.cluster
        fewest = c.host_counts[0] * (cfg.parallel.world_size // c.nnodes)
        try:
            if fewest < cfg.parallel.world_size:   # the most stages must split the model too
                configured_stages(model, cfg.parallel.pipeline.partition, cfg.parallel.world_size)
            stages = configured_stages(model, cfg.parallel.pipeline.partition, fewest)
        except ValueError as e:
            raise RunSetupError(f"parallel.pipeline: {e}") from None
        index = {name: i for i, name in enumerate(model.names)}
        # a stage naming unknown layers is the worker's to refuse, with the layers it has
        held = max(sum(layer_bytes[index[n]] for n in stage if n in index) for stage in stages)
        who = ("the largest pipeline stage holds" if fewest == cfg.parallel.world_size else
               f"with {c.min_nnodes} of {c.nnodes} hosts ({fewest} stages) the largest pipeline stage holds")
    else:
        held = sum(layer_bytes)
        who = "every rank holds" if cfg.parallel.strategy != "param_server" else "every worker holds"
    need = 2 * held   # parameters and their gradients
    if need > capacity:
        raise RunSetupError(
            f"device.memory = \"{cfg.device.memory}\" ({format_size(capacity)}; {binding}) is below the smallest "
            f"capacity this run fits: {who} {format_size(held)} of parameters and as much of gradients, whatever the "
            f"memory and update plans; set device.memory to at least {format_size(need)} ({need} bytes)")
