"""Every layout of a world of hosts x devices, and what its tightest rank holds: the memory rules of each strategy.

    rows = plan_rows(cfg, shapes, hosts=8, per_host=8, capacity_bytes=80 * 10**9)

- ddp: every rank holds every weight, its gradient, its optimizer state (and fp32 master beside bf16 weights).
- sharded: every rank holds every weight and gradient (flat buffers), the state and masters of the parameters it
  owns (engine/strategies/sharded/plan.py assign_owners, the run's rule), and a receive buffer per sender for each
  of its own gradients (engine/strategies/sharded/reduce.py: the world's other ranks; across hosts with
  `hierarchical`, the host's others and a relay per other host, and the relays it stands for).
- pipeline, S stages x R replicas: a stage holds its layers only (split as `partition` says when it lists S
  stages, otherwise uniformly by clusters: engine/strategies/pipeline/partition.py uniform), 1F1B keeps
  min(S - s, m) micro-batches in flight at stage s (gpipe: m), the last also the loss's; within a stage the
  replicas combine gradients as ddp (each holds its stage's state) or sharded (owners among R).
- host updates: the state and masters of a host-placed layer live on the host, not the device.

Activations are keep's (every layer saves what it saves); the recompute floor keeps each layer's input instead, and
one layer's saved tensors at a time (its backward's recompute). Imports engine.plan.model, the sharded owners' rule
and the pipeline's partition (pure functions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.plan.model import ModelShape
from engine.run.fit import FIT_MARGIN
from engine.strategies.pipeline.partition import Cluster, uniform
from engine.strategies.sharded.plan import assign_owners, plan_owners


@dataclass(frozen=True)
class Layout:
    strategy: str   # ddp | sharded | pipeline
    stages: int
    replicas: int
    data: str       # how a stage's replicas combine gradients: ddp | sharded ("-": one replica)

    @property
    def label(self) -> str:
        if self.strategy != "pipeline":
            return self.strategy
        return f"pipeline {self.stages}" + (f" + {self.data}" if self.replicas > 1 else "")


@dataclass
class RankFigures:
    """A rank's steady peak by the ledger's categories (engine/run/fit.py FitEstimate), in bytes."""

    parameters: int = 0
    gradients: int = 0
    master: int = 0
    optimizer_state: int = 0
    inputs: int = 0
    activations: int = 0            # keep's, every micro-batch in flight
    recompute_activations: int = 0  # the recompute floor's

    def total(self, recompute: bool = False) -> int:
        return (self.parameters + self.gradients + self.master + self.optimizer_state + self.inputs
                + (self.recompute_activations if recompute else self.activations))


def need(total: int) -> int:
    """The capacity asked: the estimate and FIT_MARGIN more, as `auto` asks (engine/run/fit.py)."""
    return int(total * (1 + FIT_MARGIN))


@dataclass
class Row:
    layout: Layout
    weights: str                  # fp32 | bf16
    updates: str                  # device | host | per layer
    configured: bool              # the config's own weights and updates
    micro_batch: int = 0          # samples a rank's forward takes at once
    in_flight: int = 1
    stage: int | None = None      # the tightest stage
    stage_layers: list[list[str]] = field(default_factory=list)
    figures: RankFigures = field(default_factory=RankFigures)
    need_bytes: int = 0           # keep
    recompute_need_bytes: int = 0
    fits: str = "no"              # keep | recompute | no
    problem: str = ""             # why the layout cannot run (the batch does not split)

    def to_json(self) -> dict:
        return dict(layout=self.layout.label, strategy=self.layout.strategy, stages=self.layout.stages,
                    replicas=self.layout.replicas, data=self.layout.data, weights=self.weights,
                    updates=self.updates, configured=self.configured, micro_batch=self.micro_batch,
                    in_flight=self.in_flight, stage=self.stage, stage_layers=self.stage_layers,
                    **asdict(self.figures), total_bytes=self.figures.total(), need_bytes=self.need_bytes,
                    recompute_need_bytes=self.recompute_need_bytes, fits=self.fits, problem=self.problem)


def layouts(world: int, clusters: int) -> list[Layout]:
    """ddp, sharded, and the pipeline at every stage count from 2 that divides the world (at most a stage per
    cluster), its replicas combining as ddp or sharded."""
    out = [Layout("ddp", 1, world, "ddp"), Layout("sharded", 1, world, "sharded")]
    for s in range(2, min(world, clusters) + 1):
        if world % s == 0:
            r = world // s
            out += [Layout("pipeline", s, r, d) for d in (("ddp", "sharded") if r > 1 else ("-",))]
    return out


def host_layers(placement, names: list[str]) -> set[str]:
    """The layers an update placement puts on the host (`auto` is planned all on the device)."""
    if placement == "host":
        return set(names)
    if isinstance(placement, dict):
        return {n for n, side in placement.items() if side == "host"}
    return set()


BETTER = {"no": 0, "recompute": 1, "keep": 2}


def plan_rows(cfg, shapes: dict[str, ModelShape], hosts: int, per_host: int, capacity_bytes: int) -> list[Row]:
    """Every layout under the config's weights and updates; where that does not fit, the other weights (bf16
    where the config's are fp32) and host updates, each where it fits."""
    configured = cfg.precision.params
    shape = shapes[configured]
    world = hosts * per_host
    placement = cfg.update.placement
    said = "host" if placement == "host" else "per layer" if isinstance(placement, dict) else "device"
    variants = [(configured, said)] + [(w, u) for w in shapes for u in ("device", "host")
                                       if (w, u) != (configured, said)]
    rows = []
    for layout in layouts(world, len(shape.clusters)):
        base = None
        for weights, updates in variants:
            on_host = host_layers(placement if updates == "per layer" else updates, shapes[weights].names)
            row = rank_row(cfg, shapes[weights], layout, per_host, on_host)
            row.weights, row.updates, row.configured = weights, updates, base is None
            if not row.problem:
                row.fits = ("keep" if row.need_bytes <= capacity_bytes else
                            "recompute" if row.recompute_need_bytes <= capacity_bytes else "no")
            if base is None or BETTER[row.fits] > BETTER[base.fits]:   # where it changes the answer
                rows.append(row)
            base = base or row
    return rows


def rank_row(cfg, shape: ModelShape, layout: Layout, per_host: int, on_host: set[str]) -> Row:
    """The figures of the layout's tightest rank (the stage that needs the most, the owner that holds the most)."""
    row = Row(layout, shape.params, "", False)
    batch, world = cfg.data.batch_size, layout.stages * layout.replicas
    if layout.strategy == "pipeline":
        m = cfg.parallel.pipeline.micro_batches
        parts = layout.replicas * m
        if batch % parts:
            row.problem = f"data.batch_size = {batch} does not split into {layout.replicas} replicas x {m} micro-batches"
            return row
        row.micro_batch = batch // parts
        stages = stage_split(cfg, shape, layout.stages)
        row.stage_layers = stages
        best = None
        for s, names in enumerate(stages):
            flight = m if cfg.parallel.pipeline.schedule == "gpipe" else min(layout.stages - s, m)
            fig = _figures(cfg, shape, names, row.micro_batch, flight, s == len(stages) - 1, on_host,
                           layout.replicas if layout.data == "sharded" else 1, 0, pipeline=True)
            if best is None or need(fig.total()) > need(best[1].total()):
                best = (s, fig, flight)
            row.recompute_need_bytes = max(row.recompute_need_bytes, need(fig.total(recompute=True)))
        row.stage, row.figures, row.in_flight = best
    else:
        parts = world * cfg.data.accumulate
        if batch % parts:
            row.problem = (f"data.batch_size = {batch} does not split into {world} ranks x data.accumulate = "
                           f"{cfg.data.accumulate}")
            return row
        row.micro_batch = batch // parts
        owners = world if layout.strategy == "sharded" else 1
        tiers = per_host if (cfg.parallel.sharded.hierarchical and 1 < per_host < world) else 0
        row.figures = _figures(cfg, shape, shape.names, row.micro_batch, 1, True, on_host, owners, tiers)
        row.recompute_need_bytes = need(row.figures.total(recompute=True))
    row.need_bytes = need(row.figures.total())
    return row


def stage_split(cfg, shape: ModelShape, stages: int) -> list[list[str]]:
    """The config's `partition` where it lists this many stages; otherwise uniform by clusters (the run's start
    under `uniform`)."""
    listed = cfg.parallel.pipeline.partition
    if isinstance(listed, list) and len(listed) == stages:
        return [list(s) for s in listed]
    split = uniform([Cluster(tuple(c), 0.0, 0) for c in shape.clusters], stages)
    return [list(s) for s in split.stages]


def _figures(cfg, shape: ModelShape, names: list[str], samples: int, flight: int, last: bool, on_host: set[str],
             owners: int, tiers: int, pipeline: bool = False) -> RankFigures:
    """The tightest rank of a group of `owners` ranks holding the layers `names` (owners 1: each holds all the
    state). `tiers`: devices per host where sharded sums gradients host by host."""
    held: list[int] = []
    home: dict[int, str] = {}
    for n in names:
        for i in shape.layer_params[n]:
            if i not in home:
                home[i] = n
                held.append(i)
    nbytes = [shape.numel[i] * shape.width[i] for i in held]
    if pipeline and owners > 1:   # sharded replicas own whole layers (engine/strategies/pipeline/shards.py)
        sizes = {k: sum(b for i, b in zip(held, nbytes) if home[i] == n) for k, n in enumerate(names)}
        by_layer = plan_owners([list(range(len(names)))], sizes, owners)
        owner = [by_layer[names.index(home[i])] for i in held]
    else:
        owner = assign_owners(nbytes, owners) if owners > 1 else [0] * len(held)
    guard = cfg.optim.clip_grad_norm > 0 or cfg.optim.skip_nonfinite
    rollback = pipeline and guard and cfg.optim.clip_mode == "speculate"   # a stage's device updates keep a copy
    owned_numel = [0] * owners
    for i, o in zip(held, owner):
        owned_numel[o] += shape.numel[i]
    width = shape.width[held[0]] if held else 4
    best = None
    for rank in range(owners):
        fig = RankFigures(parameters=sum(nbytes), gradients=sum(nbytes))
        for i, o in zip(held, owner):
            if o != rank or home[i] in on_host:
                continue
            wide = 4 * shape.numel[i] if shape.width[i] < 4 else 0
            fig.master += wide
            fig.optimizer_state += shape.state[i] + ((4 * shape.numel[i] + shape.state[i]) if rollback else 0)
        if not pipeline:   # sharded's receive buffers; sharded replicas reduce in place
            fig.gradients += width * _received(rank, owned_numel, tiers)
        if best is None or fig.total() > best.total():
            best = fig
    acts = [shape.activations(n, samples) for n in names]
    positions = [shape.names.index(n) for n in names]
    loss = shape.loss_bytes(samples) if last else 0
    best.inputs = shape.input_bytes(samples)
    best.activations = flight * (sum(acts) + loss)
    best.recompute_activations = flight * (sum(shape.layer_input(p, samples) for p in positions) + loss) \
        + (max(acts) if acts else 0)
    return best


def _received(rank: int, owned_numel: list[int], tiers: int) -> int:
    """Elements of the gradient receive buffers sharded keeps on `rank` (engine/strategies/sharded/reduce.py)."""
    world = len(owned_numel)
    if world == 1:
        return 0
    if not tiers:
        return owned_numel[rank] * (world - 1)
    hosts, host, local = world // tiers, rank // tiers, rank % tiers
    own = owned_numel[rank] * (tiers - 1 + hosts - 1)
    relayed = sum(owned_numel[o] for o in range(world) if o // tiers != host and o % tiers == local)
    return own + relayed * (tiers - 1)
