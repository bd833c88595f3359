"""The sections about running a job rather than what it trains: checkpoints, telemetry, the cluster's hosts,
emulated trouble. Declared as every setting is (declare.py); Config (settings.py) holds them.

Imports engine.config.declare.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.declare import setting


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int = setting(0, "Write a checkpoint every N steps (0: only at exit).", min=0)
    at_end: bool = setting(True, "Write a checkpoint when the run reaches run.steps (a Hugging Face model is then "
                                 "exported from it to `<run dir>/hf/`); false: none then, and no export, for "
                                 "benches and smoke runs. A stop (a signal, a command) writes its final checkpoint "
                                 "either way.")
    keep: int = setting(3, "Checkpoints kept in the run directory (older ones are deleted).", min=1)
    background: bool = setting(True, "Write checkpoints in a background thread: the step waits only for a copy "
                                     "in host memory, and a checkpoint due while one is being written waits for "
                                     "it; false: the step waits for the whole write (docs/checkpoints.md).")


@dataclass
class TelemetryConfig:
    """Where the per-step measurements are logged, and which trackers record them."""

    log: str = setting("", "JSON-lines telemetry log path (`--telemetry-log` sets it too); empty: "
                           "`<run dir>/telemetry.jsonl`.")
    hub: bool = setting(True, "Serve live telemetry and commands on a Unix socket in the per-user runtime "
                              "directory (docs/protocol.md), for `trainyard console`, `runs` and `ctl`.")
    listen: str = setting("", "Also serve on loopback TCP, `tcp://127.0.0.1:PORT` (0: any free port); clients "
                              "then need the token from the run's token file. Only loopback addresses.")
    queue_len: int = setting(256, "Messages queued per console; a slower console loses the oldest (and is "
                                  "told how many), training never waits for it.", min=1)
    live_hz: float = setting(20.0, "Step messages sent to consoles per second at most (the latest step "
                                   "wins; events always go out). 0: every step. The log always has every step.",
                             min=0.0)
    layer_every: int = setting(10, "Time every layer's forward and backward every N steps (0: never).", min=0)
    rank_every: int = setting(100, "A step record carries every rank's full row (ledger categories, allocator, "
                                   "RSS, ...) every N steps, on the first step and after a change of policy, "
                                   "placement, plan or layout; the steps between carry each rank's step, compute "
                                   "and wait ms and memory used and peak (`per_rank`, docs/telemetry.md). The log "
                                   "keeps the layer rows measured next; consoles get them every `layer_every`.", min=1)
    log_every: int = setting(1, "Write every Nth step record to the log (steps with full rank rows always; events "
                                "and the summary always). 1: every step.", min=1)
    log_max_mb: int = setting(1024, "Start a new part of the log once this one holds this many MiB: `telemetry.jsonl`, "
                                    "`telemetry.1.jsonl`, ...; `--replay` reads them all. 0: one file.", min=0)
    tensorboard: bool = setting(False, "Record the run for TensorBoard in `<run dir>/tb/` (losses, learning rate, "
                                       "gradient norm, throughput, each rank's peak memory, events as text, the "
                                       "config as hparams), from the log, off the step (docs/telemetry.md, "
                                       "Trackers); needs tensorboard (pip install -e '.[tb]').")
    wandb: str = setting("", "Record the run in this Weights & Biases project (`PROJECT` or `ENTITY/PROJECT`), "
                             "offline under `<run dir>/wandb/` unless WANDB_MODE=online or an API key is set; "
                             "needs wandb (pip install -e '.[wandb]'). Empty: off.")
    trace_steps: str = setting("", "Record these steps with torch.profiler, `FIRST-LAST` or `N` (1-based, as the "
                                   "step records count): each rank writes a Chrome trace and a table of its "
                                   "operators' times to `<run dir>/trace/` (docs/telemetry.md). Empty: off; a "
                                   "step outside the run: nothing is recorded.", pattern=r"([0-9]+(-[0-9]+)?)?")
    tracker_queue_len: int = setting(1024, "Log records held for the trackers (tensorboard, wandb); while they are "
                                           "slower, the newer ones are dropped and counted (said at the end).",
                                     min=1)


@dataclass
class ClusterConfig:
    """Several hosts: how this host joins the run (docs/cluster.md). `trainyard run --nnodes N --node-rank R
    --rdzv-endpoint HOST:PORT` sets the first three."""

    nnodes: int = setting(1, "Hosts in the run; each runs `parallel.world_size / nnodes` workers, whose global "
                             "ranks are contiguous per host.", min=1, max=1024)
    min_nnodes: int = setting(0, "The fewest hosts a run may go on with (`--nnodes MIN:MAX` sets it, and "
                                 "nnodes = MAX); 0: nnodes, a run of one size. Every count from min_nnodes to "
                                 "nnodes is checked at the start, each refused by name. A host lost: the others "
                                 "go on from the last checkpoint once min_nnodes are there (docs/cluster.md).",
                              min=0, max=1024)
    node_rank: int = setting(0, "This host's number, 0 to nnodes-1. Host 0 serves the rendezvous at "
                                "`rdzv_endpoint` and prepares the run directory.", min=0)
    rdzv_endpoint: str = setting("", "`HOST:PORT` of host 0's c10d rendezvous (torch elastic), the same on "
                                     "every host; required when nnodes > 1.")
    rdzv_timeout_s: float = setting(120.0, "How long a host waits for the others at the rendezvous, at the "
                                           "start and after a failure, before the run fails.", min=1.0)
    last_call_s: float = setting(30.0, "With a range of hosts: once min_nnodes hosts are at the rendezvous, how "
                                       "long it waits for more before the run goes on with those there (torch's "
                                       "last_call_timeout).", min=1.0, max=3600.0)
    host_timeout_s: float = setting(15.0, "A host whose agent is silent this long is dead to the rendezvous "
                                          "(heartbeats go every second), so the others restart without it and "
                                          "it can rejoin.", min=2.0, max=3600.0)
    interface: str = setting("", "Network interface for the workers' traffic (sets GLOO_SOCKET_IFNAME and "
                                 "NCCL_SOCKET_IFNAME), e.g. `eth1`; empty: torch's choice (the host name's "
                                 "address). It must exist on every host.",
                             pattern=r"[A-Za-z0-9_.:@-]{1,15}|")

    @property
    def host_counts(self) -> range:
        """The host counts a run may have: `min_nnodes` (0: nnodes) to `nnodes`; more than one: a range of hosts
        (`--nnodes MIN:MAX`), which goes on without a lost host and grows when one joins."""
        return range(self.min_nnodes or self.nnodes, self.nnodes + 1)


@dataclass
class EmulateConfig:
    """Emulated trouble, to watch the engine answer it (demos, tests): a layer that turns slow mid-run, a rank
    that computes slower than its peers, a rank that dies mid-technique. A parameter server's slow machines
    are `parallel.param_server.slow_workers`."""

    slow_layer: str = setting("", "A layer (by name, e.g. `fc2`) whose every forward sleeps `slow_layer_ms` from "
                                  "step `slow_from_step` on, wherever it runs: a pipeline sees its stage fall "
                                  "behind and rebalances. Empty: none.")
    slow_layer_ms: float = setting(0.0, "Milliseconds each forward of `slow_layer` sleeps (per micro-batch).",
                                   min=0.0, max=10_000.0)
    slow_from_step: int = setting(0, "The first step (counted from 0) at which `slow_layer` is slow.", min=0)
    slow_rank: int = setting(-1, "A rank (data parallel: ddp, sharded) whose forward sleeps `slow_rank_ms` once a "
                                 "step from step `slow_from_step` on: a straggler, whose peers wait for it at the "
                                 "boundary (the Devices panel flags both). -1: none.", min=-1)
    slow_rank_ms: float = setting(0.0, "Milliseconds the forward of `slow_rank` sleeps each step.", min=0.0,
                                  max=10_000.0)
    kill_rank: int = setting(-1, "A rank that SIGKILLs itself the first time its technique reaches `kill_at` at "
                                 "or after step `kill_step`, in the run's first attempt only (the restarted run "
                                 "goes on): a fault in the middle of a technique's own moment, for tests of the "
                                 "restart. -1: none.", min=-1)
    kill_at: str = setting("migration", "Where `kill_rank` dies: `migration` (pipeline: a source once it sent the "
                                        "moving layers' weights and state, a target once it received them), "
                                        "`broadcast` (sharded: an owner with its slices part issued), "
                                        "`host_update` (a host update handed to the host thread, not landed), "
                                        "`window` (param_server, soft or bsp: a server whose layer window "
                                        "holds a gradient and is still open), `step` (ddp, sharded, pipeline: "
                                        "the start of a step, in the step loop), `checkpoint` (ddp, sharded, "
                                        "pipeline: a rank whose file of a checkpoint is written, the checkpoint "
                                        "not yet published).",
                           choices=("migration", "broadcast", "host_update", "window", "step", "checkpoint"))
    kill_how: str = setting("sigkill", "How `kill_rank` fails: `sigkill` (the process dies, as a machine that "
                                       "fails: the group restarts from the last checkpoint, first attempt only), "
                                       "`launcher` (it SIGKILLs its launcher, elastic agent and all: every worker "
                                       "stops within parallel.shutdown_timeout_s, first attempt only) or `error` "
                                       "(an IndexError raised there, as a model that indexes past its table: an "
                                       "error that would recur, so the run ends at once, exit status 1, naming "
                                       "the rank and step; raised in every attempt).",
                            choices=("sigkill", "launcher", "error"))
    kill_step: int = setting(0, "The first step (counted from 0) at which `kill_rank` may die.", min=0)
    nonfinite_layer: str = setting("", "A layer (by name) whose gradient gets an inf at step `nonfinite_step`, "
                                       "on `nonfinite_rank`: the step guard skips that step on every rank "
                                       "(`optim.skip_nonfinite`). Empty: none.")
    nonfinite_step: int = setting(0, "The step (counted from 0) at which `nonfinite_layer`'s gradient is inf.",
                                  min=0)
    nonfinite_rank: int = setting(-1, "The rank that computes the inf; -1: every rank that runs the layer.",
                                  min=-1)
