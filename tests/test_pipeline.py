"""Pipeline parallel (engine/strategies/pipeline/stage.py): a pipelined step equals a single-process step on the
whole global batch, for both schedules, several micro-batch counts and both optimizers."""

from __future__ import annotations

import pytest
import torch

from engine.config import Config, ModelConfig, OptimConfig, PipelineConfig
from engine.training.data import batch_for, load_dataset
from engine.runtime.devices import LedgerDevice
from engine.models import Block, LayerList, build_model
from engine.strategies.pipeline import PipelineStage, check_stages, schedule_ops, split_micro
from engine.processes.procpool import DistPool
from tests.conftest import assert_named_state_close, train_one_process

STEPS = 10
BATCH = 32
MODEL = ModelConfig(name="mlp", hidden=32, depth=3)
META = {"input_dim": 64, "num_classes": 10}
NAMES = ["fc0", "act0", "fc1", "act1", "fc2", "act2", "head"]
SPLITS = {2: [NAMES[:4], NAMES[4:]], 3: [NAMES[:2], NAMES[2:5], NAMES[5:]]}
_DATA: dict = {}


def _optim(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=0.05 if name == "sgd" else 0.01)


def _pipe(micro_batches: int, schedule: str, rebalance: str = "off") -> PipelineConfig:
    """[parallel.pipeline] as these tests run it: the layout stays where it starts unless a test moves it."""
    return PipelineConfig(micro_batches=micro_batches, schedule=schedule, rebalance=rebalance)


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `steps` global batches of the default data (digits), computed once per count."""
    if steps not in _DATA:
        cfg = Config()
        ds = load_dataset(cfg.data, cfg.run.seed)
        _DATA[steps] = [batch_for(ds, step, BATCH, cfg.run.seed) for step in range(steps)]
    return _DATA[steps]


# --- jobs (run on every rank) ----------------------------------------------------------------

def pipe_job(topo, variants: list[tuple[str, str, int]]) -> list[dict]:
    """For each (optim, schedule, micro_batches): STEPS pipelined steps; this stage's weights and losses."""
    out = []
    for optim, schedule, micro in variants:
        model = build_model(MODEL, META, seed=0)
        device = LedgerDevice(1 << 30)
        stage = PipelineStage(model, SPLITS[topo.world_size], topo, device, _optim(optim), _pipe(micro, schedule))
        device.ledger.track_module(model, stage.optimizer)
        losses = [stage.train_step(x, y) for x, y in _batches()]
        stage.sync()
        out.append({"state": {k: v.detach().clone() for k, v in stage.stage_state().items()},
                    "optimizer": stage.optimizer_state(), "losses": losses, "layout": stage.layout(),
                    "n_params": sum(p.numel() for p in stage.stage_params())})
        stage.close()
    return out


SIZES = (32, 16, 24, 32, 8, 24)   # a global batch of another size each step: 4 micro-batches of 8, 4, 6, 8, 2, 6


def _sized_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:n], y[:n]) for (x, y), n in zip(_batches(), SIZES)]


def sizes_job(topo) -> dict:
    """Steps whose micro-batches change shape every step: each step's first message in each direction says the
    new shape, and the receives posted ahead of their op (wire.py) take it."""
    model = build_model(MODEL, META, seed=0)
    stage = PipelineStage(model, SPLITS[topo.world_size], topo, LedgerDevice(1 << 30), _optim("adamw"),
                          _pipe(4, "1f1b"))
    losses = [stage.train_step(x, y) for x, y in _sized_batches()]
    state = {k: v.detach().clone() for k, v in stage.stage_state().items()}
    stage.close()
    return {"state": state, "losses": losses}


def bad_batch_job(topo) -> str:
    """A batch that does not split into micro-batches fails on every rank before any message."""
    model = build_model(MODEL, META, seed=0)
    stage = PipelineStage(model, SPLITS[topo.world_size], topo, LedgerDevice(1 << 30), _optim("sgd"), _pipe(4, "1f1b"))
    x, y = _batches()[0]
    try:
        stage.train_step(x[:30], y[:30])
    except ValueError as e:
        return str(e)
    finally:
        stage.close()
    return "no error"


def ledger_job(topo, schedule: str) -> dict:
    """STEPS steps twice from the same start: the ledger counting micro-batches at once once it knows them,
    and counting every saved tensor (a profiled step's way) on every step; each step's peak, both ways."""
    peaks = {}
    for how in ("units", "tensors"):
        model = build_model(MODEL, META, seed=0)
        device = LedgerDevice(1 << 30)
        stage = PipelineStage(model, SPLITS[topo.world_size], topo, device, _optim("adamw"), _pipe(4, schedule))
        device.ledger.track_module(model, stage.optimizer)
        peaks[how], booked = [], []
        add = device.ledger.add   # a micro-batch booked at once: activations added outside the hooks
        device.ledger.add = lambda category, nbytes: (booked.append(nbytes) if category == "activations" else None,
                                                      add(category, nbytes))
        for x, y in _batches():
            device.ledger.exact_due = how == "tensors"
            device.ledger.reset_peak()
            stage.train_step(x, y)
            peaks[how].append((device.ledger.peak_bytes, device.ledger.bytes["activations"]))
        peaks[how + "_booked"] = len(booked)
        # the updates freed the gradients; the ledger counts them as held all step (MemoryLedger.count_as_held)
        peaks[how + "_grads"] = (device.ledger.bytes["gradients"], sum(p.nbytes for p in stage.stage_params()),
                                 [p.grad for p in stage.stage_params() if p.grad is not None])
        stage.close()
    return peaks


# --- the reference: one process, no pipeline -------------------------------------------------

def reference(optim: str, optimizer_state: dict | None = None) -> tuple[dict, list[float]]:
    return train_one_process(build_model(MODEL, META, seed=0), _optim(optim), _batches(), optimizer_state)


def check(results: list[list[dict]], variants: list) -> None:
    ref_optimizer = {o: {} for o in {v[0] for v in variants}}
    refs = {o: reference(o, ref_optimizer[o]) for o in ref_optimizer}
    for k, (optim, schedule, micro) in enumerate(variants):
        ref_state, ref_losses = refs[optim]
        merged, optimizer = {}, {}
        for rank, per_rank in enumerate(results):
            r = per_rank[k]
            assert not set(merged) & set(r["state"]), "stages overlap"
            assert not set(optimizer) & set(r["optimizer"]), "two stages keep one parameter's optimizer state"
            merged.update(r["state"])
            optimizer.update(r["optimizer"])
            assert r["layout"] == {"strategy": "pipeline", "stages": SPLITS[len(results)], "schedule": schedule,
                                   "micro_batches": micro}
            assert r["n_params"] == sum(t.numel() for t in r["state"].values())
            if rank < len(results) - 1:
                assert r["losses"] == [None] * STEPS
        assert set(merged) == set(ref_state), (optim, schedule, micro)
        for name in ref_state:
            tag = f"{optim}/{schedule}/{micro} {name}"
            torch.testing.assert_close(merged[name], ref_state[name], atol=1e-5, rtol=0,
                                       msg=lambda m, tag=tag: f"{tag}: {m}")
        torch.testing.assert_close(results[-1][k]["losses"], ref_losses, atol=1e-5, rtol=0)
        # the stages' optimizer states under the model's own names: one process's
        assert_named_state_close(optimizer, ref_optimizer[optim], 1e-5, f"{optim}/{schedule}/{micro}")
        # the weights moved: the comparison is not trivially equal initial weights
        assert any((ref_state[n] - build_model(MODEL, META, seed=0).state_dict()[n]).abs().max() > 1e-3
                   for n in ref_state)


VARIANTS_2 = [(o, s, m) for o in ("sgd", "adamw") for s in ("gpipe", "1f1b") for m in (1, 4)]
VARIANTS_3 = VARIANTS_2


@pytest.fixture(scope="module")
def pool2():
    with DistPool(2, timeout_s=30) as p:
        yield p


@pytest.fixture(scope="module")
def pool3():
    with DistPool(3, timeout_s=30) as p:
        yield p


@pytest.mark.timeout(120)
def test_two_stages_match_single_process(pool2):
    results = pool2.run(pipe_job, timeout=90, variants=VARIANTS_2)
    check(results, VARIANTS_2)


@pytest.mark.slow   # k = 2 here and k = 4 in tests/test_rebalance.py are in the quick set
@pytest.mark.timeout(120)
def test_three_stages_match_single_process(pool3):
    results = pool3.run(pipe_job, timeout=90, variants=VARIANTS_3)
    check(results, VARIANTS_3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_counting_a_micro_batch_at_once_gives_the_peak_counting_every_tensor_gives(pool2, schedule):
    """MemoryLedger.unit_bytes: after the first step each micro-batch is booked at once, not through
    autograd's saved-tensor hooks; every step's peak (and the bytes left after it: none) are the same."""
    for rank, r in enumerate(pool2.run(ledger_job, schedule=schedule)):
        assert r["units"] == r["tensors"], rank
        assert all(left == 0 for _, left in r["units"]) and r["units"][0][0] > 0
        # booked at once: on and off for each of 4 micro-batches in every step after the first; never while
        # a step reads per-layer bytes
        assert r["units_booked"] == 2 * 4 * (STEPS - 1) and r["tensors_booked"] == 0, rank
        counted, held, alive = r["units_grads"]
        assert counted == held > 0 and alive == [], rank


@pytest.mark.timeout(120)
def test_micro_batches_of_another_shape_every_step_match_single_process(pool2):
    results = pool2.run(sizes_job, timeout=60)
    ref_state, ref_losses = train_one_process(build_model(MODEL, META, seed=0), _optim("adamw"), _sized_batches())
    merged = {**results[0]["state"], **results[1]["state"]}
    assert set(merged) == set(ref_state)
    for name in ref_state:
        torch.testing.assert_close(merged[name], ref_state[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert results[0]["losses"] == [None] * len(SIZES)
    torch.testing.assert_close(results[1]["losses"], ref_losses, atol=1e-5, rtol=0)


def test_indivisible_batch_is_refused_on_every_rank(pool2):
    errors = pool2.run(bad_batch_job, timeout=30)
    assert all("30" in e and "4 equal micro-batches" in e for e in errors), errors
    # the pool still works afterwards: nothing was left in flight
    results = pool2.run(pipe_job, timeout=60, variants=[("sgd", "1f1b", 2)])
    check(results, [("sgd", "1f1b", 2)])


# --- validation, no pool ---------------------------------------------------------------------

def test_check_stages_accepts_a_cover_and_returns_ranges():
    assert check_stages(NAMES, SPLITS[2], 2) == [(0, 4), (4, 7)]
    assert check_stages(NAMES, SPLITS[3]) == [(0, 2), (2, 5), (5, 7)]
    assert check_stages(NAMES, [NAMES]) == [(0, 7)]


@pytest.mark.parametrize("stages, world, match", [
    (SPLITS[2], 3, "2 stages but world size 3"),
    ([], None, "non-empty list"),
    ([NAMES[:4], [], NAMES[4:]], None, "stage 1 is empty"),
    ([NAMES[:4], NAMES[5:]], None, "'act1'|'fc2' is missing"),
    ([NAMES[:4], NAMES[3:]], None, "'act1' repeats"),
    ([NAMES[:3], ["act1", "act2", "fc2", "head"]], None, "not contiguous"),
    ([NAMES[:4], NAMES[4:6]], None, r"\['head'\] are in no stage"),
    ([NAMES[:4], ["fc2", "act2", "nope"]], None, "unknown layer 'nope'"),
    ([NAMES[4:], NAMES[:4]], None, "covered in order"),
])
def test_check_stages_errors(stages, world, match):
    with pytest.raises(ValueError, match=match):
        check_stages(NAMES, stages, world)


def test_check_stages_refuses_to_split_a_block():
    model = LayerList([("a", torch.nn.Linear(2, 2)),
                       Block("b", [("x", torch.nn.ReLU()), ("y", torch.nn.Identity())]),
                       ("c", torch.nn.Linear(2, 2))])
    check_stages(model.names, [["a", "b.x", "b.y"], ["c"]], clusters=model.clusters)
    with pytest.raises(ValueError, match="inside the block 'b'"):
        check_stages(model.names, [["a", "b.x"], ["b.y", "c"]], clusters=model.clusters)


def test_split_micro():
    assert split_micro(32, 4) == 8
    with pytest.raises(ValueError, match="30 does not split into 4"):
        split_micro(30, 4)
    with pytest.raises(ValueError, match="positive integer"):
        split_micro(32, 0)


def test_schedules():
    assert schedule_ops("gpipe", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    # 1F1B, 3 stages, 4 micro-batches: rank 0 warms up with 2 forwards, the last stage with none
    assert schedule_ops("1f1b", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                             ("B", 2), ("B", 3)]
    assert schedule_ops("1f1b", 3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # fewer micro-batches than the warm-up: all forwards, then all backwards
    assert schedule_ops("1f1b", 3, 0, 1) == [("F", 0), ("B", 0)]
    for rank in range(3):
        ops = schedule_ops("1f1b", 3, rank, 5)
        assert sorted(ops) == sorted([("F", i) for i in range(5)] + [("B", i) for i in range(5)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(5))
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedule_ops("zigzag", 2, 0, 1)


# --- the pipeline strategy through the CLI -------------------------------------------------------

@pytest.mark.timeout(120)
# the CLI path (parity, schema, stages, evaluation across stages) is in the quick set in tests/test_rebalance.py
@pytest.mark.slow
@pytest.mark.parametrize("world,schedule,optim", [(2, "1f1b", "adamw"), (3, "gpipe", "sgd")])
def test_a_pipeline_run_equals_one_process_and_reports_its_stages(cli, world, schedule, optim):
    from engine.runtime.checkpoint import list_checkpoints, model_state
    from tests.conftest import read_jsonl
    from tests.test_training import DEMO, single_process_reference
    overrides = [f"optim.name={optim}", "optim.lr=0.01", "parallel.strategy=pipeline", f"parallel.pipeline.schedule={schedule}"]
    log = cli.tmp_path / "run.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("pipe"), *[f"--set={o}" for o in overrides],
                "--set", f"parallel.world_size={world}", "--set", "telemetry.layer_every=5", "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    got = model_state(list_checkpoints(cli.tmp_path / "runs" / "pipe")[-1])
    want = single_process_reference(overrides, 20)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    records = read_jsonl(log)
    import jsonschema

    from engine.telemetry.schema import RECORD_SCHEMA
    for rec in records:
        jsonschema.validate(rec, RECORD_SCHEMA)
    steps = [rec for rec in records if rec["type"] == "step"]
    stages = steps[-1]["stages"]
    assert [s["stage"] for s in stages] == list(range(world)) and "imbalance_ms" in steps[-1]
    assert [n for s in stages for n in s["layers"]] == ["fc0", "act0", "fc1", "act1", "head"]
    table = next(rec["layers"] for rec in reversed(steps) if "layers" in rec)
    # every stage measures its own layers; rank 0 gathers them: one row per layer, with its stage
    stage_of = {n: s["stage"] for s in stages for n in s["layers"]}
    assert sorted(e["name"] for e in table) == sorted(stage_of)
    assert all(e["stage"] == stage_of[e["name"]] for e in table)
    # evaluated through the stages: the reference model's accuracy exactly, its validation loss to 1e-5
    from tests.test_training import reference_accuracy, reference_val_loss
    assert records[-1]["type"] == "summary"
    assert records[-1]["test_accuracy"] == pytest.approx(reference_accuracy(overrides, want), abs=1e-6)
    assert records[-1]["val_loss"] == pytest.approx(reference_val_loss(overrides, want), abs=1e-5)


@pytest.mark.timeout(60)
def test_a_partition_that_is_not_contiguous_is_refused(cli):
    from tests.test_training import DEMO
    r = cli.run("run", DEMO, "--headless", "--steps", "5", *cli.base_args("badpipe"), "--set", "parallel.strategy=pipeline",
                "--set", 'parallel.pipeline.partition=[["fc0", "fc1"], ["act0", "act1", "head"]]')
    # a worker's refusal: exit 2 at once, never restarted (engine/runtime/refusal.py)
    assert r.returncode == 2 and "not contiguous" in r.stderr and "restarting" not in r.stderr
