"""`[parallel]`: what every strategy shares (which strategy, how many workers, the backend, timeouts,
restarts), and one table per strategy with its own keys, handed to that strategy whole:

    [parallel]
    strategy = "sharded"
    world_size = 4

    [parallel.sharded]
    streams = 4            # --set parallel.sharded.streams=4

A strategy's key written flat in `[parallel]` (the layout before 2026-11-26: `parallel.streams`) is still
accepted: check.py moves it into its table (MOVED) and the command says the new name in one line.
The strategies' names and their lines of docs come from their registry (engine/strategies/specs/: STRATEGIES,
torch-free); a strategy's table is declared here, its field named as the strategy. Imports declare.py and that
registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config.declare import setting, table
from engine.strategies.specs import STRATEGIES


@dataclass
class DdpConfig:
    """`strategy = "ddp"`: torch DistributedDataParallel, the baseline."""

    find_unused_parameters: bool = setting(False, "torch DistributedDataParallel's own flag: set it for a model "
                                                  "that leaves some parameter without a gradient in some step (a "
                                                  "mixture of experts with a module per expert: a rank's share may "
                                                  "route no token to one). It costs a walk of the autograd graph "
                                                  "every step; `sharded` needs no flag (a gradient that never comes "
                                                  "counts as zero). Hugging Face models keep a block's experts in "
                                                  "one tensor and need neither.")


@dataclass
class ShardedConfig:
    """`strategy = "sharded"`: every parameter has one owner rank that alone keeps its optimizer state and
    broadcasts its update in slices over several streams (docs/sharded.md)."""

    streams: int = setting(2, "Communication streams (one process group each) that carry the broadcast of "
                              "updated parameters.", min=1, max=64)
    slices: int = setting(4, "Slices each owner cuts its shard into; at least `streams`. Each slice's update goes "
                             "out as one broadcast; its gradients go to the owner as soon as backward has made "
                             "them, consecutive slices merged up to 1 MiB a message.", min=1, max=4096)
    slice_assignment: str = setting("balanced", "How slices are given to streams: `balanced` (the least loaded "
                                                "of the owner's own streams, so every owner's broadcast runs at "
                                                "once) or `random` (seeded by run.seed, the same on every rank).",
                                    choices=("balanced", "random"))
    overlap_forward: bool = setting(True, "The next step's forward of each layer waits only for the broadcasts "
                                          "carrying that layer's parameters (false: the step waits for every "
                                          "broadcast).")
    main_stream_communicates: bool = setting(False, "The compute group is one of the `streams` (false: every "
                                                    "stream is a group of its own).")
    hierarchical: bool = setting(True, "On several hosts of several workers each: gradients are summed and slices "
                                       "broadcast through one rank per host, so each byte crosses between hosts "
                                       "once (false: every rank sends to every other directly; docs/cluster.md).")


@dataclass
class PipelineConfig:
    """`strategy = "pipeline"`: one stage of consecutive layers per worker, micro-batches in flight, layers
    migrating between stages while training runs (docs/pipeline.md)."""

    micro_batches: int = setting(4, "Micro-batches per global batch (the batch must divide by it).",
                                 min=1, max=4096)
    schedule: str = setting("1f1b", "`1f1b` (one forward, one backward, after a warm-up) or `gpipe` (all "
                                    "forwards, then all backwards).", choices=("1f1b", "gpipe"))
    partition: Any = setting("uniform", "The layout at the start: `uniform` (the same number of layer clusters "
                                        "per stage), `balanced` (the last stage times every layer on the first "
                                        "micro-batch and splits the model time-optimally), or a list of "
                                        "stages, each a list of layer names: "
                                        "`[[\"fc0\", \"act0\"], [\"fc1\", \"head\"]]`. A stage is contiguous "
                                        "and never cuts a Block. A run resumed from a pipeline's checkpoint of as "
                                        "many stages continues in its layout; from any other, this decides it "
                                        "(docs/checkpoints.md).", kind="partition")
    rebalance: str = setting("auto", "`auto` (every `rebalance_check_every` steps the last stage compares stage "
                                     "times and, past `imbalance_threshold`, moves layers between stages while "
                                     "training runs), `manual` (only on the `rebalance` command, console key "
                                     "`r`) or `off` (the layout never changes; the command is refused).",
                             choices=("auto", "manual", "off"))
    imbalance_threshold: float = setting(0.25, "How far apart the slowest and fastest stage may be before a "
                                               "rebalance, and how much faster a new layout's slowest stage must "
                                               "be to be taken: above 1 in milliseconds, from 0 to 1 a fraction "
                                               "of the mean stage time.", min=0.0)
    rebalance_check_every: int = setting(10, "With `rebalance = \"auto\"`: steps between checks (the stage times "
                                             "are the mean over those steps).", min=1, max=1_000_000)


@dataclass
class ParamServerConfig:
    """`strategy = "param_server"`: `servers` ranks own the layers, `workers` ranks push each layer's gradient
    and pull its weights, synchronised per layer by `sync` (docs/param_server.md)."""

    servers: int = setting(1, "Server ranks (0 to servers-1); each owns whole layers, balanced by parameter "
                              "bytes, with their optimizer state.", min=1, max=256)
    workers: int = setting(1, "Worker ranks (servers to world_size-1), each training on its share of every "
                              "global batch; servers + workers = world_size.", min=1, max=256)
    sync: str = setting("soft", "How a layer's server combines the workers' gradients. `soft`: a window from the "
                                "earliest arrival, as long as that worker's profiled forward+backward time of "
                                "the layers before this one, then one update from what arrived; `bsp`: wait for "
                                "every worker (synchronous data parallel); `asp`: apply each gradient on "
                                "arrival; `ssp`: on arrival, with no worker more than `staleness_bound` "
                                "iterations ahead of the slowest. Live: `set-sync`.",
                        choices=("soft", "bsp", "asp", "ssp"))
    staleness_bound: int = setting(2, "With `sync = \"ssp\"`: iterations the fastest worker may run ahead of the "
                                      "slowest.", min=0, max=1_000_000)
    staleness_scaling: bool = setting(True, "A gradient s old (`staleness_unit`) counts 1/(1+s) (false: every "
                                            "gradient counts fully).")
    staleness_unit: str = setting("rounds", "With `soft`: what a gradient's staleness s counts. `rounds`: the "
                                            "full rounds' worth the layer's updates applied since its weights were "
                                            "read (their scales summed: a window of k of n fresh gradients counts "
                                            "k/n), so windows split finer do not make the same gradients staler; "
                                            "`versions`: those updates, counted (asp and ssp always count "
                                            "versions).",
                                  choices=("versions", "rounds"))
    slow_workers: Any = setting({}, "Emulate a heterogeneous cluster, e.g. `{5 = 3.0}`: worker rank 5 sleeps 2x "
                                    "each layer's forward and backward time after it, so its compute takes 3x as "
                                    "long.", kind="slow_workers")
    sync_profile_steps: int = setting(3, "Iterations every worker measures before `sync` starts (run as `bsp`; "
                                         "the first is not counted).", min=2, max=1000)


@dataclass
class ParallelConfig:
    """How the workers share the training, and how they survive failures. Each strategy's own keys are in its
    table below (`[parallel.sharded]`, ...)."""

    strategy: str = setting("ddp", "Parallel strategy. " + " ".join(
        f"`{s.name}`: {s.about} ([parallel.{s.name}]{', ' + s.docs if s.docs else ''})." for s in STRATEGIES.values()),
        choices=tuple(STRATEGIES))   # engine/strategies/specs/: each one's description, torch-free
    world_size: int = setting(2, "Worker processes on this machine.", min=1, max=256)
    backend: str = setting("auto", "Collective backend: `auto` picks nccl when every worker has its own "
                                   "CUDA GPU, otherwise gloo on the CPU.", choices=("auto", "gloo", "nccl"))
    collective_timeout_s: float = setting(60.0, "Timeout of every collective: a dead peer becomes an "
                                                "error after this long, never a hang.", min=1.0)
    max_restarts: int = setting(3, "Times the launcher restarts the worker group from the last "
                                   "checkpoint after a worker dies.", min=0)
    shutdown_timeout_s: int = setting(5, "On Ctrl-C or SIGTERM, seconds workers get to write the final "
                                         "checkpoint before they are killed (torch 2.12 and later; before, torch waits "
                                         "its own 30 s and the run says so).", min=1)
    ddp: DdpConfig = table(DdpConfig)
    sharded: ShardedConfig = table(ShardedConfig)
    pipeline: PipelineConfig = table(PipelineConfig)
    param_server: ParamServerConfig = table(ParamServerConfig)


# a strategy's key once written flat in [parallel] -> the table it lives in now
MOVED = {"parallel": {key.name: f.name for f in dataclasses.fields(ParallelConfig) if f.metadata["kind"] == "table"
                      for key in dataclasses.fields(f.default_factory)}}
