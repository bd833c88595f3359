"""A migration never takes a stage over its capacity: the new layout's activation policies are planned before
the layers move (engine/techniques/memory/policy.py: plan_ahead), from the costs measured where each layer ran
and the bytes each brings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import MemoryConfig
from engine.models import LayerList
from engine.runtime.devices import LedgerDevice
from engine.techniques.memory import ActivationPolicy, ActivationCost, Floors, Room, estimate
from engine.strategies.pipeline.rebalance import decide
from tests.conftest import ROOT, read_jsonl

TOUR = str(ROOT / "demo" / "configs" / "tour.toml")


def _policy(names: list[str], capacity: int, owned: list[str], static: int, flight: int) -> ActivationPolicy:
    model = LayerList([(n, torch.nn.Identity()) for n in names])
    device = LedgerDevice(capacity)
    device.ledger.extra["parameters"] = static
    policy = ActivationPolicy(model, device, MemoryConfig(policy="auto", host_link_gbps=1.0),
                              owned=lambda: owned, in_flight=lambda: flight)
    return policy


@settings(max_examples=120, deadline=None, database=None)
@given(st.data())
def test_the_plan_ahead_of_a_migration_fits_whenever_any_plan_can(data):
    """Random layers, a random split of them into this stage's own and arriving ones, random costs, static
    bytes and capacity: the policies planned ahead hold the migration step within the capacity whenever
    recomputing or swapping every layer would; otherwise every layer is recomputed (the least it can hold)."""
    n = data.draw(st.integers(2, 7))
    names = [f"l{i}" for i in range(n)]
    cut = data.draw(st.integers(1, n - 1))
    own, arriving = names[:cut], names[cut:]
    costs = {name: ActivationCost(name, act_bytes=data.draw(st.integers(0, 4000)),
                                  in_bytes=data.draw(st.integers(0, 500)),
                                  fwd_ms=data.draw(st.floats(0.01, 5)), bwd_ms=data.draw(st.floats(0.01, 10)))
             for name in names}
    static, brought = data.draw(st.integers(0, 5000)), data.draw(st.integers(0, 5000))
    flight = data.draw(st.integers(1, 4))
    capacity = data.draw(st.integers(1000, 40000))
    policy = _policy(names, capacity, own, static, flight)
    made = policy.plan_ahead(names, costs, brought)
    held = [costs[name] for name in names]
    chosen = {name: policy.policy[name] for name in names}
    base = static + brought
    floors = [estimate(held, dict.fromkeys(names, p), base, flight, policy.link_bytes_per_ms) for p in ("recompute", "swap")]
    if min(floors) <= capacity:
        assert estimate(held, chosen, base, flight, policy.link_bytes_per_ms) <= capacity, (chosen, made)
    else:
        assert set(chosen.values()) == {"recompute"}
    assert not policy.provisional & set(names)


@settings(max_examples=150, deadline=None, database=None)
@given(st.data())
def test_a_stages_floor_is_the_cost_models_peak_with_every_free_layer_recomputed(data):
    """Floors (what a rebalance asks of each stage) against cost.estimate, for every contiguous run of
    random layers on random stages: equal to the model's peak with every layer recomputed but those an
    operator kept, plus the layers' static bytes and the stage's own."""
    n = data.draw(st.integers(1, 7))
    names = [f"l{i}" for i in range(n)]
    costs = {name: ActivationCost(name, act_bytes=data.draw(st.integers(0, 4000)), in_bytes=data.draw(st.integers(0, 500)),
                                  fwd_ms=1.0, bwd_ms=2.0, shared_next=data.draw(st.integers(0, 300)))
             for name in names}
    static = {name: data.draw(st.integers(0, 5000)) for name in names}
    kept = {name: "keep" for name in names if data.draw(st.booleans())}
    rooms = [Room(capacity_bytes=data.draw(st.integers(0, 60000)), in_flight=data.draw(st.integers(1, 4)),
                  extra_bytes=data.draw(st.integers(0, 3000)), costs=costs, static=static, pinned=kept)
             for _ in range(3)]
    floors = Floors(names, rooms)
    for stage, room in enumerate(rooms):
        for a in range(n):
            for b in range(a + 1, n + 1):
                held = [costs[name] for name in names[a:b]]
                policies = {c.name: kept.get(c.name, "recompute") for c in held}
                want = estimate(held, policies, room.extra_bytes + sum(static[x] for x in names[a:b]),
                                room.in_flight, 1.0)
                assert floors.floor(stage, a, b) == want, (stage, a, b)
                assert floors.fits(stage, a, b) == (want <= room.capacity_bytes)


def test_a_rebalance_never_picks_a_layout_a_stage_cannot_hold():
    """The tour's failure on a clean clone: a slowed last block drew seven layers to stage 0, more than its
    8 MiB held even recomputed, and the run was refused. With the stages' floors the check takes the best
    layout both hold, and keeps the current one when none is."""
    names = ["a", "b", "c", "d"]
    ms = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 9.0}
    nbytes = dict.fromkeys(names, 0)
    skewed = [["a"], ["b", "c", "d"]]
    _, free, _ = decide([[n] for n in names], names, ms, nbytes, skewed, 0.0)
    assert free.stages == (("a", "b", "c"), ("d",))
    # stage 0 holds at most two layers of 1,000 static bytes
    static = dict.fromkeys(names, 1000)
    rooms = [Room(capacity_bytes=2000, in_flight=2, extra_bytes=0, static=static),
             Room(capacity_bytes=10**9, in_flight=1, extra_bytes=0, static=static)]
    _, held, _ = decide([[n] for n in names], names, ms, nbytes, skewed, 0.0, fits=Floors(names, rooms).fits)
    assert held.stages == (("a", "b"), ("c", "d"))
    rooms[0].capacity_bytes = 500   # not one layer fits stage 0: the layout stays
    current, kept, _ = decide([[n] for n in names], names, ms, nbytes, skewed, 0.0, fits=Floors(names, rooms).fits)
    assert kept.stages == current.stages == (("a",), ("b", "c", "d"))


def test_a_layer_never_measured_is_recomputed_when_planned_ahead():
    names = ["a", "b", "c"]
    policy = _policy(names, 1 << 20, ["a"], 0, 1)
    policy.plan_ahead(names, {"a": ActivationCost("a", 100, 10, 1.0, 2.0)}, 0)
    assert policy.policy["b"] == policy.policy["c"] == "recompute" and policy.policy["a"] == "keep"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_tours_migrations_never_go_over_its_capacity(cli):
    """The tour at its 8 MiB capacity, with its two rebalances brought forward (the skewed start at step 10,
    the slowed layer from step 21, decided at 30 or later; a threshold of 5% so that decision never hangs on
    timing noise): every rank's ledger stays within the capacity at every step, through both
    migrations. (Planned after the move instead, rank 0 peaked at 10,047,520 bytes in the first migration
    step, as the tour's 9.6 MiB at step 101.) The slowed layer is stage 0's block0.mlp, so the second move
    sends layers to the last stage, which holds one micro-batch in flight: the tour's block3.mlp drew seven
    layers to stage 0, more than it holds even recomputed, and a check keeps a layout no stage can hold
    (test_a_rebalance_never_picks_a_layout_a_stage_cannot_hold), so whether that second move came hung on timing."""
    log = cli.tmp_path / "tour.jsonl"
    r = cli.run("run", TOUR, "--headless", "--steps", "52", *cli.base_args("tour"), "--set", "run.eval_every=0",
                "--set", "parallel.pipeline.rebalance_check_every=10", "--set", "emulate.slow_from_step=21",
                "--set", "emulate.slow_layer=block0.mlp",
                "--set", "emulate.slow_layer_ms=40", "--set", "parallel.pipeline.imbalance_threshold=0.05",
                "--set", "telemetry.rank_every=1", "--set", "checkpoint.every=0", "--telemetry-log", str(log),
                timeout=390)
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    moved = [rec["step"] for rec in records if rec.get("kind") == "migration"]
    # the skewed start always moves; the slowed layer's move comes where the stages' floors allow it, and they
    # follow the hybrid trial's timed placement (a layer's update on the device carries its optimizer state):
    # seen here at step 31, on a clean clone not at all. Either way every check after the slowdown decided.
    assert moved and moved[0] <= 12, moved
    checked = [rec["step"] for rec in records if rec.get("kind") == "rebalance"]
    assert len(moved) >= 2 or not [s for s in checked if s >= 30], (moved, checked)
    over = [rec for rec in records if rec.get("kind") == "memory_over_capacity"]
    assert not over, over
    for rec in records:
        if rec["type"] == "step":
            for rank in rec["ranks"]:
                assert rank["peak_bytes"] <= rank["capacity_bytes"], (rec["step"], rank["rank"], rank["peak_bytes"])


def around(records: list[dict], over: list[dict], steps: int = 3) -> str:
    """A failure's context: each over-capacity event, the events of the steps around it, and the rank's peak and
    capacity at each of those steps."""
    lines = []
    for event in over:
        step, rank = event["step"], event["rank"]
        near = [rec for rec in records if isinstance(rec.get("step"), int) and abs(rec["step"] - step) <= steps]
        lines.append(f"over: {event}")
        lines += [f"  event {rec['step']}: {rec}" for rec in near if rec["type"] == "event" and rec is not event]
        lines += [f"  step {rec['step']}: rank {rank} " + str({k: row.get(k) for k in ("peak_bytes", "used_bytes",
                                                                                          "capacity_bytes")})
                  for rec in near if rec["type"] == "step" for row in rec.get("ranks", []) if row["rank"] == rank]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rebalances_from_the_console_never_go_over_the_capacity(cli):
    """The console's `r` (the same `rebalance` command `trainyard ctl` sends) at steps of the operator's
    choosing, with rebalancing otherwise off: the tour's 8 MiB capacity holds at every step, through every
    migration the commands start (the skewed start first, then stage 0's block0.mlp slowed from step 12: its
    layers go to the last stage, which can hold them; see the test above)."""
    from engine.telemetry import protocol
    from tests.conftest import wait_for
    from tests.test_control import ctl, current_step
    log = cli.tmp_path / "steer.jsonl"
    proc = cli.start("run", TOUR, "--headless", "--steps", "100000", *cli.base_args("steer-tour"),
                     "--set", "run.eval_every=0", "--set", "parallel.pipeline.rebalance=manual",
                     "--set", "emulate.slow_from_step=12", "--set", "emulate.slow_layer_ms=40",
                     "--set", "emulate.slow_layer=block0.mlp",
                     "--set", "parallel.pipeline.imbalance_threshold=0.05", "--set", "telemetry.rank_every=1",
                     "--set", "checkpoint.every=0", "--telemetry-log", str(log))
    wait_for(lambda: any(r["name"] == "steer-tour" for r in protocol.list_runs()), 60, "the run on the socket")
    answers = []   # the cli fixture reaps the run if the test fails before it stops
    for at in (3, 8, 16, 23):   # the first two on the skewed start, the last two after the slowdown
        wait_for(lambda: current_step("steer-tour") >= at, 60, f"step {at}")
        r = ctl(cli, "steer-tour", "rebalance")
        assert r.returncode == 0 and "rebalance: applied at step" in r.stdout, r.stdout + r.stderr
        answers.append(r.stdout)
    assert ctl(cli, "steer-tour", "stop").returncode == 0
    proc.wait(timeout=60)
    records = read_jsonl(log)
    moved = [rec["step"] for rec in records if rec.get("kind") == "migration"]
    assert len(moved) >= 2, (moved, answers)
    assert all(rec["reason"] == "command" for rec in records if rec.get("kind") == "rebalance")
    over = [rec for rec in records if rec.get("kind") == "memory_over_capacity"]
    assert not over, around(records, over)   # rare (about 1 run in 30-60): what the run did about then
    for rec in records:
        if rec["type"] == "step":
            for rank in rec["ranks"]:
                assert rank["peak_bytes"] <= rank["capacity_bytes"], (rec["step"], rank["rank"], rank["peak_bytes"])
