"""A pipeline's layout and schedule, pure functions: which layers each stage runs (checked, uniform or as
configured), the micro-batch size, and the order of forwards and backwards a stage runs.

    ranges = check_stages(model.names, [["fc0", "act0"], ["fc1", "head"]], world_size=2, clusters=model.clusters)
    ops = schedule_ops("1f1b", stages=4, rank=1, micro_batches=8)    # [("F", 0), ("F", 1), ("F", 2), ("B", 0), ...]

Imports engine.strategies.pipeline.partition.
"""

from __future__ import annotations

from engine.strategies.pipeline.partition import Cluster, uniform

SCHEDULES = ("gpipe", "1f1b")


def check_stages(names: list[str], stage_layers: list[list[str]], world_size: int | None = None,
                 clusters: list[list[str]] | None = None) -> list[tuple[int, int]]:
    """Validate a split of `names` into stages; return each stage's [start, end) range of layer indices.

    The stages must be non-empty, contiguous and together cover `names` in order; with
    `world_size`, there must be exactly one stage per rank; with `clusters` (LayerList.clusters),
    no stage boundary may fall inside a cluster (a Block is never split)."""
    if not isinstance(stage_layers, (list, tuple)) or not stage_layers:
        raise ValueError(f"stage_layers must be a non-empty list of lists of layer names, got {stage_layers!r}")
    if world_size is not None and len(stage_layers) != world_size:
        raise ValueError(f"pipeline needs one stage per rank: {len(stage_layers)} stages but world size "
                         f"{world_size}")
    index = {name: i for i, name in enumerate(names)}
    ranges, expected = [], 0
    for s, stage in enumerate(stage_layers):
        if not isinstance(stage, (list, tuple)) or not stage:
            raise ValueError(f"stage {s} is empty; every stage needs at least one layer")
        for name in stage:
            if name not in index:
                raise ValueError(f"stage {s} names unknown layer {name!r}; layers are {', '.join(names)}")
        start = index[stage[0]]
        if start != expected:
            what = f"layer {names[expected]!r} is missing" if start > expected else f"layer {stage[0]!r} repeats"
            raise ValueError(f"stage {s} starts at {stage[0]!r} but layers must be covered in order, each "
                             f"once: {what}")
        for k, name in enumerate(stage):
            if index[name] != start + k:
                raise ValueError(f"stage {s} is not contiguous in forward order: {name!r} follows "
                                 f"{stage[k - 1]!r}, expected {names[start + k] if start + k < len(names) else 'nothing'!r}")
        expected = start + len(stage)
    if expected != len(names):
        raise ValueError(f"stages cover layers up to {names[expected - 1]!r}; layers "
                         f"{names[expected:]} are in no stage")
    ranges = [(index[st[0]], index[st[0]] + len(st)) for st in stage_layers]
    if clusters:
        for s, (start, _) in enumerate(ranges[1:], 1):
            for cluster in clusters:
                if len(cluster) > 1 and cluster[0] != names[start] and names[start] in cluster:
                    raise ValueError(f"stage {s} starts at {names[start]!r}, inside the block "
                                     f"{cluster[0].split('.')[0]!r}; a block is never split across stages")
    return ranges


def uniform_stages(model, stages: int) -> list[list[str]]:
    """The same number of clusters per stage (earlier stages take the remainder)."""
    split = uniform([Cluster(tuple(c), 0.0, 0) for c in model.clusters], stages)
    return [list(stage) for stage in split.stages]


def configured_stages(model, partition, stages: int) -> list[list[str]]:
    """`parallel.pipeline.partition`: "uniform" (uniform_stages over `stages`), or the stages as listed."""
    return uniform_stages(model, stages) if partition == "uniform" else partition


def split_micro(batch_size: int, micro_batches: int) -> int:
    """The micro-batch size; ValueError unless `batch_size` divides into `micro_batches` equal parts."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    if batch_size % micro_batches:
        raise ValueError(f"global batch of {batch_size} does not split into {micro_batches} equal micro-batches")
    return batch_size // micro_batches


def schedule_ops(schedule: str, stages: int, rank: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of ("F", i) forwards and ("B", i) backwards that stage `rank` runs."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    if schedule == "1f1b":
        warm = min(stages - rank - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        return ops
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
