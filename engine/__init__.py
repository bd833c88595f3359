"""trainyard's engine, and the Python API for bringing your own model and data.

    import torch.nn as nn
    import engine
    from engine import LayerList, Block

    model = LayerList([("fc0", nn.Linear(64, 128)), ("act0", nn.ReLU()), ("head", nn.Linear(128, 10))])
    summary = engine.train({"run": {"name": "mine", "steps": 200}, "parallel": {"world_size": 2}},
                           model=model, data=engine.tensor_dataset(x_train, y_train, x_test, y_test))

`train` runs the same launcher as `trainyard run --headless`; see README.md.

The tree reads like the architecture (README.md, Layout), each package's docstring saying what lives
there and what it may import:
    config/      settings, checks, loading; [parallel] with a table per strategy (imports nothing else of engine
                 but the strategies' torch-free specs)
    models/      what is trained: the zoo, a user's LayerList, Hugging Face decoders
    training/    data, loss, optim, precision, timing: the leaves every strategy trains with
    runtime/     the ground: topology, devices and the ledger, control, lifecycle, events, comm meter,
                 checkpoint, profiler, refusal
    techniques/  planners and per-layer mechanisms: updates/ (device or host), memory/ (keep, swap,
                 recompute), partition and rebalance, parameter-server sync rules
    strategies/  base.Strategy (the contract the step loop calls), specs/ (the registry), and a package per
                 strategy, each with its torch-free spec.py: ddp/, sharded/, pipeline/, param_server/
    run/         above the strategies: launch, checks, rank setup, the step loop (worker.py), handover
    processes/   fork server, process pools, emulated clusters, children (the commands use them too)
    telemetry/   protocol (also `engine.protocol`, for consoles), hub, log, schema, progress bar
    bench/       `trainyard bench NAME`; cli.py, ctl.py: the `trainyard` command; prepare.py: `trainyard prepare`
This module imports the rest only when `train` is called (consoles import engine.protocol alone).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import Config
    from engine.training.data import Dataset
    from engine.models import LayerList

__all__ = ["train", "layers", "Config", "ConfigError", "load_config", "LayerList", "Block", "Dataset", "tensor_dataset"]

# Imported on first use, so that `engine.protocol` (what consoles import) pulls in no torch.
_LAZY = {"Config": "engine.config", "ConfigError": "engine.config", "load_config": "engine.config",
         "config_from_dict": "engine.config", "Dataset": "engine.training.data", "tensor_dataset": "engine.training.data",
         "LayerList": "engine.models", "Block": "engine.models", "layers": "engine.models.hf"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def train(config: Config | dict | str | Path, *, model: LayerList | "torch.nn.Module" | None = None, data: Dataset | None = None,
          overrides: list[str] = (), resume: str | Path | None = None, telemetry_log: str | Path | None = None,
          headless: bool = True, loss_fn=None) -> dict:
    """Train and return the run's summary (final_loss, test_accuracy, steps, wall_s, ...).

    `config` is a Config, a dict of sections (`{"run": {"steps": 100}}`) or a TOML path.
    `model` replaces `[model]`, `data` replaces `[data]`: a LayerList, or a Hugging Face decoder-only causal LM
    as it is (GPT-2 or Llama layout; `engine.layers(model)` shows the LayerList made of it). Workers never touch your objects: each
    loads its own copy of `model` from a file the launcher saves (torch.save, so define your layers'
    classes at module level), and they share one read-only copy of `data`'s tensors. When the run
    ends, `model` is given the run's final weights, loaded in place from its final checkpoint, on
    whatever devices its parameters are; if `train` raises, `model` keeps the weights it had.

    `loss_fn(output, target)`: your loss, the mean over a batch's samples (a module-level function: the
    workers load it). By default, cross entropy over the global batch's targets, those of -100 not counted
    (engine/training/loss.py).
    """
    from engine.config import Config, load_config
    from engine.processes.children import torch_cache_out_of_temp
    from engine.run.export import export_at_end, keep_hf_config
    from engine.run.launch import launch, prepare_run_dir
    from engine.processes.lifeline import mark_run
    from engine.models import LayerList
    from engine.run.rank import Job

    torch_cache_out_of_temp()   # before the check below builds models (torch._dynamo's cache: not the temp dir)

    # the model given replaces [model]: its name says so, and no built-in model's needs are checked
    overrides = [*overrides, 'model.name="user"'] if model is not None else list(overrides)
    if isinstance(config, Config):
        cfg = config if not overrides else load_config(None, overrides, base=config.to_dict())
    elif isinstance(config, dict):
        cfg = load_config(None, overrides, base=config)
    else:
        cfg = load_config(config, overrides)
    for line in cfg.renamed:   # a key written by its old name (docs/config.md, "Old names")
        warnings.warn(line, FutureWarning, stacklevel=2)
    hf_model = model if model is not None and not isinstance(model, LayerList) else None
    if hf_model is not None:
        from engine.models.hf import layers
        # a Hugging Face causal LM, as it is: its own modules, so it gets the final weights; checked against
        # its own forward at the run's sequence length (ValueError naming what differs, or the positions)
        model = layers(model, seq_len=_seq_len(cfg, data))
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, target) -> loss, got {type(loss_fn).__name__}")
    job = Job(config=cfg, model=model, data=data, resume=Path(resume) if resume else None,
              telemetry_log=Path(telemetry_log) if telemetry_log else None, headless=headless, loss_fn=loss_fn)
    mark_run(cfg.run_dir)   # every process of the run carries it (engine/processes/lifeline.py)
    prepare_run_dir(job)
    try:
        keep_hf_config(cfg, hf_model)   # what `trainyard export` rebuilds a Hugging Face model from
        summary = launch(job)
        if model is not None:
            from engine.run.handover import load_final_weights
            load_final_weights(model, cfg.run_dir)
        export_at_end(cfg)   # a Hugging Face model: runs/NAME/hf/
    finally:
        job.claim.release()   # the run folder is free for the next run
    return summary


def _seq_len(cfg, data) -> int | None:
    """The tokens a sample holds: token ids given as data (2-D integers), else a tokens or text data set's."""
    if data is not None:
        x = data.x_train
        return int(x.shape[1]) if len(x.shape) == 2 and not x.is_floating_point() else data.meta.get("seq_len")
    return cfg.data.seq_len if cfg.data.name in ("tokens", "text") else None
