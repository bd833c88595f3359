"""Hybrid optimizer update (engine/techniques/updates/updater.py): the same parameters whichever side runs each
layer's update, the trial and the plan, live placement changes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.config import Config, ShardedConfig, UpdateConfig
from engine.training.data import batch_for, load_dataset
from engine.strategies.ddp import DDPStrategy
from engine.runtime.devices import LedgerDevice
from engine.models import build_model
from engine.processes.procpool import DistPool
from engine.strategies.sharded import ShardedStrategy

STEPS = 20
_DATA: dict = {}


def train(topo, strategy: str = "ddp", optim: str = "sgd", placement="device", planner: str = "global",
          steps: int = STEPS, switch: tuple | None = None, capacity: int = 1 << 30) -> dict:
    """`steps` steps of a 4-layer MLP on the digits; `switch` = (step, layer, side): a live set-placement."""
    cfg = Config()
    cfg.model.hidden, cfg.model.depth = 32, 3
    cfg.data.batch_size = 32
    cfg.optim.name, cfg.optim.lr = optim, (0.05 if optim == "sgd" else 0.01)
    if "digits" not in _DATA:
        _DATA["digits"] = load_dataset(cfg.data, cfg.run.seed)
    ds = _DATA["digits"]
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    device = LedgerDevice(capacity)
    update = UpdateConfig(placement=placement, planner=planner, profile_steps=4)
    if strategy == "ddp":
        runner = DDPStrategy(model, cfg.optim, topo, device, update_cfg=update)
    else:
        runner = ShardedStrategy(model, cfg.optim, topo, device, ShardedConfig(streams=2, slices=4), update_cfg=update)
    device.ledger.track_module(model, runner.optimizer)
    seen, peaks = [], []
    for step in range(steps):
        if switch and step == switch[0]:
            runner.sync()
            runner.updater.set_placement(switch[1], switch[2])
        runner.train_step(*batch_for(ds, step, cfg.data.batch_size, cfg.run.seed, topo.rank, topo.world_size))
        seen.append(dict(runner.updater.placement()))
        peaks.append(device.ledger.peak_bytes)
        if step == 1:
            device.ledger.refresh()
            state_bytes = device.ledger.bytes["optimizer_state"]
    runner.sync()
    out = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "placements": seen,
           "device_state_bytes": state_bytes, "plan": runner.updater.trial.plan, "peaks": peaks,
           "profile": runner.updater.trial.profile, "trial_sides": [t["side"] for t in runner.updater.trial.steps]}
    runner.close()
    return out


def compare(topo, **variant) -> dict:
    """`variant` against all-device, on this rank: the largest difference of any parameter."""
    base = {k: v for k, v in variant.items() if k in ("strategy", "optim")}
    want, got = train(topo, **base), train(topo, **variant)
    diff = max(float((got["state"][k] - want["state"][k]).abs().max()) for k in want["state"])
    return {"max_diff": diff, "placements": got["placements"], "plan": got["plan"],
            "device_state_bytes": (want["device_state_bytes"], got["device_state_bytes"])}


@pytest.fixture(scope="module")
def pool():
    with DistPool(2) as p:
        yield p


LAYERS = ["fc0", "fc1", "fc2", "head"]
RANDOM = dict(zip(LAYERS, random.Random(7).choices(["device", "host"], k=len(LAYERS))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "sharded"])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("placement", ["host", "auto", "random"])
def test_parameters_are_identical_whichever_side_updates(pool, strategy, optim, placement):
    chosen = RANDOM if placement == "random" else placement
    results = pool.run(compare, strategy=strategy, optim=optim, placement=chosen)
    for rank, result in enumerate(results):
        assert result["max_diff"] == 0.0, f"rank {rank}: {result['max_diff']}"
    mine = results[0]["placements"]
    if placement == "host":       # rank 0's layers (all of them in ddp, its own in sharded) on the host
        assert set(mine[-1].values()) == {"host"}
    if placement == "auto":       # the trial starts on the host, alternates, then the plan holds
        assert set(mine[0].values()) == {"host"} and set(mine[1].values()) == {"device"}
        # the plan from step 5 on (from step 4 where the trial's budget cut it under load), or, measured slower
        # than the trial's device steps, back to their placement (step 2's: every update on the device; seen in CI)
        assert mine[-1] in (mine[4], mine[3], mine[1]) and results[0]["plan"] is not None


def tight_trial(topo) -> dict:
    """An auto trial at a capacity where the host steps' peak leaves room for about half the state."""
    roomy = train(topo, optim="adamw", placement="auto", steps=5)["profile"]
    state = sum(c.state_bytes for c in roomy.layers)
    capacity = roomy.peak_bytes + state // 2
    tight = train(topo, optim="adamw", placement="auto", steps=5, capacity=capacity)
    return {"capacity": capacity, "state": state, "peaks": tight["peaks"], "placements": tight["placements"],
            "plan": tight["plan"], "device_ms": [c.device_ms for c in tight["profile"].layers]}


@pytest.mark.timeout(120)
def test_the_auto_trial_never_goes_over_the_capacity(pool):
    for result in pool.run(tight_trial):
        trial = result["peaks"][:4]
        assert max(trial) <= result["capacity"], (trial, result["capacity"])
        device_step = result["placements"][1]   # some updates fit on the device, not all
        assert set(device_step.values()) == {"device", "host"}
        assert result["plan"] is not None and all(ms > 0 for ms in result["device_ms"])   # measured or modelled


def cut_trial(topo) -> dict:
    """The roomy trial in full, and cut by its budget after its first host step (a negative budget: every host
    step after the first is over it)."""
    import engine.techniques.updates.trial as trial
    full = train(topo, optim="adamw", placement="auto", steps=5)["profile"]
    budget, trial.TRIAL_BUDGET_STEPS = trial.TRIAL_BUDGET_STEPS, -1
    try:
        cut = train(topo, optim="adamw", placement="auto", steps=5)
    finally:
        trial.TRIAL_BUDGET_STEPS = budget
    return {"full": full.peak_bytes, "cut": cut["profile"].peak_bytes, "trial_sides": cut["trial_sides"]}


@pytest.mark.timeout(120)
def test_a_trial_cut_by_its_budget_models_the_host_steps_peak_with_their_gradients(pool):
    """Its one host step's measured peak came before its gradients existed: the plan modelled 36,176 bytes
    where the steps held 47,188, and the tight trial above found no room on the device (seen on clean clones)."""
    for result in pool.run(cut_trial):
        # the trial ended after its first host step and its device step (the plan after it may put every
        # update on the host: under load on a clean clone the cost model chose that once)
        assert result["trial_sides"] == ["host", "device"], result
        assert result["cut"] >= result["full"], result


@pytest.mark.timeout(120)
def test_host_placed_state_leaves_the_device_ledger(pool):
    [r0, _] = pool.run(compare, placement="host")
    on_device, on_host = r0["device_state_bytes"]
    assert on_device > 0 and on_host == 0


@pytest.mark.timeout(120)
def test_a_live_placement_change_keeps_parameters_identical(pool):
    # the same run, with fc1 moved to the host at step 7 and back at no point: still equal to all-device
    results = pool.run(compare, placement="device", switch=(7, "fc1", "host"))
    assert all(r["max_diff"] == 0.0 for r in results)
    placements = results[0]["placements"]
    assert placements[6]["fc1"] == "device" and placements[7]["fc1"] == "host" and placements[-1]["fc1"] == "host"


def test_placement_table_naming_an_unknown_layer_is_refused():
    cfg = Config()
    model = build_model(cfg.model, {"input_dim": 4, "num_classes": 2}, 0)
    from engine.models.layers import params_by_layer
    from engine.techniques.updates.updater import LayerUpdates
    with pytest.raises(ValueError, match=r"update.placement names unknown layer 'fc9'; layers are fc0, "):
        LayerUpdates(model, params_by_layer(model), cfg.optim, LedgerDevice(1 << 20),
                     UpdateConfig(placement={"fc9": "host"}))


def test_layer_update_moves_state_and_weights_exactly():
    from engine.techniques.updates.layer import LayerUpdate
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(layer.state_dict())
    cfg = Config().optim
    a, b = LayerUpdate("a", 0, list(layer.parameters()), cfg), LayerUpdate("b", 0, list(twin.parameters()), cfg)
    b.move("host")
    for step in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for mod, upd in ((layer, a), (twin, b)):
            mod(x).square().sum().backward()
            upd.step_device() if upd.side == "device" else upd.step_host()
        if step == 2:
            b.move("device")
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p, q)


# --- through the CLI: the trial, the plan, the profile saved with the run ------------------------

@pytest.mark.timeout(120)
def test_a_sharded_runs_layer_table_shows_every_layers_update_from_its_owner(cli):
    from tests.conftest import read_jsonl
    from tests.test_figures import validate_log
    from tests.test_training import DEMO
    log = cli.tmp_path / "run.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "6", *cli.base_args("owners"), "--set", "parallel.strategy=sharded",
                "--set", "parallel.world_size=2", "--set", "update.placement={fc1 = \"host\", head = \"host\"}",
                "--set", "telemetry.layer_every=3", "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    validate_log(log)   # the closed rank entry: host updates' figures and sharded's own, every one declared
    ranks = [e for rec in read_jsonl(log) if rec.get("type") == "step" for e in rec["ranks"]]
    assert all({"reduce_ms", "broadcast_wait_ms", "reduce_span_ms", "owned_bytes", "host_bytes"} <= set(e)
               for e in ranks)
    assert any(e["reduce_span_ms"] > 0 for e in ranks) and any(e["host_bytes"] > 0 for e in ranks)
    rows = [rec["layers"] for rec in read_jsonl(log) if rec.get("type") == "step" and "layers" in rec]
    assert rows
    for table in rows:
        by_name = {e["name"]: e for e in table}
        # each layer's update runs on its owner; rank 0 shows it for every layer, whichever rank owns it
        assert {n for n, e in by_name.items() if "placement" in e} == {"fc0", "fc1", "head"}
        assert {n: by_name[n]["placement"] for n in ("fc0", "fc1", "head")} == {"fc0": "device", "fc1": "host",
                                                                                "head": "host"}
        assert {by_name[n]["owner_rank"] for n in ("fc0", "fc1", "head")} == {0, 1}
        assert all(by_name[n]["update_ms"] > 0 for n in ("fc0", "fc1", "head"))


@pytest.mark.timeout(120)
def test_auto_placement_plans_after_the_trial_and_saves_the_profile(cli):
    from engine.runtime.checkpoint import list_checkpoints, model_state
    from tests.conftest import read_jsonl
    from tests.test_training import DEMO, single_process_reference
    log = cli.tmp_path / "run.jsonl"
    # a capacity above the run's peak (356 KiB) and below what the fit check asks (the estimate + 25%: 435 KiB),
    # so `auto` does not settle on all-device before step 1 (engine/run/fit.py) and the trial runs
    r = cli.run("run", DEMO, "--headless", "--steps", "12", *cli.base_args("auto"), "--set", "update.placement=auto",
                "--set", "telemetry.layer_every=3", "--set", "device.memory=400KiB", "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    [plan] = [rec for rec in records if rec.get("kind") == "update_plan"]
    # made once the 4th trial step is timed, at the start of the 5th (a host step far slower than the device steps
    # would have ended the trial sooner: trial.py's budget)
    assert plan["step"] in (3, 5) and set(plan["placement"]) == {"fc0", "fc1", "head"}
    assert plan["predicted_ms"] <= min(plan["all_device_ms"], plan["all_host_ms"]) + 1e-9
    saved = json.loads((cli.tmp_path / "runs" / "auto" / "update_profile.json").read_text())
    assert [c["name"] for c in saved["layers_backward_order"]] == ["head", "fc1", "fc0"]
    last = next(rec for rec in reversed(records) if rec.get("type") == "step" and "layers" in rec)
    # the placement in effect at that step: the plan's, or a revert's made by then (a revert after it is not seen)
    back = [rec for rec in records if rec.get("kind") == "plan_reverted" and rec["step"] <= last["step"]]
    assert {e["name"]: e["placement"] for e in last["layers"] if "placement" in e} == \
        (back[-1] if back else plan)["placement"]
    got = model_state(list_checkpoints(cli.tmp_path / "runs" / "auto")[-1])
    want = single_process_reference([], 12)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
