"""Split a model's layers into pipeline stages.

A model is an ordered list of named layers grouped into *clusters* (`LayerList.names` /
`LayerList.clusters`, see engine/models/layers.py).  A pipeline with k stages gives each stage a
contiguous, non-empty run of clusters; stage 0 runs first.  A cluster is never split across stages.

Declaring blocks
----------------
Every loose layer of a LayerList is a cluster of its own.  To keep several layers together (a
residual branch-and-merge block, say), wrap them in a Block:

    LayerList([("fc0", nn.Linear(64, 32)), ("act0", nn.ReLU()),
               Block("res", [("split", Split()), ("left", Left()), ("merge", Merge())]),
               ("head", nn.Linear(32, 10))])

gives the clusters [["fc0"], ["act0"], ["res.split", "res.left", "res.merge"], ["head"]],
and no function here will ever put a stage boundary inside "res".

Objective
---------
`partition(clusters, k, threshold_ms, link_bytes_per_ms, micro_batches)` works in two exact steps
(dynamic programming, no heuristics):

1. Find the optimum T*: the smallest possible "largest stage cost" over all splits into k contiguous
   non-empty stages.  A stage's cost is its modelled time in a step: the sum of the `time_ms` (forward +
   backward) of its clusters, plus what it spends sending over its boundaries, each micro-batch's
   activations forward and its input's gradient back: micro_batches * (bytes in + bytes out) /
   link_bytes_per_ms.  The pipeline's modelled step time is (micro_batches + k - 1) / micro_batches times
   the largest stage cost (1F1B's bubble), so minimising the largest stage cost minimises the modelled
   step time.  With no link rate given (link_bytes_per_ms = inf) a stage's cost is its compute time alone.
2. Among all splits whose every stage time is <= T* + threshold_ms, choose the one whose boundaries carry
   the fewest activation bytes: the sum of `out_bytes` of the last cluster of every stage but the last
   (the final cluster's output never crosses a stage boundary).  Among those, the one with the smallest
   slowest stage; remaining ties go to the lexicographically smallest tuple of stage sizes (counted in
   clusters), i.e. earlier stages are kept as short as possible.

Both steps take only splits whose every stage passes `fits(stage, i, j)` when one is given (stage
`stage` holding clusters i..j-1: a rebalance asks each stage's memory floor, Floors in
engine/techniques/memory/room.py); NoFit when no split passes.

With threshold_ms = 0 the result is a time-optimal split that, among time-optimal splits, ships the
least data.  A positive threshold trades up to that many milliseconds of the slowest stage for cheaper
boundaries.  (Floating point: the limit T* + threshold_ms is widened by a relative 1e-9 so that splits
whose time equals the optimum up to rounding count as ties.)

Thresholds
----------
`threshold_in_ms(value, stage_ms)` turns a user-given threshold into milliseconds:
- value > 1            -> value milliseconds;
- 0 < value <= 1       -> that fraction of the mean stage time (so 0.1 is "10% of a mean stage", and 1.0
                          means one whole mean stage time, NOT 1 ms; write e.g. 1.001 for about 1 ms);
- value == 0           -> 0 ms.
Negative, NaN or infinite values are rejected.  The same number serves `needs_rebalance(stage_ms,
threshold_ms)`, which is true when max(stage_ms) - min(stage_ms) > threshold_ms.

Everything here is pure Python (stdlib only) and deterministic. The measured side (stage_times,
needs_rebalance, threshold_in_ms) is stage_times.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

__all__ = ["Cluster", "Layout", "NoFit", "clusters_from", "partition", "modelled", "uniform", "from_names"]

# Relative slack on T* + threshold so that rounding noise does not break ties.
_REL_EPS = 1e-9


class NoFit(ValueError):
    """No split has every stage pass `fits`."""


@dataclass(frozen=True)
class Cluster:
    """Layers that must stay in one stage, with their cost."""

    layers: tuple[str, ...]
    time_ms: float  # forward + backward time of all its layers
    out_bytes: int  # activation bytes its last layer sends to the next cluster

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a Cluster needs at least one layer")
        if not (isinstance(self.time_ms, (int, float)) and not isinstance(self.time_ms, bool)
                and math.isfinite(self.time_ms) and self.time_ms >= 0):
            raise ValueError(f"cluster {list(self.layers)}: time_ms must be a finite number >= 0, "
                             f"got {self.time_ms!r}")
        if not (isinstance(self.out_bytes, int) and not isinstance(self.out_bytes, bool)
                and self.out_bytes >= 0):
            raise ValueError(f"cluster {list(self.layers)}: out_bytes must be an int >= 0, "
                             f"got {self.out_bytes!r}")


@dataclass(frozen=True)
class Layout:
    """A split of the model into stages (layer names per stage, in model order)."""

    stages: tuple[tuple[str, ...], ...]
    stage_ms: tuple[float, ...]   # each stage's modelled cost: compute, plus its sends where a link rate is given
    max_ms: float
    boundary_bytes: int

    @property
    def imbalance_ms(self) -> float:
        """Slowest stage time minus fastest stage time."""
        return max(self.stage_ms) - min(self.stage_ms) if self.stage_ms else 0.0

    def stage_of(self, layer: str) -> int:
        """Index of the stage holding `layer`; ValueError if the layout has no such layer."""
        for i, stage in enumerate(self.stages):
            if layer in stage:
                return i
        raise ValueError(f"layer {layer!r} is in no stage of this layout")

    def moves_from(self, old: "Layout") -> list[tuple[str, int, int]]:
        """(layer, from_stage, to_stage) for every layer whose stage differs in `old`, in model order."""
        old_of = {name: i for i, stage in enumerate(old.stages) for name in stage}
        new_of = {name: i for i, stage in enumerate(self.stages) for name in stage}
        if set(old_of) != set(new_of):
            only_old = sorted(set(old_of) - set(new_of))
            only_new = sorted(set(new_of) - set(old_of))
            raise ValueError(f"layouts hold different layers: only in old {only_old}, "
                             f"only in new {only_new}")
        return [(name, old_of[name], i)
                for i, stage in enumerate(self.stages) for name in stage if old_of[name] != i]


# --------------------------------------------------------------------------- building clusters

def clusters_from(names: list[str], clusters: list[list[str]],
                  layer_ms: Mapping[str, float], out_bytes: Mapping[str, int]) -> list[Cluster]:
    """Build Clusters from `LayerList.names`/`.clusters` and per-layer measurements.

    `layer_ms[name]` is the forward + backward time of a layer and is required for
    every layer.  `out_bytes[name]` is needed for the last layer of every cluster
    except the model's final cluster (whose output never crosses a stage boundary;
    it defaults to 0 there).  Extra keys in either mapping are ignored.
    """
    flat = [name for cluster in clusters for name in cluster]
    for i, cluster in enumerate(clusters):
        if not cluster:
            raise ValueError(f"cluster {i} is empty")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"layer names repeat: {dup}")
    if flat != list(names):
        missing = [n for n in names if n not in flat]
        extra = [n for n in flat if n not in names]
        if missing:
            raise ValueError(f"clusters miss layers {missing}")
        if extra:
            raise ValueError(f"clusters name unknown layers {extra}")
        if len(flat) != len(names):
            dup = sorted({n for n in flat if flat.count(n) > 1})
            raise ValueError(f"clusters repeat layers {dup}")
        at = next(i for i, (a, b) in enumerate(zip(flat, names)) if a != b)
        raise ValueError(f"clusters are not in model order: position {at} is {flat[at]!r}, "
                         f"the model has {names[at]!r} there")
    out: list[Cluster] = []
    for ci, cluster in enumerate(clusters):
        total = 0.0
        for name in cluster:
            if name not in layer_ms:
                raise ValueError(f"no timing for layer {name!r}")
            total += layer_ms[name]
        last = cluster[-1]
        if last in out_bytes:
            nbytes = out_bytes[last]
        elif ci == len(clusters) - 1:
            nbytes = 0
        else:
            raise ValueError(f"no activation size (out_bytes) for layer {last!r}")
        out.append(Cluster(tuple(cluster), total, nbytes))
    return out


# --------------------------------------------------------------------------- helpers

def _check_stages(n: int, stages: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if stages > n:
        raise ValueError(f"cannot split {n} clusters into {stages} stages "
                         f"(more stages than clusters; every stage needs at least one cluster)")


def _transfer_ms(clusters: Sequence[Cluster], i: int, j: int, link_bytes_per_ms: float,
                 micro_batches: int) -> float:
    """What the stage of clusters i..j-1 spends sending in a step: the activations of cluster j-1 forward
    (unless it is the last stage) and the gradient of its input back (unless it is the first)."""
    if link_bytes_per_ms == math.inf:
        return 0.0
    nbytes = (clusters[i - 1].out_bytes if i > 0 else 0) + (clusters[j - 1].out_bytes if j < len(clusters) else 0)
    return micro_batches * nbytes / link_bytes_per_ms


def _layout_from_sizes(clusters: Sequence[Cluster], sizes: Sequence[int], link_bytes_per_ms: float = math.inf,
                       micro_batches: int = 1) -> Layout:
    stages: list[tuple[str, ...]] = []
    times: list[float] = []
    nbytes = 0
    start = 0
    for s, size in enumerate(sizes):
        group = clusters[start:start + size]
        stages.append(tuple(name for c in group for name in c.layers))
        t = 0.0
        for c in group:  # left-to-right, the same order partition's table uses
            t += c.time_ms
        times.append(t + _transfer_ms(clusters, start, start + size, link_bytes_per_ms, micro_batches))
        if s < len(sizes) - 1:
            nbytes += group[-1].out_bytes
        start += size
    return Layout(tuple(stages), tuple(times), max(times), nbytes)


def modelled(clusters: Sequence[Cluster], stage_names: Sequence[Sequence[str]], link_bytes_per_ms: float = math.inf,
             micro_batches: int = 1) -> Layout:
    """A given split's Layout with each stage's modelled cost (compute plus its sends), as partition() counts
    it (ValueError for a split from_names refuses)."""
    from_names(clusters, stage_names)
    cluster_of = {name: ci for ci, c in enumerate(clusters) for name in c.layers}
    sizes = [len({cluster_of[name] for name in stage}) for stage in stage_names]
    return _layout_from_sizes(clusters, sizes, link_bytes_per_ms, micro_batches)


def _segment_table(times: Sequence[float]) -> list[list[float]]:
    """seg[i][j] = time of clusters i..j-1, summed left to right (== sum(times[i:j]) bitwise)."""
    n = len(times)
    seg = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        acc = 0.0
        for j in range(i + 1, n + 1):
            acc += times[j - 1]
            seg[i][j] = acc
    return seg


def _limit(optimum: float, threshold_ms: float) -> float:
    return optimum + threshold_ms + _REL_EPS * abs(optimum)


# --------------------------------------------------------------------------- partitioners

def partition(clusters: Sequence[Cluster], stages: int, threshold_ms: float = 0.0,
              link_bytes_per_ms: float = math.inf, micro_batches: int = 1,
              fits: Callable[[int, int, int], bool] | None = None) -> Layout:
    """Best split of `clusters` into `stages` contiguous stages (see the module docstring). With `fits`,
    only splits whose every stage s of clusters i..j-1 has fits(s, i, j) (its memory: a rebalance's
    Floors); NoFit when none has."""
    n = len(clusters)
    _check_stages(n, stages)
    if isinstance(threshold_ms, bool) or not isinstance(threshold_ms, (int, float)) \
            or not math.isfinite(threshold_ms) or threshold_ms < 0:
        raise ValueError(f"threshold_ms must be a finite number >= 0, got {threshold_ms!r}")
    if not link_bytes_per_ms > 0:
        raise ValueError(f"link_bytes_per_ms must be > 0 (inf: sends cost nothing), got {link_bytes_per_ms!r}")
    times = [c.time_ms for c in clusters]
    compute = _segment_table(times)
    inf = math.inf
    # seg[i][j]: the modelled cost of a stage of clusters i..j-1 (compute, then its sends)
    seg = [[compute[i][j] + _transfer_ms(clusters, i, j, link_bytes_per_ms, micro_batches) if j > i else 0.0
            for j in range(n + 1)] for i in range(n + 1)]

    # Step 1: best[s][j] = smallest max stage time covering clusters 0..j-1 with s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            b = inf
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf or (fits is not None and not fits(s - 1, i, j)):
                    continue
                v = prev if prev > seg[i][j] else seg[i][j]
                if v < b:
                    b = v
            best[s][j] = b
    if best[stages][n] == inf:
        raise NoFit(f"no split of {n} clusters into {stages} stages fits every stage's memory")
    limit = _limit(best[stages][n], threshold_ms)

    # Step 2: over splits with every stage <= limit, the fewest boundary bytes B, and among those the
    # smallest slowest stage M: (bytes, max) is minimised exactly by taking the best suffix for each first
    # stage. Step 3: the splits with every stage <= M that send B bytes are exactly those ties (none sends
    # fewer, none is faster); the first of them in stage sizes wins.
    _, slowest = _fewest_bytes(clusters, compute, seg, stages, limit, True, fits)
    sizes = _fewest_bytes(clusters, compute, seg, stages, min(limit, _limit(slowest, 0.0)), False, fits)[1]
    return _layout_from_sizes(clusters, sizes, link_bytes_per_ms, micro_batches)


def _fewest_bytes(clusters: Sequence[Cluster], compute: list[list[float]], seg: list[list[float]], stages: int,
                  limit: float, by_time: bool, fits: Callable[[int, int, int], bool] | None = None) -> tuple:
    """The smallest (boundary bytes, slowest stage) when `by_time`, else (boundary bytes, stage sizes), over
    the splits whose every stage costs <= limit. suffix[s][i] holds the best covering clusters i..n-1 with
    s stages; both keys grow with their suffix's, so fixing the first stage and taking the best suffix is
    optimal."""
    n = len(clusters)
    suffix: list[list[tuple | None]] = [[None] * (n + 1) for _ in range(stages + 1)]
    suffix[0][n] = (0, 0.0 if by_time else ())
    for s in range(1, stages + 1):
        for i in range(n - s, -1, -1):
            if i < stages - s:  # the stages before need at least one cluster each
                continue
            cand = None
            for j in range(i + 1, n - (s - 1) + 1):
                if compute[i][j] > limit:
                    break  # times are >= 0, so longer stages only compute longer
                if seg[i][j] > limit:
                    continue  # this boundary costs too much to send; a later one may not
                if fits is not None and not fits(stages - s, i, j):
                    continue
                rest = suffix[s - 1][j]
                if rest is None:
                    continue
                cost = rest[0] + (clusters[j - 1].out_bytes if s > 1 else 0)
                key = (cost, max(seg[i][j], rest[1]) if by_time else (j - i,) + rest[1])
                if cand is None or key < cand:
                    cand = key
            suffix[s][i] = cand
    chosen = suffix[stages][0]
    assert chosen is not None, "the time-optimal split always satisfies the limit"
    return chosen


def uniform(clusters: Sequence[Cluster], stages: int) -> Layout:
    """Split by cluster count as evenly as possible; earlier stages get the extra cluster."""
    n = len(clusters)
    _check_stages(n, stages)
    base, extra = divmod(n, stages)
    return _layout_from_sizes(clusters, [base + (1 if s < extra else 0) for s in range(stages)])


def from_names(clusters: Sequence[Cluster], stage_names: Sequence[Sequence[str]]) -> Layout:
    """A user-given split: layer names per stage, stage 0 first.

    Within a stage the names may be listed in any order (the Layout stores them in
    model order), but every stage must be a contiguous run of whole clusters and the
    stages must follow the model order.  ValueError otherwise.
    """
    index: dict[str, int] = {}
    cluster_of: dict[str, int] = {}
    for ci, c in enumerate(clusters):
        for name in c.layers:
            cluster_of[name] = ci
            index[name] = len(index)
    if not stage_names:
        raise ValueError("no stages given")
    seen: dict[str, int] = {}
    for s, stage in enumerate(stage_names):
        if isinstance(stage, str):
            raise ValueError(f"stage {s} is a string ({stage!r}); give a list of layer names")
        if not stage:
            raise ValueError(f"stage {s} is empty; every stage needs at least one layer")
        for name in stage:
            if name not in index:
                raise ValueError(f"stage {s} names unknown layer {name!r}")
            if name in seen:
                where = "twice in stage" if seen[name] == s else f"in stages {seen[name]} and"
                raise ValueError(f"layer {name!r} appears {where} {s}")
            seen[name] = s
    missing = [name for name in index if name not in seen]
    if missing:
        raise ValueError(f"layers {missing} are in no stage")
    for ci, c in enumerate(clusters):
        owners = sorted({seen[name] for name in c.layers})
        if len(owners) > 1:
            label = _cluster_label(c)
            raise ValueError(f"stages {owners} split cluster {label} {list(c.layers)}; "
                             f"a block's layers must stay in one stage")
    sizes: list[int] = []
    expected = 0
    for s, stage in enumerate(stage_names):
        ids = sorted(cluster_of[name] for name in stage)
        first, last = ids[0], ids[-1]
        got = sorted(set(ids))
        if got != list(range(first, last + 1)):
            gap = next(k for k in range(first, last + 1) if k not in got)
            raise ValueError(f"stage {s} is not contiguous: it skips {list(clusters[gap].layers)}")
        if first != expected and s == 0:
            raise ValueError(f"stage 0 must start at the model's first layer "
                             f"{clusters[0].layers[0]!r}, not at {clusters[first].layers[0]!r}")
        if first != expected:
            raise ValueError(f"stage {s} is not contiguous with stage {s - 1}: stages must follow "
                             f"the model order, and stage {s} starts at "
                             f"{clusters[first].layers[0]!r}")
        sizes.append(last - first + 1)
        expected = last + 1
    return _layout_from_sizes(clusters, sizes)


def _cluster_label(c: Cluster) -> str:
    """The block name if all layers share a 'block.' prefix, else the first layer's name."""
    heads = {name.split(".", 1)[0] for name in c.layers}
    if len(heads) == 1 and all("." in name for name in c.layers):
        return repr(next(iter(heads)))
    return repr(c.layers[0])
