"""The rules that relate keys to each other, each a function of a whole Config that returns a message or None;
its docstring goes to docs/config.md. They run after every key passed its own check (check.py), first
problem reported.

A strategy's own rules are its spec's (engine/strategies/NAME/spec.py, in the registry engine/strategies/specs/):
`table_checks`, `checks` and `checks_after_batch`, run where TABLE_CHECKS, STRATEGY_CHECKS and AFTER_BATCH stand;
`refuses` and `moments`, which the rule owning the key phrases. Imports engine.config.declare, settings, batch,
extras and files, and that registry.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re

from engine.config.batch import batch_splits_over_ranks, near_multiples, schedule_ends_low
from engine.config.declare import show
from engine.config.extras import trackers_installed
from engine.config.files import files_exist
from engine.config.settings import Config
from engine.strategies.specs import STRATEGIES, StrategySpec


def only_under(spec: StrategySpec, check):
    """A strategy's own check (its spec's `checks`) as a rule: it applies where parallel.strategy is that one."""
    @functools.wraps(check)
    def rule(cfg: Config) -> str | None:
        return check(cfg) if cfg.parallel.strategy == spec.name else None
    return rule


TABLE_CHECKS = [check for spec in STRATEGIES.values() for check in spec.table_checks]   # whichever is chosen
STRATEGY_CHECKS = [only_under(spec, check) for spec in STRATEGIES.values() for check in spec.checks]
AFTER_BATCH = [only_under(spec, check) for spec in STRATEGIES.values() for check in spec.checks_after_batch]


def either(names) -> str:
    """'"ddp", "sharded" or "pipeline"': names as a message offers them."""
    shown = [show(name) for name in names]
    return " or ".join([", ".join(shown[:-1]), shown[-1]]) if len(shown) > 1 else shown[0]


def model_matches_data(cfg: Config) -> str | None:
    """Language models take token data (`text` or `tokens`), and token data needs a language model."""
    model, data = cfg.model.name, cfg.data.name
    if model == "user":   # engine.train's model: it is the user's to fit their data
        return None
    if model in ("transformer", "hf") and data not in ("text", "tokens"):
        return (f'model.name = {show(model)}: requires data.name = "text" or "tokens" '
                f'(got data.name = {show(data)})')
    if data in ("text", "tokens") and model not in ("transformer", "hf"):
        return (f'data.name = {show(data)}: requires model.name = "transformer" or "hf" '
                f'(got model.name = {show(model)})')
    return None


def branchy_has_square_images(cfg: Config) -> str | None:
    """`model.name = "branchy"` needs square images: `data.name = "digits"`, or `"synthetic"`
    with `data.features` a perfect square."""
    if cfg.model.name != "branchy":
        return None
    if cfg.data.name not in ("digits", "synthetic"):
        return (f'model.name = "branchy": requires data.name = "digits" or "synthetic" '
                f"(got data.name = {show(cfg.data.name)})")
    n = cfg.data.features
    root = math.isqrt(n)
    if cfg.data.name == "synthetic" and root * root != n:
        return (f'data.features = {n}: must be a perfect square when model.name = "branchy" '
                f"(e.g. {root * root} or {(root + 1) ** 2})")
    return None


def heads_split_width(cfg: Config) -> str | None:
    """transformer: `model.d_model` is divisible by `model.heads`."""
    d_model, heads = cfg.model.d_model, cfg.model.heads
    if cfg.model.name == "transformer" and d_model % heads:
        return (f'model.d_model = {d_model}: must be divisible by model.heads = {heads} when '
                f'model.name = "transformer" (e.g. {near_multiples(d_model, heads)})')
    return None


def listen_is_loopback(cfg: Config) -> str | None:
    """`telemetry.listen` is empty or `tcp://HOST:PORT` with a loopback HOST (127.0.0.1, ::1, localhost)."""
    listen = cfg.telemetry.listen
    if not listen:
        return None
    m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", listen)
    if not m or int(m.group(2)) > 65535:
        return f'telemetry.listen = {show(listen)}: expected "tcp://127.0.0.1:PORT" (PORT 0 to 65535)'
    host = m.group(1).strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return (f"telemetry.listen = {show(listen)}: only loopback addresses (127.0.0.1, [::1], localhost) "
                f"are allowed; reach a remote run through an SSH tunnel")
    return None


def step_span(text: str) -> tuple[int, int] | None:
    """`telemetry.trace_steps`, its pattern checked: '20-22' -> (20, 22); '5' -> (5, 5); '' -> None (1-based, as
    step records count; engine/runtime/trace.py)."""
    if not text:
        return None
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def trace_steps_in_order(cfg: Config) -> str | None:
    """`telemetry.trace_steps` counts from step 1, its FIRST no later than its LAST."""
    span = step_span(cfg.telemetry.trace_steps)
    text = cfg.telemetry.trace_steps
    if span is not None and (span[0] < 1 or span[1] < span[0]):
        return (f"telemetry.trace_steps = {show(text)}: steps count from 1, and FIRST-LAST needs FIRST <= LAST "
                f'(like "20-22")')
    return None


def hosts_split_workers(cfg: Config) -> str | None:
    """`cluster.nnodes` divides `parallel.world_size` (the same number of workers on every host);
    `cluster.node_rank < nnodes`; `cluster.rdzv_endpoint` is `HOST:PORT` when nnodes > 1."""
    c, world = cfg.cluster, cfg.parallel.world_size
    if world % c.nnodes:
        return (f"parallel.world_size = {world}: must be divisible by cluster.nnodes = {c.nnodes} (every host "
                f"runs the same number of workers)")
    if c.node_rank >= c.nnodes:
        return f"cluster.node_rank = {c.node_rank}: must be below cluster.nnodes = {c.nnodes} (0 to {c.nnodes - 1})"
    if c.nnodes > 1 or c.rdzv_endpoint:
        m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", c.rdzv_endpoint)
        if not m or not 0 < int(m.group(2)) <= 65535:
            what = "is required when cluster.nnodes > 1" if not c.rdzv_endpoint else "is not HOST:PORT"
            return (f"cluster.rdzv_endpoint = {show(c.rdzv_endpoint)}: {what} (host 0's address and a free "
                    f"port, the same on every host, e.g. \"10.0.0.1:29400\")")
    return None


def every_host_count_holds(cfg: Config) -> str | None:
    """With a range of hosts (`cluster.min_nnodes` < `nnodes`), what a world size decides holds at every count
    from min_nnodes to nnodes, each host running `world_size / nnodes` ranks: the global batch divides the
    ranks, a parameter server keeps its servers and at least one worker (`param_server.workers` is then the
    world less the servers), an emulated rank exists; a pipeline's stage count is the world's, so a
    `partition` list (a fixed count) is refused."""
    c, p = cfg.cluster, cfg.parallel
    if c.min_nnodes > c.nnodes:
        return (f"cluster.min_nnodes = {c.min_nnodes}: must be at most cluster.nnodes = {c.nnodes} "
                f"(`--nnodes MIN:MAX`)")
    if len(c.host_counts) == 1:
        return None
    spec = STRATEGIES[p.strategy]
    refused = spec.in_host_range(cfg) if spec.in_host_range else None   # a pipeline's partition list, ...
    if refused:
        return refused
    per_host = p.world_size // c.nnodes
    for hosts in c.host_counts:
        world = hosts * per_host
        at = spec.at_world(cfg, world)
        for rule in (*STRATEGY_CHECKS, batch_splits_over_ranks, *AFTER_BATCH, slow_rank_is_whole, kill_has_its_moment):
            problem = rule(at)
            if problem:
                return f"with {hosts} of {c.nnodes} hosts (parallel.world_size {world}): {problem}"
    return None


def slow_layer_is_whole(cfg: Config) -> str | None:
    """`emulate.slow_layer` needs `emulate.slow_layer_ms` > 0, and is not available with
    `parallel.strategy = "param_server"` (whose slow machines are `parallel.param_server.slow_workers`)."""
    e = cfg.emulate
    if not e.slow_layer:
        return None
    spec = STRATEGIES[cfg.parallel.strategy]
    if "emulate.slow_layer" in spec.refuses:
        return (f"emulate.slow_layer = {show(e.slow_layer)}: not available with parallel.strategy = "
                f"{show(spec.name)} ({spec.refuses['emulate.slow_layer']})")
    return _sleeps(f"emulate.slow_layer = {show(e.slow_layer)}", "slow_layer_ms", e.slow_layer_ms,
                   "each of its forwards sleeps")


def slow_rank_is_whole(cfg: Config) -> str | None:
    """`emulate.slow_rank` names a rank of a data-parallel run and needs `emulate.slow_rank_ms` > 0."""
    e, world = cfg.emulate, cfg.parallel.world_size
    if e.slow_rank < 0:
        return None
    if "emulate.slow_rank" in STRATEGIES[cfg.parallel.strategy].refuses:
        refusing = [spec for spec in STRATEGIES.values() if "emulate.slow_rank" in spec.refuses]
        takers = either(spec.name for spec in STRATEGIES.values() if spec not in refusing)
        why = "; ".join(spec.refuses["emulate.slow_rank"] for spec in refusing)
        return f"emulate.slow_rank = {e.slow_rank}: only with parallel.strategy = {takers} ({why})"
    if e.slow_rank >= world:
        return (f"emulate.slow_rank = {e.slow_rank}: no such rank; parallel.world_size = {world} has ranks 0 to "
                f"{world - 1}")
    return _sleeps(f"emulate.slow_rank = {e.slow_rank}", "slow_rank_ms", e.slow_rank_ms, "its forward sleeps each step")


def _sleeps(setting: str, key: str, ms: float, what: str) -> str | None:
    """An emulated slow part needs how long it sleeps."""
    return f"{setting} needs emulate.{key} > 0 (how many milliseconds {what})" if ms <= 0 else None


def kill_has_its_moment(cfg: Config) -> str | None:
    """`emulate.kill_rank` names a rank of the run whose strategy has the moment `emulate.kill_at` names:
    `migration` a pipeline that rebalances, `broadcast` sharded, `host_update` updates placed on the host
    (`update.placement = "host"`, `"auto"` or a table naming `"host"`), `window` a parameter server
    (`kill_rank` one of its servers) with `parallel.param_server.sync = "soft"` or `"bsp"`."""
    e, p = cfg.emulate, cfg.parallel
    if e.kill_rank < 0:
        return None
    if e.kill_rank >= p.world_size:
        return (f"emulate.kill_rank = {e.kill_rank}: no such rank; parallel.world_size = {p.world_size} has ranks "
                f"0 to {p.world_size - 1}")
    at, spec = f"emulate.kill_at = {show(e.kill_at)}", STRATEGIES[p.strategy]
    owners = [other for other in STRATEGIES.values() if e.kill_at in other.moments]
    if owners:   # a strategy's own moment (a pipeline's migration, sharded's broadcast, a server's window)
        return owners[0].moments[e.kill_at](cfg)
    if e.kill_at in ("step", "checkpoint") and spec.loops:
        stepping = either(other.name for other in STRATEGIES.values() if not other.loops)
        return f"{at}: needs the step loop of parallel.strategy = {stepping} (got {show(spec.name)})"
    placement = cfg.update.placement
    on_host = "host" in placement.values() if isinstance(placement, dict) else placement in ("host", "auto")
    if e.kill_at == "host_update" and not on_host:
        return f'{at}: needs update.placement = "host", "auto" or a table naming "host" (got {show(placement)})'
    return None


def precision_makes_sense(cfg: Config) -> str | None:
    """bf16 weights need bf16 compute (an fp32 forward cannot multiply by bf16 weights); a bf16 sum needs
    bf16 gradients (fp32 gradients summed in bf16 would be compression, which is not built)."""
    p = cfg.precision
    if p.params == "bf16" and p.compute != "bf16":
        return (f"precision.params = \"bf16\" needs precision.compute = \"bf16\" (got {show(p.compute)}): an fp32 "
                f"forward cannot compute with bf16 weights")
    if p.reduce == "bf16" and p.params != "bf16":
        return (f"precision.reduce = \"bf16\" needs precision.params = \"bf16\" (got {show(p.params)}): fp32 "
                f"gradients are summed in fp32; summing them in bf16 would be gradient compression, which "
                f"trainyard does not do")
    return None


def evaluation_has_a_test_split(cfg: Config) -> str | None:
    """`run.eval_every` needs a test split: a tokens run's is its `data.val` file (the other data sets hold out
    `data.test_fraction` of their samples)."""
    every, d = cfg.run.eval_every, cfg.data
    if every and d.name == "tokens" and not d.val:
        return (f"run.eval_every = {every}: evaluates on a test split, and this tokens run has none (data.val is "
                f"empty): set data.val to a token file (trainyard prepare --val-fraction writes val.bin), or "
                f"run.eval_every = 0")
    return None


CROSS_CHECKS = [schedule_ends_low, hosts_split_workers, listen_is_loopback, trace_steps_in_order, *TABLE_CHECKS, model_matches_data, files_exist,
                evaluation_has_a_test_split,
                branchy_has_square_images, *STRATEGY_CHECKS, batch_splits_over_ranks, *AFTER_BATCH, heads_split_width,
                slow_layer_is_whole, slow_rank_is_whole, kill_has_its_moment, precision_makes_sense,
                every_host_count_holds, trackers_installed]
