"""engine/strategies/pipeline/partition.py: exact stage partitioning, checked against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.strategies.pipeline.partition import _REL_EPS, Cluster, Layout, NoFit, clusters_from, from_names, modelled, partition, uniform
from engine.strategies.pipeline.stage_times import needs_rebalance, stage_times, threshold_in_ms


def make(times, nbytes=None, blocks=None):
    """Clusters c0, c1, ... (cluster i has blocks[i] layers, named bi.l0, bi.l1 ... when > 1)."""
    nbytes = nbytes or [0] * len(times)
    blocks = blocks or [1] * len(times)
    out = []
    for i, (t, b, size) in enumerate(zip(times, nbytes, blocks)):
        layers = (f"c{i}",) if size == 1 else tuple(f"b{i}.l{k}" for k in range(size))
        out.append(Cluster(layers, float(t), b))
    return out


def sizes_of(layout: Layout, clusters) -> tuple[int, ...]:
    first = {c.layers[0]: i for i, c in enumerate(clusters)}
    starts = [first[stage[0]] for stage in layout.stages] + [len(clusters)]
    return tuple(b - a for a, b in zip(starts, starts[1:]))


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute(clusters, k, threshold, fits=None):
    """(optimum max stage time, chosen sizes) by enumerating every split (those `fits` passes, if given)."""
    splits = []
    for sizes in compositions(len(clusters), k):
        starts = [sum(sizes[:s]) for s in range(k + 1)]
        if fits is not None and not all(fits(s, starts[s], starts[s + 1]) for s in range(k)):
            continue
        times, nbytes, start = [], 0, 0
        for s, size in enumerate(sizes):
            times.append(sum(c.time_ms for c in clusters[start:start + size]))
            if s < k - 1:
                nbytes += clusters[start + size - 1].out_bytes
            start += size
        splits.append((sizes, times, nbytes))
    opt = min(max(t) for _, t, _ in splits)
    limit = opt + threshold + _REL_EPS * abs(opt)
    ok = [(nb, max(t), sizes) for sizes, t, nb in splits if max(t) <= limit]
    fewest = min(nb for nb, _, _ in ok)
    slowest = min(m for nb, m, _ in ok if nb == fewest)
    # among the splits sending the fewest bytes, the fastest (up to rounding), then the first in stage sizes
    tied = [sizes for nb, m, sizes in ok if nb == fewest and m <= slowest + _REL_EPS * abs(slowest)]
    return opt, min(tied), fewest


@st.composite
def problems(draw):
    n = draw(st.integers(1, 10))
    k = draw(st.integers(1, min(5, n)))
    # small integer times give many ties; a few arbitrary floats check rounding paths
    time = st.one_of(st.integers(0, 6).map(float), st.floats(0, 20, allow_nan=False))
    times = draw(st.lists(time, min_size=n, max_size=n))
    nbytes = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    blocks = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    threshold = draw(st.one_of(st.just(0.0), st.sampled_from([0.5, 1.0, 3.0]),
                               st.floats(0, 10, allow_nan=False)))
    return make(times, nbytes, blocks), k, threshold


@settings(max_examples=150, deadline=None, database=None)
@given(problems())
def test_partition_matches_brute_force(problem):
    clusters, k, threshold = problem
    layout = partition(clusters, k, threshold)
    opt, sizes, nbytes = brute(clusters, k, threshold)
    assert sizes_of(layout, clusters) == sizes
    assert layout.boundary_bytes == nbytes
    assert layout.max_ms == max(layout.stage_ms)
    assert layout.max_ms <= opt + threshold + _REL_EPS * abs(opt)
    if threshold == 0:   # the optimum, up to the rounding slack that keeps ties ties (_REL_EPS)
        assert opt <= layout.max_ms <= opt + _REL_EPS * abs(opt)
    # every stage non-empty, all layers once, in order; no cluster split
    assert len(layout.stages) == k and all(layout.stages)
    assert [n for s in layout.stages for n in s] == [n for c in clusters for n in c.layers]
    for c in clusters:
        assert len({layout.stage_of(n) for n in c.layers}) == 1
    # the time-optimum alone (threshold 0) is what brute force says
    # (hypothesis found 6, 4, 6.00000001 in 2 stages: 10.00000001 and 10 are a tie there)
    assert opt <= partition(clusters, k).max_ms <= opt + _REL_EPS * abs(opt)


@settings(max_examples=150, deadline=None, database=None)
@given(problems(), st.data())
def test_a_split_only_takes_stages_that_fit_and_is_the_best_of_those(problem, data):
    """`fits` as a rebalance asks it (each stage's memory): each cluster weighs something, each stage
    holds at most its capacity. The split is brute force's best among the splits every stage fits; NoFit
    when none does."""
    clusters, k, threshold = problem
    weight = data.draw(st.lists(st.integers(0, 4), min_size=len(clusters), max_size=len(clusters)))
    capacity = data.draw(st.lists(st.integers(0, 12), min_size=k, max_size=k))

    def fits(stage, i, j):
        return sum(weight[i:j]) <= capacity[stage]
    if not any(all(fits(s, sum(sz[:s]), sum(sz[:s + 1])) for s in range(k)) for sz in compositions(len(clusters), k)):
        with pytest.raises(NoFit, match="fits every stage's memory"):
            partition(clusters, k, threshold, fits=fits)
        return
    layout = partition(clusters, k, threshold, fits=fits)
    opt, sizes, nbytes = brute(clusters, k, threshold, fits)
    assert sizes_of(layout, clusters) == sizes and layout.boundary_bytes == nbytes


def brute_modelled(clusters, k, rate, micro):
    """(optimum modelled step cost, sizes, bytes) over every split: a stage costs its compute plus its sends
    (each micro-batch's activations out, its input's gradient back), written out apart from partition.py."""
    best = None
    n = len(clusters)
    for sizes in compositions(n, k):
        costs, nbytes, start = [], 0, 0
        for s, size in enumerate(sizes):
            t = 0.0
            for c in clusters[start:start + size]:
                t += c.time_ms
            sent = (clusters[start - 1].out_bytes if start > 0 else 0) + \
                (clusters[start + size - 1].out_bytes if start + size < n else 0)
            costs.append(t + micro * sent / rate)
            if s < k - 1:
                nbytes += clusters[start + size - 1].out_bytes
            start += size
        key = (max(costs), nbytes, sizes)
        best = key if best is None or key < best else best
    return best


@settings(max_examples=200, deadline=None, database=None)
@given(problems(), st.sampled_from([0.5, 1.0, 4.0, 1e3]), st.integers(1, 8))
def test_the_modelled_step_with_boundary_transfers_matches_brute_force(problem, rate, micro):
    """Which layout: the smallest modelled slowest stage, its sends over the boundaries included (bytes over
    the measured link rate), ties to the fewest boundary bytes, then the shorter early stages."""
    clusters, k, _ = problem
    layout = partition(clusters, k, 0.0, rate, micro)
    opt, nbytes, sizes = brute_modelled(clusters, k, rate, micro)
    assert layout.max_ms == pytest.approx(opt, rel=1e-9, abs=1e-12)
    assert modelled(clusters, layout.stages, rate, micro).max_ms == layout.max_ms
    if all(c.time_ms == int(c.time_ms) for c in clusters):   # exact arithmetic: the tie-breaks are exact too
        assert (layout.boundary_bytes, sizes_of(layout, clusters)) == (nbytes, sizes)


def test_a_costly_boundary_moves_the_split():
    """The cut after c1 computes best (5 / 4.5 ms) but ships 100 bytes per micro-batch, the cut after c0 only 1
    (4 / 5.5 ms): over a slow link the split that computes a little more but sends far less wins."""
    clusters = make([4, 1, 4.5], [1, 100, 0])
    assert partition(clusters, 2).stages == (("c0", "c1"), ("c2",))         # no link cost: 5 ms
    slow = partition(clusters, 2, 0.0, link_bytes_per_ms=50.0, micro_batches=2)
    assert slow.stages == (("c0",), ("c1", "c2"))                          # 4.04 / 5.54 ms, against 9 / 8.5
    assert slow.max_ms == pytest.approx(5.54)
    with pytest.raises(ValueError, match="link_bytes_per_ms must be > 0"):
        partition(clusters, 2, 0.0, link_bytes_per_ms=0.0)


def test_boundary_bytes_break_time_ties():
    # (1,2) and (2,1) both give stages of 4 ms; cutting after c1 ships 10 bytes, after c0 100.
    clusters = make([4, 0, 4], [100, 10, 0])
    layout = partition(clusters, 2)
    assert layout.stages == (("c0", "c1"), ("c2",))
    assert layout.boundary_bytes == 10 and layout.max_ms == 4.0
    # with equal bytes the smaller stage-size tuple wins
    assert partition(make([4, 0, 4], [10, 10, 0]), 2).stages == (("c0",), ("c1", "c2"))


def test_among_equal_bytes_within_the_threshold_the_fastest_split_wins():
    """Every cut ships 10 bytes: a threshold of 3 ms admits 5/5, 4/6 and 6/4 ms; the 5/5 split wins, though
    a shorter first stage would come first in sizes (the rebalancer's ties, rebalance.TIES, take this way)."""
    clusters = make([4, 1, 1, 4], [10, 10, 10, 0])
    layout = partition(clusters, 2, 3.0)
    assert layout.stages == (("c0", "c1"), ("c2", "c3")) and layout.max_ms == 5.0
    # fewer bytes still come first: a cheap cut at 6/4 ms beats the balanced one
    assert partition(make([4, 1, 1, 4], [10, 10, 1, 0]), 2, 3.0).stages == (("c0", "c1", "c2"), ("c3",))


def test_threshold_trades_time_for_bytes():
    clusters = make([3, 3, 2, 2], [2000, 1000, 5, 0])
    assert partition(clusters, 2).stages == (("c0", "c1"), ("c2", "c3"))  # 6 / 4 ms
    # 1.9 admits 3 / 7 ms, but that cut ships 2000 bytes; 8 / 2 ms is still out
    assert partition(clusters, 2, 1.9).stages == (("c0", "c1"), ("c2", "c3"))
    cheap = partition(clusters, 2, 2.0)  # 8 / 2 ms is within 6 + 2
    assert cheap.stages == (("c0", "c1", "c2"), ("c3",))
    assert cheap.max_ms == 8.0 and cheap.boundary_bytes == 5


def test_block_is_never_split():
    # the block is by far the heaviest part; balancing would love to cut inside it
    clusters = make([1, 10, 1], blocks=[1, 3, 1])
    for k in (1, 2, 3):
        layout = partition(clusters, k)
        assert len({layout.stage_of(n) for n in ("b1.l0", "b1.l1", "b1.l2")}) == 1
    assert partition(clusters, 3).stages == (("c0",), ("b1.l0", "b1.l1", "b1.l2"), ("c2",))


def test_layerlist_blocks_flow_through():
    from torch import nn

    from engine.models.layers import Block, LayerList

    model = LayerList([("fc0", nn.Linear(4, 4)), ("act0", nn.ReLU()),
                       Block("res", [("split", nn.Identity()), ("left", nn.Identity()),
                                     ("merge", nn.Identity())]),
                       ("head", nn.Linear(4, 2))])
    ms = {"fc0": 1.0, "act0": 1.0, "res.split": 2.0, "res.left": 2.0, "res.merge": 2.0, "head": 1.0}
    nb = {n: 16 for n in model.names}
    clusters = clusters_from(model.names, model.clusters, ms, nb)
    assert [c.layers for c in clusters][2] == ("res.split", "res.left", "res.merge")
    assert clusters[2].time_ms == 6.0
    layout = partition(clusters, 3)
    assert layout.stages == (("fc0", "act0"), ("res.split", "res.left", "res.merge"), ("head",))
    assert stage_times(layout, ms) == list(layout.stage_ms) == [2.0, 6.0, 1.0]


def test_clusters_from_validates():
    names = ["a", "b", "c"]
    ms = {"a": 1.0, "b": 2.0, "c": 3.0}
    nb = {"a": 1, "b": 2}
    got = clusters_from(names, [["a"], ["b", "c"]], ms, nb)
    assert got == [Cluster(("a",), 1.0, 1), Cluster(("b", "c"), 5.0, 0)]
    with pytest.raises(ValueError, match="no timing for layer 'b'"):
        clusters_from(names, [["a"], ["b"], ["c"]], {"a": 1.0, "c": 1.0}, nb)
    with pytest.raises(ValueError, match="miss layers \\['c'\\]"):
        clusters_from(names, [["a"], ["b"]], ms, nb)
    with pytest.raises(ValueError, match="unknown layers \\['d'\\]"):
        clusters_from(names, [["a"], ["b"], ["c", "d"]], ms, nb)
    with pytest.raises(ValueError, match="not in model order"):
        clusters_from(names, [["b"], ["a"], ["c"]], ms, nb)
    with pytest.raises(ValueError, match="repeat"):
        clusters_from(names, [["a"], ["a", "b"], ["c"]], ms, nb)
    with pytest.raises(ValueError, match="out_bytes.*'a'"):
        clusters_from(names, [["a"], ["b", "c"]], ms, {})


def test_stage_count_errors():
    clusters = make([1, 2, 3])
    with pytest.raises(ValueError, match="3 clusters into 4 stages"):
        partition(clusters, 4)
    with pytest.raises(ValueError, match="3 clusters into 4 stages"):
        uniform(clusters, 4)
    with pytest.raises(ValueError, match=">= 1"):
        partition(clusters, 0)
    with pytest.raises(ValueError, match="threshold"):
        partition(clusters, 2, -1.0)


def test_uniform():
    clusters = make([1] * 7)
    layout = uniform(clusters, 3)
    assert sizes_of(layout, clusters) == (3, 2, 2)
    assert sizes_of(uniform(clusters, 7), clusters) == (1,) * 7
    assert sizes_of(uniform(clusters, 1), clusters) == (7,)
    assert layout.stage_ms == (3.0, 2.0, 2.0) and layout.max_ms == 3.0


def test_from_names_and_its_errors():
    clusters = make([1, 2, 3, 4], [10, 20, 30, 0], blocks=[1, 2, 1, 1])  # c0, b1.l0, b1.l1, c2, c3
    layout = from_names(clusters, [["c0", "b1.l1", "b1.l0"], ["c2", "c3"]])
    assert layout.stages == (("c0", "b1.l0", "b1.l1"), ("c2", "c3"))
    assert layout.stage_ms == (3.0, 7.0) and layout.boundary_bytes == 20
    cases = [
        ([["c0", "b1.l0"], ["b1.l1", "c2", "c3"]], "split cluster 'b1'"),
        ([["c0", "c2"], ["b1.l0", "b1.l1", "c3"]], "stage 0 is not contiguous: it skips"),
        ([["b1.l0", "b1.l1"], ["c0", "c2", "c3"]], "stage 0 must start at the model's first layer"),
        ([["c0"], ["c2"], ["b1.l0", "b1.l1", "c3"]], "stage 1 is not contiguous with stage 0"),
        ([["c0", "b1.l0", "b1.l1"], ["c2"]], "layers \\['c3'\\] are in no stage"),
        ([["c0", "b1.l0", "b1.l1"], ["c2", "c3", "c2"]], "'c2' appears twice in stage 1"),
        ([["c0", "b1.l0", "b1.l1", "c2"], ["c2", "c3"]], "'c2' appears in stages 0 and 1"),
        ([["c0", "b1.l0", "b1.l1"], ["c2", "c3", "zz"]], "unknown layer 'zz'"),
        ([["c0", "b1.l0", "b1.l1", "c2", "c3"], []], "stage 1 is empty"),
        ([], "no stages"),
    ]
    for stages, message in cases:
        with pytest.raises(ValueError, match=message):
            from_names(clusters, stages)


def test_moves_from_and_stage_of():
    clusters = make([1, 1, 1, 1])
    old = uniform(clusters, 2)          # c0 c1 | c2 c3
    new = from_names(clusters, [["c0"], ["c1", "c2", "c3"]])
    assert new.moves_from(old) == [("c1", 0, 1)]
    assert old.moves_from(new) == [("c1", 1, 0)]
    assert new.moves_from(new) == []
    three = uniform(clusters, 3)        # c0 c1 | c2 | c3
    assert three.moves_from(old) == [("c3", 1, 2)]
    assert new.stage_of("c1") == 1
    with pytest.raises(ValueError, match="'nope'"):
        new.stage_of("nope")
    with pytest.raises(ValueError, match="different layers"):
        new.moves_from(uniform(make([1, 1, 1]), 2))


def test_imbalance_and_rebalance():
    layout = from_names(make([1, 5, 2]), [["c0"], ["c1"], ["c2"]])
    assert layout.imbalance_ms == 4.0
    assert needs_rebalance(list(layout.stage_ms), 3.9)
    assert not needs_rebalance(list(layout.stage_ms), 4.0)
    assert not needs_rebalance([7.0], 0.0)
    assert stage_times([["c0", "c1"], ["c2"]], {"c0": 1.0, "c1": 5.0, "c2": 2.0}) == [6.0, 2.0]
    with pytest.raises(ValueError, match="no timing for layer 'c2'"):
        stage_times(layout, {"c0": 1.0, "c1": 5.0})


def test_threshold_in_ms():
    stage_ms = [10.0, 20.0, 30.0]  # mean 20 ms
    assert threshold_in_ms(5.0, stage_ms) == 5.0        # > 1: milliseconds
    assert threshold_in_ms(3, stage_ms) == 3.0
    assert threshold_in_ms(0.1, stage_ms) == pytest.approx(2.0)  # fraction of the mean
    assert threshold_in_ms(1.0, stage_ms) == 20.0       # 1.0 is a whole mean stage, not 1 ms
    assert threshold_in_ms(0, stage_ms) == 0.0
    for bad in (-0.5, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError):
            threshold_in_ms(bad, stage_ms)
    with pytest.raises(ValueError, match="no stage times"):
        threshold_in_ms(0.5, [])
