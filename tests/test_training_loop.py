"""The training loop of a real run: the LR schedule, global gradient clipping (speculated and validated), skips of
non-finite steps and gradient accumulation, each equal to one process's plain torch loop, in every strategy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.config import OptimConfig, config_from_dict, load_config
from engine.training.data import batch_for, load_dataset
from engine.training.loss import cross_entropy
from engine.models import build_model
from engine.training.optim import lr_at, make_optimizer, set_lr
from engine.runtime.checkpoint import Reader, list_checkpoints, model_state, verify
from engine.techniques.updates.layer import LayerUpdate
from engine.techniques.step_guard import StepGuard
from tests.conftest import read_jsonl
from tests.test_training import DEMO

STEPS = 12
# the loop under test: warmup, a cosine to a floor, clipping at a threshold most steps cross, an inf at step 5
LOOP = ["optim.name=adamw", "optim.lr=0.01", "optim.lr_schedule=cosine", "optim.warmup_steps=3", "optim.min_lr=0.001",
        "optim.clip_grad_norm=0.4"]
INF = ["emulate.nonfinite_layer=fc1", "emulate.nonfinite_step=5", "optim.skip_nonfinite=true"]


# --- the schedule -----------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["constant", "cosine", "linear"]), lr=st.floats(1e-5, 1.0),
       floor=st.floats(0.0, 1.0), warmup=st.integers(0, 50), total=st.integers(1, 400), data=st.data())
def test_the_schedule_is_its_closed_form_at_every_step(kind, lr, floor, warmup, total, data):
    min_lr = lr * floor
    cfg = OptimConfig(lr=lr, lr_schedule=kind, warmup_steps=warmup, min_lr=min_lr)
    step = data.draw(st.integers(0, total - 1))
    if step < warmup:
        want = lr * (step + 1) / warmup
    elif kind == "constant":
        want = lr
    else:
        t = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
        want = min_lr + (lr - min_lr) * ((1 + math.cos(math.pi * t)) / 2 if kind == "cosine" else 1 - t)
    got = lr_at(cfg, step, total)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert 0 < got <= lr * (1 + 1e-12) or (got == pytest.approx(min_lr) and kind != "constant")
    if kind != "constant" and warmup < total - 1:   # the last step ends on the floor
        assert lr_at(cfg, total - 1, total) == pytest.approx(min_lr)


@pytest.mark.parametrize("overrides,message", [
    ({"data": {"batch_size": 64, "accumulate": 3}}, "data.batch_size = 64: must be divisible by data.accumulate = 3 "
                                                     "x parallel.world_size = 2 = 6"),
    ({"parallel": {"strategy": "pipeline"}, "data": {"accumulate": 2}},
     'data.accumulate = 2: not available with parallel.strategy = "pipeline"'),
    ({"optim": {"lr_schedule": "cosine", "lr": 0.01, "min_lr": 0.1}}, "optim.min_lr = 0.1: must be at most optim.lr"),
    ({"parallel": {"strategy": "param_server", "world_size": 3, "param_server": {"servers": 1, "workers": 2}},
      "optim": {"clip_grad_norm": 1.0}}, 'optim.clip_grad_norm = 1: not available with parallel.strategy = '
                                         '"param_server" yet'),
    ({"optim": {"lr_schedule": "step"}}, "optim.lr_schedule"),
    ({"optim": {"clip_mode": "later"}}, "optim.clip_mode"),
])
def test_a_bad_loop_setting_is_refused_by_name(overrides, message):
    base = {"parallel": {"world_size": 2}}
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        config_from_dict(base)


# --- one layer's speculative update, undone and redone exactly ----------------------------------------------

def _layer(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(8, generator=g).to(dtype))]


def _grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _state(update: LayerUpdate) -> list[torch.Tensor]:
    return [t.clone() for t in update.weights()] + [v.clone() for s in update.optimizer.state.values()
                                                     for k, v in sorted(s.items()) if torch.is_tensor(v)]


@pytest.mark.parametrize("side", ["device", "host"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_speculative_update_is_undone_and_redone_exactly(side, name, dtype):
    """Three steps of one layer: the third is speculated, then undone (a skip) and, in a twin, redone with a clip
    coefficient; each equals the twin that never speculated (the wait path: gradient scaled, then stepped)."""
    cfg = OptimConfig(name=name, lr=0.05, clip_grad_norm=1.0)
    a, b = LayerUpdate("fc", 0, _layer(0, dtype), cfg), LayerUpdate("fc", 0, _layer(0, dtype), cfg)
    for u in (a, b):
        u.move(side)
    a.guard = True
    step = (lambda u: u.step_device()) if side == "device" else (lambda u: u.step_host())
    for seed in range(2):   # both step alike (the first step makes the state a restore must drop)
        for u in (a, b):
            _grads(u.params, seed)
            step(u)
        a.settle()
    before = _state(a)
    _grads(a.params, 7)
    step(a)
    assert any(not torch.equal(x, y) for x, y in zip(_state(a), before))
    a.undo()   # a skip: as if it never ran
    assert all(torch.equal(x, y) for x, y in zip(_state(a), before))
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    assert all(p.grad is None or not p.grad.any() for p in a.params)
    _grads(a.params, 8)
    step(a)
    a.redo(0.25)   # a clip: undone, then stepped on the gradient times 0.25
    _grads(b.params, 8)
    b.scale_grads(0.25)
    step(b)
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))
    assert a.rollback_bytes() == sum(t.numel() * t.element_size() for t in _state(a))


def test_the_guard_decides_like_torch_clip_grad_norm():
    params = _layer(3)
    _grads(params, 4)
    parts = [torch.stack(torch._foreach_norm([p.grad for p in params])).double().square().sum()]
    decision = StepGuard(OptimConfig(clip_grad_norm=0.5)).decide(parts)
    want = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert decision.grad_norm == pytest.approx(float(want), rel=1e-6)
    assert decision.clipped and decision.coef == pytest.approx(0.5 / (float(want) + 1e-6), rel=1e-6)
    assert StepGuard(OptimConfig(clip_grad_norm=1e3)).decide(parts).clipped is False
    nan = StepGuard(OptimConfig(skip_nonfinite=True)).decide([torch.tensor(float("inf"), dtype=torch.float64)])
    assert nan.skipped and nan.fields()["grad_norm"] is None
    off = StepGuard(OptimConfig())   # the default: no guard, no norm
    assert not off.on and off.decide(parts).grad_norm is None


# --- every strategy equals one process's plain torch loop -------------------------------------------------

def reference(overrides: list[str], steps: int, skip_at: int = -1,
              micro: int = 1) -> tuple[dict, list[float], list[float]]:
    """One process, the whole global batch, torch's own clip_grad_norm_; a step whose norm is not finite (or
    `skip_at`, where the run's emulated inf is) is skipped. The state, each step's norm and learning rate.
    `micro`: the gradient accumulated over that many equal micro-batches, each loss weighted by its share, in
    order, as a pipeline sums it (another order of fp32 sums moves AdamW's weights here by up to 2e-5 in 12
    steps: the full batch against 4 micro-batches, on an AVX-512 CPU)."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    opt = make_optimizer(cfg.optim, model.parameters())
    norms, lrs = [], []
    for step in range(steps):
        lrs.append(lr_at(cfg.optim, step, steps))
        set_lr(opt, lrs[-1])
        x, y = batch_for(ds, step, cfg.data.batch_size, cfg.run.seed)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            loss = cross_entropy(model(xs), ys)
            (loss * (len(xs) / len(x)) if micro > 1 else loss).backward()
        clip = cfg.optim.clip_grad_norm
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)))
        if step == skip_at:
            norms[-1] = math.inf
            continue
        opt.step()
    return model.state_dict(), norms, lrs


def run_and_compare(cli, name: str, run: list[str], model: list[str] = (), loop: list[str] = LOOP,
                    inf: list[str] = INF, atol: float = 1e-5, norms: bool = True) -> list[dict]:
    log = cli.tmp_path / f"{name}.jsonl"
    sets = [a for o in [*model, *loop, *inf, *run] for a in ("--set", o)]
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args(name), *sets,
                "--telemetry-log", str(log), timeout=150)
    assert r.returncode == 0, r.stderr
    steps = [rec for rec in read_jsonl(log) if rec["type"] == "step"]
    cfg = load_config(DEMO, [*model, *loop, *inf, *run])   # a pipeline's micro-batches: the reference's too
    micro = cfg.parallel.pipeline.micro_batches if cfg.parallel.strategy == "pipeline" else 1
    want, ref_norms, lrs = reference([*model, *loop], STEPS, skip_at=5 if inf else -1, micro=micro)
    got = model_state(list_checkpoints(cli.tmp_path / "runs" / name)[-1])
    for key in want:   # fp32 sums in another order (the all-reduce, the owners, the stages): 1e-5 absolute
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)
    assert [s["lr"] for s in steps] == lrs   # exactly: a pure function of the step
    clip = next((float(o.split("=")[1]) for o in loop if o.startswith("optim.clip_grad_norm")), 0.0)
    for s, norm in zip(steps, ref_norms if norms else []):
        if math.isfinite(norm):
            assert s["grad_norm"] == pytest.approx(norm, rel=1e-5), s["step"]
            assert s["clipped"] == (clip > 0 and norm > clip + 1e-6) and not s["skipped"]
        else:
            assert s["grad_norm"] is None and s["skipped"] and not s["clipped"]
    return steps


@pytest.mark.timeout(200)
@pytest.mark.parametrize("placement,mode,world", [("device", "speculate", 2), ("host", "speculate", 2),
                                                  pytest.param("host", "wait", 2, marks=pytest.mark.slow),
                                                  # a world of one: no DDP wrapper, each gradient final as
                                                  # autograd accumulates it (strategies/ddp/strategy.py `solo`)
                                                  ("host", "speculate", 1)])
def test_ddp_equals_one_process_through_clips_a_skip_and_accumulation(cli, placement, mode, world):
    steps = run_and_compare(cli, f"ddp-{placement}-{mode}-{world}",
                            [f"parallel.world_size={world}", f"update.placement={placement}", "data.accumulate=2",
                             f"optim.clip_mode={mode}", f"emulate.nonfinite_rank={world - 1}"])
    redone = [s["redone_layers"] for s in steps]
    clipped = [s for s in steps if s["clipped"]]
    assert clipped, "the threshold never clipped: the test proves nothing"
    if mode == "speculate" and placement == "host":
        # while steps stand, every host update runs before the norm is known: all three layers redone or undone
        # where a step clips or skips; after that, steps wait for the norm (none redone) until SPECULATE_AFTER
        # steps in a row have stood
        from engine.techniques.updates.updater import SPECULATE_AFTER
        want, stood = [], SPECULATE_AFTER
        for s in steps:
            bad = s["clipped"] or s["skipped"]
            want.append(3 if bad and stood >= SPECULATE_AFTER else 0)
            stood = 0 if bad else stood + 1
        assert redone == want and 3 in redone and any(s["clipped"] and r == 0 for s, r in zip(steps, redone))
    else:   # waiting, or device updates in ddp: they run inline during backward either way, so they wait
        assert not any(redone)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("gated", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_sharded_equals_one_process_and_never_rolls_back(cli, gated):
    steps = run_and_compare(cli, f"sharded-{gated}", ["parallel.world_size=2", "parallel.strategy=sharded",
                                                      f"parallel.sharded.overlap_forward={str(gated).lower()}",
                                                      "update.placement=host", "data.accumulate=2",
                                                      "emulate.nonfinite_rank=0"])
    assert not any(s["redone_layers"] for s in steps)   # owners update after the reduce: decided first


@pytest.mark.timeout(200)
def test_a_pipeline_equals_one_process_through_a_live_migration(cli):
    from tests.test_rebalance import MODEL_SETTINGS, SKEWED
    steps = run_and_compare(cli, "pipeline", [*SKEWED[1::2], "parallel.pipeline.rebalance_check_every=3",
                                              "emulate.nonfinite_layer=fc2"], model=MODEL_SETTINGS,
                            inf=["emulate.nonfinite_step=5", "optim.skip_nonfinite=true"])
    stages = {tuple(tuple(s["layers"]) for s in rec["stages"]) for rec in steps}
    assert len(stages) > 1, "no layer migrated"
    assert any(s["redone_layers"] for s in steps)   # the stages' device updates speculated, and were redone


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_parameter_server_in_bsp_equals_one_process_with_a_schedule_and_accumulation(cli):
    # no clipping on a parameter server (refused by name); a non-finite window is skipped per layer, not tested here
    run_and_compare(cli, "ps", ["parallel.strategy=param_server", "parallel.world_size=3", "parallel.param_server.servers=1",
                                "parallel.param_server.workers=2", "parallel.param_server.sync=bsp", "data.accumulate=2"],
                    loop=[o for o in LOOP if "clip" not in o], inf=[], norms=False)   # a server has no global norm


@pytest.mark.timeout(200)
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_they_were(cli):
    name = "skip"
    r = cli.run("run", DEMO, "--headless", "--steps", "8", *cli.base_args(name), "--set", "checkpoint.every=1",
                "--set", "checkpoint.keep=10",
                "--set", "parallel.world_size=2", "--set", "update.placement=host", "--set", "optim.name=adamw",
                *[a for o in INF for a in ("--set", o)], "--set", "emulate.nonfinite_rank=0")
    assert r.returncode == 0, r.stderr
    ckpts = {int(c.name.split("_")[-1]): c for c in list_checkpoints(cli.tmp_path / "runs" / name)}
    before, after = ckpts[5], ckpts[6]   # step index 5 is the sixth step: between checkpoints 5 and 6
    for key, value in model_state(before).items():
        assert torch.equal(model_state(after)[key], value), key
    with Reader(before, verify(before)) as was, Reader(after, verify(after)) as now:
        assert was.index["optimizer"]
        for name in was.index["optimizer"]:
            for k, v in was.optimizer_entry(name).items():
                assert torch.equal(now.optimizer_entry(name)[k], v), (name, k)


@pytest.mark.timeout(200)
def test_a_resumed_run_repeats_the_learning_rates_and_norms(cli):
    common = [a for o in [*LOOP, "checkpoint.every=6", "parallel.world_size=2", "data.accumulate=2"]
              for a in ("--set", o)]
    straight, split = cli.tmp_path / "straight.jsonl", cli.tmp_path / "split.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args("straight"), *common,
                "--telemetry-log", str(straight))
    assert r.returncode == 0, r.stderr
    at_6 = next(c for c in list_checkpoints(cli.tmp_path / "runs" / "straight") if c.name.endswith("6"))
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args("split"), *common,
                "--telemetry-log", str(split), "--resume", str(at_6))
    assert r.returncode == 0, r.stderr

    def figures(path):
        return {rec["step"]: (rec["loss"], rec["lr"], rec["grad_norm"], rec["clipped"])
                for rec in read_jsonl(path) if rec["type"] == "step"}
    want, got = figures(straight), figures(split)
    assert sorted(got) == list(range(7, STEPS + 1))
    assert [got[s] for s in got] == [want[s] for s in got]


@pytest.mark.parametrize("placement,mode", [("device", "speculate"), ("device", "wait"), ("host", "speculate")])
def test_the_rollback_copy_is_counted_where_it_lives(placement, mode):
    """A speculative device update's copy (weights and AdamW's two moments and step) is in the ledger's optimizer
    state; a host one's in the host's bytes; waiting keeps none."""
    from engine.config import Config, UpdateConfig
    from engine.runtime.devices import LedgerDevice, tensor_bytes
    from engine.models.layers import params_by_layer
    from engine.techniques.updates.updater import LayerUpdates
    cfg = Config()
    cfg.optim.name, cfg.optim.clip_grad_norm, cfg.optim.clip_mode = "adamw", 1e3, mode
    model = build_model(cfg.model, {"input_dim": 8, "num_classes": 3}, 0)
    device = LedgerDevice(1 << 30)
    updater = LayerUpdates(model, params_by_layer(model), cfg.optim, device, UpdateConfig(placement=placement))
    device.ledger.track_module(model, updater)
    for _ in range(2):   # the first step's copy has no optimizer state yet (the step makes it)
        updater.begin_step()
        cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        updater.end_backward()
        assert not updater.validate().clipped
        updater.wait_host()
    device.ledger.refresh()
    weights = sum(tensor_bytes(p) for p in model.parameters())
    state = sum(u.state_bytes() for u in updater.updates.values())   # exp_avg, exp_avg_sq: 2x weights, + steps
    copy = weights + state if mode == "speculate" else 0
    assert sum(u.rollback_bytes() for u in updater.updates.values()) == copy
    on_device = device.ledger.bytes["optimizer_state"]
    assert on_device == (state + copy if placement == "device" else 0)
    if placement == "host":
        assert updater.host_bytes() >= state + copy + weights   # + the master weights and gradient buffers
    updater.close()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_in_bf16_the_norms_and_clip_decisions_agree_within_bf16s_rounding(cli, strategy):
    """bf16 weights: a strategy's split of the batch rounds other partial sums than one process does (the
    tolerance of tests/test_precision.py, measured here as bf16 against fp32 under the same clipping). The norm
    agrees within that relative noise (measured: under 1e-2), and a clip decision may differ only where the norm
    lies within it of the threshold."""
    from tests.test_precision import BF16, TOLERANCE, one_process_run
    log = cli.tmp_path / "bf16.jsonl"
    sets = [*LOOP, f"parallel.strategy={strategy}", "parallel.world_size=2", "precision.compute=bf16",
            "precision.params=bf16"]
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args("bf16"),
                *(a for o in sets for a in ("--set", o)), "--telemetry-log", str(log), timeout=150)
    assert r.returncode == 0, r.stderr
    steps = [rec for rec in read_jsonl(log) if rec["type"] == "step"]
    want_loss, want_norm = one_process_run([*LOOP, *BF16], STEPS)
    fp32_loss, fp32_norm = one_process_run(LOOP, STEPS)
    noise = max(abs(a - b) for a, b in zip(want_loss, fp32_loss))
    norm_noise = max(abs(a - b) / b for a, b in zip(want_norm, fp32_norm))
    assert max(abs(s["loss"] - w) for s, w in zip(steps, want_loss)) <= TOLERANCE(noise)
    clip = 0.4
    for s, norm in zip(steps, want_norm):
        assert s["grad_norm"] == pytest.approx(norm, rel=2 * norm_noise + 1e-3), s["step"]
        if abs(norm - clip) > (2 * norm_noise + 1e-3) * clip:
            assert s["clipped"] == (norm > clip), s["step"]
    assert any(s["clipped"] for s in steps) and not all(s["clipped"] for s in steps)
