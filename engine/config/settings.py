"""Every training setting, declared once (declare.py: setting()): one typed dataclass per section, with its
default, its allowed values and a line of documentation (docs/config.md is generated from them:
engine/config/reference.py); the sections about running a job are operations.py's. Config holds them all.
Checked by engine/config/check.py, read by engine/config/load.py. ConfigError and the sizes are re-exported
from declare.py for the modules that import them here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine.config.declare import (PATTERN_WORDS, ConfigError, format_size, parse_size,  # noqa: F401
                                    setting)
from engine.config.operations import CheckpointConfig, ClusterConfig, EmulateConfig, TelemetryConfig
from engine.config.parallel import ParallelConfig


@dataclass
class RunConfig:
    """What the run is called, how long it trains and where it writes."""

    name: str = setting("trainyard", "Run name: names the run directory and the run in `trainyard runs`.",
                        pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
    steps: int = setting(100, "Optimizer steps to train (one global batch each).", min=1)
    seed: int = setting(0, "Seed for weights, data order and dropout; a run is reproducible from it.", min=0)
    dir: str = setting("runs", "Folder that holds run directories (`<dir>/<name>/`).")
    overwrite: bool = setting(False, "Start afresh even when the run directory already holds checkpoints "
                                     "(they are deleted). Without it such a start is refused.")
    eval_every: int = setting(0, "Evaluate on the test split (a tokens run's val file) every N steps, and at the "
                                 "end (0: only at the end): test accuracy, validation loss and perplexity, each "
                                 "rank its share (docs/telemetry.md, eval).", min=0)
    step_pause_ms: float = setting(0.0, "Sleep this long after every step: slows a run down for demos and "
                                        "tests that act on a run in progress.", min=0.0)


@dataclass
class ModelConfig:
    """The built-in model and its shape."""

    name: str = setting("mlp", "Built-in model, or `hf`: a Hugging Face decoder-only causal LM (any family "
                               "docs/models.md lists as equal, engine/models/hf/) built from `hf_config`, "
                               "checked against its own forward before any worker starts; needs transformers "
                               "(pip install -e '.[hf]'). `user`: the model given to engine.train (it sets "
                               "this; a config file cannot).", choices=("mlp", "transformer", "branchy", "hf", "user"))
    hf_config: str = setting("", "hf: path to the model's config.json (or the folder holding it); its weights "
                                 "are random, seeded by run.seed, unless `hf_weights` is given. Nothing is "
                                 "downloaded.")
    hf_weights: str = setting("", "hf: a local folder of safetensors weights (save_pretrained's), loaded as "
                                  "the starting point; its config.json is used when `hf_config` is empty.")
    hidden: int = setting(128, "mlp: width of each hidden layer.", min=1)
    depth: int = setting(2, "mlp: hidden layers; transformer: blocks; branchy: branch-and-merge blocks.", min=1)
    d_model: int = setting(64, "transformer: embedding width (divisible by `heads`).", min=1)
    heads: int = setting(4, "transformer: attention heads.", min=1)
    channels: int = setting(16, "branchy: channels of each convolution.", min=1)
    dropout: float = setting(0.0, "Dropout probability inside the model.", min=0.0, max=0.9)
    compile: bool = setting(False, "Compile each layer's own forward on its own (torch.compile, regional: "
                                   "engine/models/compile.py); hooks, gates and memory policies stay eager around "
                                   "it. Compile time is reported apart (`compile` events, the summary's "
                                   "`compile_s`); see docs/models.md.")


@dataclass
class DataConfig:
    """The data set, its split and the global batch."""

    name: str = setting("digits", "Data set: `digits` (8x8 handwritten digits shipped with scikit-learn), "
                                  "`text` (characters of the standard library's docstrings), "
                                  "`synthetic` (seeded random classification), `tokens` (a flat file of token "
                                  "ids, `train` and `val`, memory-mapped by every worker).",
                        choices=("digits", "text", "synthetic", "tokens"))
    train: str = setting("", "tokens: the training file, a flat array of token ids in `dtype` (what `trainyard "
                             "prepare` writes, docs/data.md, or nanoGPT's prepare.py); a relative path is from the "
                             "working directory. A meta.json beside it is checked against the model and `dtype`.")
    val: str = setting("", "tokens: the test file, in the same format; empty: no test accuracy.")
    dtype: str = setting("uint16", "tokens: the files' integer type; one that contradicts the meta.json beside "
                                   "them is refused.", choices=("uint16", "uint32"))
    vocab_size: int = setting(0, "tokens: the vocabulary (the built-in transformer's); 0: the tokenizer's "
                                 "(meta.json's `vocab_size`), else the training file's largest id + 1.", min=0)
    batch_size: int = setting(64, "Global batch (samples per optimizer step, summed over data-parallel "
                                  "ranks); divisible by the world size.", min=1)
    test_fraction: float = setting(0.2, "Share of the samples held out as the test split.", min=0.05, max=0.5)
    eval_samples: int = setting(2048, "Test samples an evaluation reads (the first N of the test split; "
                                      "targets of -100 are not counted); 0: all of them.", min=0)
    accumulate: int = setting(1, "Micro-steps per optimizer step in ddp, sharded and the parameter server's "
                                 "workers: each takes batch_size / (accumulate x data-parallel ranks) samples "
                                 "and the gradients add up before one update; the global batch stays "
                                 "`batch_size`. A pipeline accumulates over `parallel.pipeline.micro_batches` instead.",
                         min=1)
    seq_len: int = setting(32, "text: characters per sample; tokens: tokens per sample (each file is cut "
                               "into windows of seq_len + 1, overlapping by one).", min=2, max=131072)
    text_chars: int = setting(200_000, "text: characters of corpus to build.", min=1000)
    samples: int = setting(4096, "synthetic: number of samples.", min=16)
    features: int = setting(64, "synthetic: features per sample.", min=1)
    classes: int = setting(10, "synthetic: number of classes.", min=2)


@dataclass
class OptimConfig:
    """The optimizer and its hyperparameters."""

    name: str = setting("sgd", "Optimizer: `sgd` (with momentum) or `adamw`.", choices=("sgd", "adamw"))
    lr: float = setting(0.05, "Learning rate.", min=0.0)
    momentum: float = setting(0.9, "sgd: momentum.", min=0.0, max=1.0)
    weight_decay: float = setting(0.0, "Weight decay (decoupled for adamw), on every parameter: norms' weights, "
                                       "biases and embeddings too, as torch.optim.AdamW(model.parameters()) does "
                                       "(Hugging Face's Trainer leaves biases and norms' weights out; trainyard has no "
                                       "such choice yet). torch's AdamW decays by 0.01 unless told; this, by 0.",
                                  min=0.0)
    beta1: float = setting(0.9, "adamw: first-moment decay.", min=0.0, max=1.0)
    beta2: float = setting(0.999, "adamw: second-moment decay.", min=0.0, max=1.0)
    eps: float = setting(1e-8, "adamw: epsilon.", min=0.0)
    kernel: str = setting("auto", "The optimizer's implementation: `fused` (one kernel over a layer's "
                                  "tensors, on the CPU and on CUDA), `foreach` (one op per step over the "
                                  "tensor list), or `auto` (fused where this torch has it for the "
                                  "parameters' device, else foreach). The device and the host both use it, so on "
                                  "the CPU an update gives the same values whichever side runs it.",
                          choices=("auto", "fused", "foreach"))
    lr_schedule: str = setting("constant", "The learning rate over the run, a pure function of the step "
                                           "(engine/training/optim.py `lr_at`): `constant` (`lr` throughout), `cosine` or "
                                           "`linear` (after the warmup, from `lr` down to `min_lr` at the last of "
                                           "`run.steps`). Named apart from `parallel.pipeline.schedule`, the pipeline's.",
                               choices=("constant", "cosine", "linear"))
    warmup_steps: int = setting(0, "Steps of linear warmup before the schedule: step s (from 0) uses "
                                   "lr x (s + 1) / warmup_steps. Any schedule, `constant` included.", min=0)
    min_lr: float = setting(0.0, "cosine, linear: the learning rate at the end of the run (at most `lr`).",
                            min=0.0)
    clip_grad_norm: float = setting(0.0, "Clip the global gradient norm to this (every parameter counted once, "
                                         "over every rank, stage and shard), as torch's clip_grad_norm_; "
                                         "0: off.", min=0.0)
    skip_nonfinite: bool = setting(False, "Skip a step whose gradients hold inf or NaN: every rank leaves its "
                                          "weights and optimizer state as they were before the step (the parameter "
                                          "server: per layer window). Off by default, as in Megatron and DeepSpeed "
                                          "under bf16: with `clip_mode = \"speculate\"` it keeps a rollback copy "
                                          "of every layer's weights and optimizer state (docs/training.md).")
    clip_mode: str = setting("speculate", "How clipping and skipping keep per-layer updates early: `speculate` "
                                          "(host updates and a pipeline stage's device updates run as soon as "
                                          "their gradient is ready, keeping a copy of their weights and optimizer "
                                          "state until the global norm is known; a clip or skip rolls them back "
                                          "and redoes them; after a clipped or skipped step the next one waits) "
                                          "or `wait` (every update waits for the norm). sharded always decides "
                                          "before its owners update, so it never rolls back (docs/training.md).",
                            choices=("speculate", "wait"))


@dataclass
class UpdateConfig:
    """Where each layer's optimizer update runs: on the device or on the host (docs/hybrid.md)."""

    placement: Any = setting("device", "`device`: every update inline on the compute thread; `host`: every "
                                       "update on the host executor (fp32 master weights and optimizer state "
                                       "in host memory); `auto`: measured for `profile_steps` steps, then "
                                       "planned by `planner`; or a table `{layer = \"host\", ...}` (layers "
                                       "not named: device).", kind="placement")
    planner: str = setting("global", "For `auto`: `global` (the placement with the shortest modelled step "
                                     "that fits the device capacity, exact) or `local` (decided layer by layer "
                                     "as backward ends, from the host queue's finish time).",
                           choices=("global", "local"))
    host_threads: int = setting(0, "Threads that run host updates, each layer on the first free one; 0: "
                                   "this worker's share of the host's cores (cores // workers on the host).",
                                min=0, max=256)
    profile_steps: int = setting(4, "For `auto`: trial steps that measure every layer's update on both sides "
                                    "(host first, then alternating; a device step holds on the device only the "
                                    "updates whose state fits the capacity) before the plan is made.",
                                 min=2, max=1000)


@dataclass
class DeviceConfig:
    """Where each worker computes, and how much memory it may hold."""

    kind: str = setting("auto", "Worker device: `cuda` (one GPU per worker), `cpu` (a process whose memory "
                                "is counted by the ledger against `memory`), or `auto`.",
                        choices=("auto", "cpu", "cuda"))
    memory: str = setting("auto", "Capacity per worker, e.g. `512MiB`, `2GiB`, or `auto`: on a GPU its own "
                                  "memory (a size caps it below that); on the CPU 512 MiB of the ledger's "
                                  "simulated device memory. Exceeding it is reported, not hidden.",
                          kind="size")
    peak_tflops: float = setting(0.0, "The device's peak TFLOP/s for the dtype the step computes in, for the "
                                      "step records' `mfu`; 0: from the datasheet table of known GPUs "
                                      "(engine/training/throughput.py), and on the CPU none (no `mfu`).",
                                 min=0.0)


@dataclass
class PrecisionConfig:
    """The dtypes training computes in, keeps its working weights in and sums gradients in (docs/precision.md)."""

    compute: str = setting("fp32", "`bf16`: every forward and backward runs under `torch.autocast(dtype=torch."
                                   "bfloat16)` (matmuls and convolutions in bf16, reductions and the loss in "
                                   "fp32), on the CPU as on a GPU, in every strategy. `fp32`: no autocast, bit "
                                   "for bit as before.", choices=("fp32", "bf16"))
    params: str = setting("fp32", "The working copy of the weights every rank computes with. `bf16` (needs "
                                  "`compute = \"bf16\"`): bf16 weights and gradients on the device, and an fp32 "
                                  "master copy with the optimizer state only where each update runs (the owner "
                                  "in sharded, the host for a host-placed layer, the server in param_server); "
                                  "every link carrying weights or gradients carries bf16. `fp32`: fp32 weights, "
                                  "gradients and updates.", choices=("fp32", "bf16"))
    reduce: str = setting("fp32", "The dtype gradients are summed in across ranks. `fp32`: bf16 gradients are "
                                  "widened before they are summed (ddp's all-reduce carries fp32; sharded's owner "
                                  "and the parameter server receive bf16 and sum in fp32). `bf16` (needs "
                                  "`params = \"bf16\"`): summed in bf16, half the all-reduce's bytes.",
                          choices=("fp32", "bf16"))


@dataclass
class MemoryConfig:
    """What happens to each layer's saved activations between its forward and its backward."""

    policy: Any = setting("keep", "`keep` (on the device), `swap` (copied to host memory after the forward, "
                                  "brought back before the backward), `recompute` (the forward runs again in "
                                  "backward), `auto` (planned against `device.memory` after the first steps, and "
                                  "again after layers migrate), or a table of layer names to one of the three "
                                  "(layers not named: keep).", kind="policy")
    host_link_gbps: float = setting(0.0, "Device-host copy rate in GB/s (gigabytes) the plan assumes; 0: measured "
                                         "at start. On the CPU a swap is a memcpy, and a rate given here paces "
                                         "it (an emulated link).", min=0.0)
    planner: str = setting("ratio", "For `auto`: `ratio` (the default: layers by swap/recompute cost, cheapest "
                                    "swap first; swap while the link keeps up, then recompute until the stage "
                                    "fits), `reverse` (the same rule in the opposite order), `exhaustive` (every "
                                    "assignment, for stages of up to 9 layers; larger ones fall back to ratio). "
                                    "`ratio` had the best throughput across link rates in `trainyard bench "
                                    "memory` (docs/memory.md).",
                           choices=("ratio", "reverse", "exhaustive"))


@dataclass
class Config:
    # lines naming the new place of each key the config wrote by an old name (check.py); the command says them
    renamed: ClassVar[tuple[str, ...]] = ()

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def capacity_bytes(self) -> int | None:
        """`device.memory` in bytes; None for `auto` (the device's own: engine/runtime/devices.py)."""
        return None if self.device.memory == "auto" else parse_size(self.device.memory)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_to_toml(cfg: Config) -> str:
    import tomli_w  # needed only for writing
    return "# trainyard config, every key resolved (docs/config.md explains each)\n\n" + \
        tomli_w.dumps(cfg.to_dict())


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(config_to_toml(cfg))
