"""Pipeline rebalancing: every stage times its layers, the last stage decides the layout.

    clock = LayerClock(model.names)
    out = clock.forward(model.layers, start, end, x)   # runs and times layers [start, end)
    clock.backward(out, grad)                          # runs and times their backward
    rebalancer = Rebalancer(model, topo, mode="auto", threshold=0.2, check_every=10)
    decision = rebalancer.check(step, clock, stage_layers, requested=False)   # every rank, same boundary

Timing: a stage times each layer's forward around the call, and its backward from
hooks on the layers' outputs (a layer's backward starts when the gradient of its
output is ready and ends when the gradient of its input is; on the CPU autograd runs
on the calling thread, so these are the layer's own times). Each layer's output size
is noted too: it is what a stage boundary after that layer would ship.

Detection: at a check (every `check_every` steps in `auto` mode, or on the operator's
`rebalance`), every stage's per-layer means over the steps since the last check
travel to the last stage on the side group (one reduce). The last stage sums them
into stage times; when max - min exceeds the threshold (or the operator asked), it
splits the clusters exactly (engine/strategies/pipeline/partition.py) and keeps the new layout only when
its slowest stage beats the current slowest stage by more than the threshold, so
noise below the threshold never moves a layer back and forth. The decision travels
back to every stage (one broadcast), and the layers migrate during the next step
(engine/strategies/pipeline/migration.py).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.techniques.memory.room import Floors
from engine.strategies.pipeline.grid import Grid
from engine.strategies.pipeline.partition import Layout, NoFit, clusters_from, modelled, partition
from engine.strategies.pipeline.stage_times import stage_times, threshold_in_ms
from engine.training.timing import Clock, LayerSpans, first_tensor

MODES = ("auto", "manual", "off")
# Splits whose modelled slowest stages are within this fraction of the smallest are ties for the decision,
# won by the fewest boundary bytes (then the fastest of those): the layer clock's times move by a few % from
# one check to the next, so a smaller difference is not a measured one, and the model counts a boundary's bytes at the link's rate but
# not the CPU a send costs. Measured (`trainyard bench pipeline --stages 2`, six runs): the two best splits
# were modelled 0.7% to 3.4% apart and the winner changed from run to run; the one sending 8x the bytes
# (cut after a wide layer) gave after/before 1.19-1.23 in three runs against 1.29-1.32 for the other (one
# later run of it: 1.34, so part of that gap was the machine's).
TIES = 0.05


class LayerClock:
    """Per-layer forward and backward milliseconds (summed over the timed steps since the last `take`)
    and output bytes, marked by the one per-layer timer (engine/training/timing.py LayerSpans) on the
    device's clock (CUDA events on a GPU, marked as the layers are queued and read at the step's end).
    Unarmed it only runs the layers: timing every layer of every micro-batch cost about 5% of a step
    here, so a stage times a sample of its steps (see PipelineStage)."""

    def __init__(self, names: list[str], clock: Clock | None = None):
        self.names = list(names)
        self.spans = LayerSpans(clock)
        self.clock = self.spans.clock
        self.armed = True
        self.fwd_ms = [0.0] * len(names)
        self.bwd_ms = [0.0] * len(names)
        self.out_bytes = [0] * len(names)
        self.steps = 0

    def forward(self, layers, start: int, end: int, x):
        if not self.armed:
            for i in range(start, end):
                x = layers[i](x)
            return x
        for i in range(start, end):
            t0 = self.clock.mark()
            x = layers[i](x)
            self.spans.forward(i, t0)
            out = first_tensor(x)
            if out is not None:
                self.out_bytes[i] = out.numel() * out.element_size()
                if out.requires_grad:   # its gradient starts this layer's backward, the next one's ends it
                    self.spans.backward_from(i, out)
        return x

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        out.backward(grad)
        if self.armed:
            self.spans.end_backward()

    def end_step(self) -> None:
        """The step's work is queued: read its marks (on a GPU this waits for a timed step's last layer)."""
        fwd, bwd, _, _ = self.spans.read()
        for i, ms in fwd.items():
            self.fwd_ms[i] += ms
        for i, ms in bwd.items():
            self.bwd_ms[i] += ms
        self.steps += self.armed

    def take(self) -> tuple[list[float], list[int]]:
        """Mean forward+backward ms per step of every layer since the last take, and output bytes."""
        self.spans.clear()   # marks of a step not ended (a discarded step) are not a cost
        steps = max(self.steps, 1)
        ms = [(f + b) / steps for f, b in zip(self.fwd_ms, self.bwd_ms)]
        self.fwd_ms, self.bwd_ms, self.steps = [0.0] * len(self.names), [0.0] * len(self.names), 0
        return ms, list(self.out_bytes)


@dataclass
class RebalanceDecision:
    """What the last stage decided at a check; the same object on every rank."""
    step: int
    reason: str                 # "auto" or "command"
    stages: list[list[str]]     # the layout to run from the next step (== the current one if unchanged)
    changed: bool
    stage_ms: list[float]       # measured stage times under the current layout
    predicted_ms: list[float]   # the same costs under the chosen layout
    threshold_ms: float
    layer_ms: dict[str, float]
    out_bytes: dict[str, int] | None = None   # each layer's output per micro-batch (what a boundary there ships)
    link_bytes_per_ms: float = math.inf       # the boundary links' measured rate the choice counted sends at
    micro_batches: int = 1                    # how many micro-batches the costs cover
    rooms: list | None = None   # every stage's memory Room, as this check gathered them (memory.policy "auto")

    def summary(self) -> str:
        now, then = max(self.stage_ms), max(self.predicted_ms)
        if not self.changed:
            return (f"layout kept: slowest stage {now:.2f} ms, best split {then:.2f} ms "
                    f"(threshold {self.threshold_ms:.2f} ms)")
        return f"new layout: slowest stage {now:.2f} ms -> {then:.2f} ms (threshold {self.threshold_ms:.2f} ms)"


class Rebalancer:
    """`link_bytes_per_ms`: the boundary links' rate (measure_link_rate; inf: sends cost nothing);
    `micro_batches`: how many cross each boundary in a step; `grid`: stages x replicas (grid.py; by default one
    replica). With replicas the decision is made once, by replica 0's last stage, from every replica's times
    (a layer's time is its slowest replica's), and every rank gets it: every replica moves the same layers."""

    def __init__(self, model, topo, mode: str, threshold: float, check_every: int,
                 link_bytes_per_ms: float = math.inf, micro_batches: int = 1, grid: Grid | None = None):
        if mode not in MODES:
            raise ValueError(f"rebalance must be one of {', '.join(MODES)}, got {mode!r}")
        self.names, self.clusters = list(model.names), [list(c) for c in model.clusters]
        self.topo, self.mode, self.threshold, self.check_every = topo, mode, threshold, check_every
        self.link_bytes_per_ms, self.micro_batches = link_bytes_per_ms, micro_batches
        self.grid = grid or Grid.of(topo.world_size, topo.world_size)
        self.last = self.grid.rank(self.grid.stages - 1, 0)   # the side group is the world: its ranks are the world's

    def due(self, step: int, requested: bool) -> bool:
        return requested or (self.mode == "auto" and step % self.check_every == 0)

    def check(self, step: int, clock: LayerClock, stage_layers: list[list[str]], requested: bool,
              room=None) -> RebalanceDecision:
        """Every rank, at the same boundary: the last stage decides from every stage's layer times. With
        `room` (a callable giving this rank's memory Room, engine/techniques/memory/room.py: `memory.policy =
        "auto"`), every rank's travels to the last stage too, and no layout a stage cannot hold is chosen."""
        n = len(self.names)
        fits, rooms = None, None
        if room is not None:
            rooms: list = [None] * self.topo.world_size
            dist.all_gather_object(rooms, room(), group=self.topo.side)
            # a stage's room is its tightest replica's (the least capacity left besides its layers)
            fits = Floors(self.names, [min((rooms[r] for r in self.grid.group_of(s)),
                                           key=lambda room: room.capacity_bytes - room.extra_bytes)
                                       for s in range(self.grid.stages)]).fits
        ms, out_bytes = clock.take()
        mine = set(stage_layers[self.grid.stage_of(self.topo.rank)])
        vec = torch.zeros(2 * n, dtype=torch.float64)
        for i, name in enumerate(self.names):
            if name in mine:
                vec[i], vec[n + i] = ms[i], out_bytes[i]
        # a layer's figures come from the ranks that hold it (0 elsewhere): with replicas, the slowest's
        dist.reduce(vec, dst=self.last, op=dist.ReduceOp.MAX, group=self.topo.side)
        decision = self._share(step, "command" if requested else "auto", stage_layers, lambda: (
            {name: float(vec[i]) for i, name in enumerate(self.names)},
            {name: int(vec[n + i]) for i, name in enumerate(self.names)}), self.threshold, self.micro_batches, fits)
        decision.rooms = rooms   # the same on every rank: a migration's plan ahead reads them, not a second gather
        return decision

    def initial(self, model, x: torch.Tensor, y: torch.Tensor, loss_fn,
                stage_layers: list[list[str]]) -> RebalanceDecision:
        """`partition = "balanced"`: the last stage profiles the whole model on one micro-batch and
        splits it time-optimally (threshold 0); every rank gets the layout."""
        return self._share(0, "balanced", stage_layers, lambda: profile_layers(model, x, y, loss_fn), 0.0, 1)

    def _share(self, step: int, reason: str, stage_layers, measure, threshold: float,
               micro_batches: int, fits=None) -> RebalanceDecision:
        # the decision as one vector: [changed, stage of every layer, threshold, stage ms, predicted ms,
        # layer ms, layer output bytes]
        n, k = len(self.names), len(stage_layers)
        answer = torch.zeros(2 + 3 * n + 2 * k, dtype=torch.float64)
        if self.topo.rank == self.last:
            layer_ms, layer_bytes = measure()
            current, new, thr = decide(self.clusters, self.names, layer_ms, layer_bytes, stage_layers, threshold,
                                       self.link_bytes_per_ms, micro_batches, fits)
            stage_of = {name: s for s, names in enumerate(new.stages) for name in names}
            answer[0] = float(new.stages != current.stages)
            answer[1:1 + n] = torch.tensor([stage_of[name] for name in self.names], dtype=torch.float64)
            answer[1 + n] = thr
            answer[2 + n:2 + n + k] = torch.tensor(current.stage_ms, dtype=torch.float64)
            answer[2 + n + k:2 + n + 2 * k] = torch.tensor(new.stage_ms, dtype=torch.float64)
            answer[2 + n + 2 * k:2 + 2 * n + 2 * k] = torch.tensor([layer_ms[name] for name in self.names],
                                                                  dtype=torch.float64)
            answer[2 + 2 * n + 2 * k:] = torch.tensor([layer_bytes.get(name, 0) for name in self.names],
                                                     dtype=torch.float64)
        dist.broadcast(answer, src=self.last, group=self.topo.side)
        stage_idx = [int(v) for v in answer[1:1 + n].tolist()]
        stages = [[name for name, s in zip(self.names, stage_idx) if s == stage] for stage in range(k)]
        return RebalanceDecision(step=step, reason=reason, changed=bool(answer[0]), threshold_ms=float(answer[1 + n]),
                                 stages=stages, stage_ms=answer[2 + n:2 + n + k].tolist(),
                                 predicted_ms=answer[2 + n + k:2 + n + 2 * k].tolist(),
                                 layer_ms=dict(zip(self.names, answer[2 + n + 2 * k:2 + 2 * n + 2 * k].tolist())),
                                 out_bytes=dict(zip(self.names, (int(v) for v in answer[2 + 2 * n + 2 * k:].tolist()))),
                                 link_bytes_per_ms=self.link_bytes_per_ms, micro_batches=micro_batches)


def decide(clusters: list[list[str]], names: list[str], layer_ms: dict[str, float], out_bytes: dict[str, int],
           stage_layers: list[list[str]], threshold: float, link_bytes_per_ms: float = math.inf,
           micro_batches: int = 1, fits=None) -> tuple[Layout, Layout, float]:
    """The current layout's modelled costs, the layout to run next and the threshold in ms.

    The threshold decides *when*: the current layout stays while its stages differ by no more than the
    threshold, or while it is within the threshold of the best. *Which* layout: partition()'s, the
    smallest modelled slowest stage (compute plus its boundary sends: bytes over the measured link rate),
    where splits within TIES of the smallest are ties, won by the fewest boundary bytes, then the fastest.
    With `fits(stage, a, b)` (layers names[a:b] on that stage fit its memory: Floors.fits) only layouts
    every stage fits are chosen; the current one stays when none is."""
    costs = clusters_from(names, clusters, layer_ms, out_bytes)
    now = stage_times(stage_layers, layer_ms)
    current = modelled(costs, stage_layers, link_bytes_per_ms, micro_batches)
    thr = threshold_in_ms(threshold, now)
    if max(now) - min(now) <= thr and thr > 0:
        return current, current, thr
    if fits is not None:   # in clusters: cluster i starts at layer starts[i]
        starts = [0]
        for c in costs:
            starts.append(starts[-1] + len(c.layers))
        layer_fits = fits

        @functools.cache   # the tie-break's partition asks again what the optimum's asked
        def fits(stage: int, i: int, j: int) -> bool:
            return layer_fits(stage, starts[i], starts[j])
    try:
        optimum = partition(costs, len(stage_layers), 0.0, link_bytes_per_ms, micro_batches, fits)
    except NoFit:
        return current, current, thr
    best = partition(costs, len(stage_layers), TIES * optimum.max_ms, link_bytes_per_ms, micro_batches, fits)
    if current.max_ms <= best.max_ms + thr:
        return current, current, thr
    return current, best, thr


def measure_link_rate(group, rank: int, stages: int, device, nbytes: int = 4 << 20) -> float:
    """The slowest boundary's rate in bytes per ms: each pair of neighbouring stages sends `nbytes` one way
    and back (twice, the second timed), one pair after the other; every rank gets the minimum."""
    payload = torch.zeros(nbytes // 4, device=device)
    rate = torch.tensor([math.inf], dtype=torch.float64)
    for s in range(stages - 1):
        if rank not in (s, s + 1):
            continue
        peer = dist.get_global_rank(group, s + 1 if rank == s else s)
        for _ in range(2):   # the first exchange warms the connection; the second is timed
            t0 = time.perf_counter()
            if rank == s:
                dist.send(payload, dst=peer, group=group)
                dist.recv(payload, src=peer, group=group)
            else:
                dist.recv(payload, src=peer, group=group)
                dist.send(payload, dst=peer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed_ms = (time.perf_counter() - t0) * 1000
        if rank == s:
            rate[0] = min(float(rate[0]), 2 * nbytes / max(elapsed_ms, 1e-6))
    dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=group)
    return float(rate[0])


def profile_layers(model, x: torch.Tensor, y: torch.Tensor, loss_fn, repeats: int = 3) -> tuple[dict, dict]:
    """Forward+backward ms (median of `repeats` after one warm-up) and output bytes of every layer of the
    whole model on one batch, in one process: what `partition = "balanced"` and the bench start from."""
    clock = LayerClock(model.names)
    runs = []
    for r in range(repeats + 1):
        out = clock.forward(model.layers, 0, len(model.names), x)
        clock.backward(loss_fn(out, y))
        clock.end_step()
        ms, nbytes = clock.take()
        if r:
            runs.append(ms)
    model.zero_grad(set_to_none=True)
    med = [sorted(col)[len(col) // 2] for col in zip(*runs)]
    return dict(zip(model.names, med)), dict(zip(model.names, nbytes))
