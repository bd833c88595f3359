"""`parallel.strategy = "sharded"`: techniques 1 and 2, described before they are built: its StrategySpec
(SPEC), its settings table `[parallel.sharded]` (ShardedConfig) and its checks. Torch-free, on the config's
floor: imports engine.config.declare, engine.telemetry.figures (its figures: FIGURES) and
engine.strategies.specs.spec."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.declare import setting, show
from engine.strategies.specs.spec import StrategySpec
from engine.telemetry.figures import DEVICES, STREAMS, ms, nbytes, own_ms


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


def slices_cover_streams(cfg) -> str | None:
    """`parallel.sharded.slices` must be at least `streams`: every stream carries at least one slice."""
    p = cfg.parallel.sharded
    if p.slices < p.streams:
        return (f"parallel.sharded.slices = {p.slices} is smaller than parallel.sharded.streams = {p.streams}: "
                f"every stream needs at least one slice (set slices >= {p.streams} or streams <= {p.slices})")
    return None


def has_broadcasts(cfg) -> str | None:
    """`emulate.kill_at = "broadcast"`: sharded's."""
    at, strategy = f"emulate.kill_at = {show(cfg.emulate.kill_at)}", cfg.parallel.strategy
    if strategy != "sharded":
        return f'{at}: needs parallel.strategy = "sharded", whose broadcast it is (got {show(strategy)})'
    return None


# its figures besides every run's (engine/strategies/sharded/strategy.py): ownership, the reduce onto owners,
# the sliced broadcast; the streams panel shows the reduce's and the broadcast's waits and spans beside the
# streams that carry them
FIGURES = (
    nbytes("owned_bytes", DEVICES),
    ms("gate_ms"),
    own_ms("reduce_ms", STREAMS),
    own_ms("reduce_span_ms", STREAMS),
    own_ms("broadcast_issue_ms"),
    own_ms("broadcast_wait_ms", STREAMS),
    own_ms("broadcast_span_ms", STREAMS),
    own_ms("host_wait_ms"),
)

SPEC = StrategySpec(
    name="sharded",
    about="every parameter has one owner rank that alone keeps its optimizer state and broadcasts its update "
          "in slices over several streams",
    settings=ShardedConfig,
    docs="docs/sharded.md",
    table_checks=(slices_cover_streams,),
    moments={"broadcast": has_broadcasts},
    builder="engine.strategies.sharded:build",
    figures=FIGURES,
)
