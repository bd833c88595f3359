"""`parallel.strategy = "param_server"`: technique 5, described before it is built: its StrategySpec
(SPEC), its settings table `[parallel.param_server]` (ParamServerConfig) and its checks. It has loops
of its own: server ranks 0 to servers-1 in the run's group, each worker apart under a supervisor. Torch-free,
on the config's floor: imports engine.config.declare, engine.telemetry.figures (its figures: FIGURES) and
engine.strategies.specs.spec."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config.declare import setting, show
from engine.strategies.specs.spec import StrategySpec
from engine.telemetry.figures import DEVICES, FLEET, LOG, Figure


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


def workers(cfg) -> tuple[int, str]:
    n = cfg.parallel.param_server.workers
    return n, f"parallel.param_server.workers = {n}"


def param_server_ranks(cfg) -> str | None:
    """param_server: `parallel.param_server.servers + workers = parallel.world_size`; `slow_workers` names
    worker ranks only; `memory.policy = "keep"` and `update.placement = "device"` (the servers update;
    the workers keep their activations)."""
    p, ps = cfg.parallel, cfg.parallel.param_server
    if ps.servers + ps.workers != p.world_size:
        return (f"parallel.param_server.servers = {ps.servers} + parallel.param_server.workers = {ps.workers} must "
                f"equal parallel.world_size = {p.world_size} (set world_size = {ps.servers + ps.workers})")
    for rank in ps.slow_workers:
        if not ps.servers <= int(rank) < p.world_size:
            return (f"parallel.param_server.slow_workers.{rank}: rank {rank} is not a worker; worker ranks are "
                    f"{ps.servers} to {p.world_size - 1}")
    if cfg.memory.policy != "keep":
        return (f'memory.policy = {show(cfg.memory.policy)}: not available with parallel.strategy = '
                f'"param_server" (use "keep")')
    if cfg.update.placement != "device":
        return (f'update.placement = {show(cfg.update.placement)}: not available with parallel.strategy = '
                f'"param_server" (its servers run the updates; use "device")')
    return None


def keeps_a_worker(cfg) -> str | None:
    """With a range of hosts, the fewest hosts (the fewest ranks) still leave a worker beside the servers."""
    c, p, ps = cfg.cluster, cfg.parallel, cfg.parallel.param_server
    per_host = p.world_size // c.nnodes
    hosts = c.host_counts[0]
    world = hosts * per_host
    if world <= ps.servers:
        return (f"with {hosts} of {c.nnodes} hosts (parallel.world_size {world}) the parameter server's "
                f"{ps.servers} servers leave no worker: set cluster.min_nnodes above "
                f"{ps.servers // per_host} or fewer servers")
    return None


def at_world(cfg, world: int):
    """The config at another world size: its servers stay, its workers are the rest."""
    p = cfg.parallel
    return replace(cfg, parallel=replace(p, world_size=world,
                                         param_server=replace(p.param_server, workers=world - p.param_server.servers)))


def has_windows(cfg) -> str | None:
    """`emulate.kill_at = "window"`: a server's window, with `sync = "soft"` or `"bsp"`."""
    e, p, ps = cfg.emulate, cfg.parallel, cfg.parallel.param_server
    at = f"emulate.kill_at = {show(e.kill_at)}"
    if p.strategy != "param_server" or ps.sync not in ("soft", "bsp"):
        return (f'{at}: needs parallel.strategy = "param_server" with parallel.param_server.sync = "soft" or '
                f'"bsp" (got parallel.strategy = {show(p.strategy)}, parallel.param_server.sync = {show(ps.sync)})')
    if e.kill_rank >= ps.servers:
        servers = "rank 0" if ps.servers == 1 else f"ranks 0 to {ps.servers - 1}"
        return f"{at}: emulate.kill_rank = {e.kill_rank} is a worker; the windows are the servers' ({servers})"
    return None


# its figures besides every run's: written into rank 0's entries by the coordinator
# (engine/strategies/param_server/coordinator.py), not exchanged
FIGURES = (
    Figure("role", "role", "none", (LOG, FLEET), optional="absent", exchanged=False),
    Figure("alive", "flag", "none", (LOG, DEVICES, FLEET), optional="absent", exchanged=False),
)

SPEC = StrategySpec(
    name="param_server",
    about="server ranks own the layers, worker ranks push each layer's gradient and pull its weights, "
          "synchronised per layer",
    settings=ParamServerConfig,
    docs="docs/param_server.md",
    split=workers,
    holder="every worker",
    commands=lambda cfg: ("pause", "resume", "stop", "checkpoint", "set-sync"),
    checks=(param_server_ranks,),
    refuses={"optim.clip_grad_norm": "its servers update each layer as its window closes, before the whole "
                                     "model's gradient norm is known",
             "emulate.slow_layer": "emulate a slow worker with parallel.param_server.slow_workers",
             "emulate.slow_rank": "a parameter server's slow workers are parallel.param_server.slow_workers"},
    moments={"window": has_windows},
    in_host_range=keeps_a_worker,
    at_world=at_world,
    loops="engine.strategies.param_server:run_server",
    apart="engine.strategies.param_server:supervise",
    apart_from=lambda cfg: cfg.parallel.param_server.servers,
    figures=FIGURES,
)
