"""Multi-process training through the CLI: accuracy, parity with one process, resume parity."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runtime.checkpoint import list_checkpoints, model_state
from engine.config import load_config
from engine.training.data import batch_for, load_dataset
from engine.training.loss import cross_entropy
from engine.models import build_model
from engine.training.optim import make_optimizer
from tests.conftest import ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


def single_process_reference(overrides: list[str], steps: int, losses: list[float] | None = None) -> dict:
    """The same global batches, the same optimizer, one process: what every layout must equal. `losses`: each
    step's loss is appended to it."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    opt = make_optimizer(cfg.optim, model.parameters())
    for step in range(steps):
        x, y = batch_for(ds, step, cfg.data.batch_size, cfg.run.seed)
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(float(loss.detach()))
    return model.state_dict()


def reference_accuracy(overrides: list[str], state: dict) -> float:
    """The test accuracy of the demo config's model (with `overrides`) holding `state`."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    model.load_state_dict(state)
    with torch.no_grad():
        return float((model(ds.x_test).argmax(dim=-1) == ds.y_test).float().mean())


def reference_val_loss(overrides: list[str], state: dict) -> float:
    """The validation loss of the demo config's model (with `overrides`) holding `state`: one worker's mean cross
    entropy over the first data.eval_samples test samples (what every strategy's eval must equal)."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    model.load_state_dict(state)
    n = min(cfg.data.eval_samples, len(ds.x_test))
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(ds.x_test[:n]), ds.y_test[:n]))


def final_model(run_dir) -> dict:
    return model_state(list_checkpoints(run_dir)[-1])   # verified, whichever strategy wrote it


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2])   # world 4: test_parameters_equal_single_process ties it to one process
def test_digits_reaches_090_test_accuracy(cli, world):
    log = cli.tmp_path / "run.jsonl"
    result = cli.run("run", DEMO, "--headless", *cli.base_args(f"acc{world}"),
                     "--set", f"parallel.world_size={world}", "--telemetry-log", str(log), timeout=120)
    assert result.returncode == 0, result.stderr
    summary = read_jsonl(log)[-1]
    assert summary["type"] == "summary"
    assert summary["steps"] == 300
    assert summary["test_accuracy"] >= 0.9
    assert len(summary["peak_bytes_per_rank"]) == world
    assert "test accuracy" in result.stdout


@pytest.mark.timeout(120)
# in the quick set, tests/test_cluster.py runs ddp (sgd) and sharded (adamw) on 2 emulated hosts x 2 workers against the
# same reference, and tests/test_sharded.py compares sharded with DDP over a grid
@pytest.mark.slow
@pytest.mark.parametrize("strategy,world,optim", [("ddp", 2, "sgd"), ("ddp", 4, "adamw"), ("sharded", 2, "adamw")])
def test_parameters_equal_single_process(cli, strategy, world, optim):
    overrides = [f"optim.name={optim}", "optim.lr=0.01", f"parallel.strategy={strategy}"]
    args = [f"--set={o}" for o in overrides]
    log = cli.tmp_path / "run.jsonl"
    result = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("parity"),
                     "--set", f"parallel.world_size={world}", "--set", "telemetry.layer_every=5", *args,
                     "--telemetry-log", str(log))
    assert result.returncode == 0, result.stderr
    got = final_model(cli.tmp_path / "runs" / "parity")
    want = single_process_reference(overrides, 20)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    records = read_jsonl(log)   # every rank evaluated its share: the summed loss is one worker's
    assert records[-1]["val_loss"] == pytest.approx(reference_val_loss(overrides, want), abs=1e-5)
    assert records[-1]["perplexity"] == pytest.approx(math.exp(records[-1]["val_loss"]))
    steps = [r for r in records if r["type"] == "step"]
    total = sum(v.numel() * v.element_size() for v in want.values())
    owned = [entry["owned_bytes"] for entry in steps[-1]["ranks"]]
    if strategy == "sharded":   # two streams (the default), every byte owned once, owners in the layer table
        assert all(len(r["streams"]) == 2 for r in steps) and sum(owned) == total and all(owned)
        assert sum(s["bytes"] for s in steps[-1]["streams"]) > 0
        table = next(r["layers"] for r in reversed(steps) if "layers" in r)
        assert {e["name"]: e.get("owner_rank") for e in table if e["name"].startswith("fc")} == {"fc0": 0, "fc1": 1}
    else:
        assert owned == [0] * world and all(len(r["streams"]) == 1 for r in steps)


@pytest.mark.timeout(150)
# ddp: the restart test resumes it; pipeline: tests/test_rebalance.py resumes one (in its migrated layout)
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "sharded",
                                      pytest.param("pipeline", marks=pytest.mark.slow)])
def test_resumed_run_repeats_the_losses_of_an_uninterrupted_one(cli, strategy):   # ddp: the restart test resumes it
    common = ["--set", "checkpoint.every=5", "--set", "model.dropout=0.1",  # dropout: RNG state must resume too
              "--set", f"parallel.strategy={strategy}", "--set", f"optim.name={'sgd' if strategy == 'ddp' else 'adamw'}"]
    straight = cli.tmp_path / "straight.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("straight"), *common,
                "--telemetry-log", str(straight))
    assert r.returncode == 0, r.stderr
    # a second run resumes the first's step-10 checkpoint (a folder of another run: --resume takes either)
    at_10 = next(c for c in list_checkpoints(cli.tmp_path / "runs" / "straight") if c.name.endswith("10"))
    split = cli.tmp_path / "split.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("split"), *common,
                "--telemetry-log", str(split), "--resume", str(at_10))
    assert r.returncode == 0, r.stderr

    def losses(path):
        return {rec["step"]: rec["loss"] for rec in read_jsonl(path) if rec["type"] == "step"}
    want, got = losses(straight), losses(split)
    assert sorted(got) == list(range(11, 21))
    if strategy == "pipeline":   # seen twice in ~80 runs under load: step 13's loss 6e-8 apart (rounding; cause
        # not found, see the note); a state restored wrong moves the losses by far more than this
        assert [got[s] for s in range(11, 21)] == pytest.approx([want[s] for s in range(11, 21)], rel=1e-6, abs=0)
    else:
        assert [got[s] for s in range(11, 21)] == [want[s] for s in range(11, 21)]
    resumes = [rec for rec in read_jsonl(split) if rec.get("kind") == "resume"]
    assert resumes and resumes[0]["step"] == 10


# each optimizer the fused paths cover (engine/training/optim.py _FUSED), with the state its step keeps
FUSED_OPTIMIZERS = [
    pytest.param(dict(name="adamw", weight_decay=0.1), ("exp_avg", "exp_avg_sq", "step"), id="adamw"),
    pytest.param(dict(name="sgd", momentum=0.9, weight_decay=0.1), ("momentum_buffer",), id="sgd-momentum"),
    pytest.param(dict(name="sgd", momentum=0.0), (), id="sgd"),
]


@pytest.mark.parametrize("settings, kept", FUSED_OPTIMIZERS)
def test_a_fused_step_called_directly_equals_the_optimizer_own_bit_for_bit(settings, kept):
    """engine/training/optim.py `step`: after its first step, a fused AdamW's or SGD's kernel is called without
    the wrapper; the weights and the state are the optimizer's own, with weight decay, a learning rate that
    changes and a parameter without a gradient in some steps."""
    from engine.config import OptimConfig
    from engine.training.optim import make_optimizer, set_lr, step
    torch.manual_seed(0)
    ours, theirs = ([torch.nn.Parameter(torch.randn(16, 8)) for _ in range(3)] for _ in range(2))
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            b.copy_(a)
    cfg = OptimConfig(lr=0.01, kernel="fused", **settings)
    mine, torchs = make_optimizer(cfg, ours), make_optimizer(cfg, theirs)
    for k in range(6):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = None if (k % 3 == 2 and i == 1) else torch.randn(16, 8)
            a.grad, b.grad = g, None if g is None else g.clone()
        set_lr(mine, 0.01 / (k + 1))
        set_lr(torchs, 0.01 / (k + 1))
        step(mine)
        torchs.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert all(torch.equal(mine.state[a][key], torchs.state[b][key]) for key in kept)


@pytest.mark.parametrize("settings, kept", FUSED_OPTIMIZERS)
def test_fused_optimizers_stepped_in_one_launch_equal_each_its_own_bit_for_bit(settings, kept):
    """engine/training/optim.py `step_together`: a layer's optimizer each, stepped in one multi-tensor launch,
    give each optimizer's own step's weights and state, bit for bit; one whose settings differ (weight decay)
    is stepped apart, and one whose first step has not run (no state, its tensors not checked) is left to its
    own step."""
    from engine.config import OptimConfig
    from engine.training.optim import make_optimizer, set_lr, step, step_together
    torch.manual_seed(0)
    shapes = [(16, 8), (8,), (4, 4), (5,)]
    ours, theirs = ([torch.nn.Parameter(torch.randn(*s)) for s in shapes] for _ in range(2))
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            b.copy_(a)
    cfgs = [OptimConfig(lr=0.01, kernel="fused", **{**settings, "weight_decay": wd}) for wd in (0.1, 0.1, 0.0, 0.1)]
    mine = [make_optimizer(c, [p]) for c, p in zip(cfgs, ours)]
    torchs = [make_optimizer(c, [p]) for c, p in zip(cfgs, theirs)]
    for k in range(5):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = None if (k == 2 and i == 1) else torch.randn_like(a)
            a.grad, b.grad = g, None if g is None else g.clone()
        for m, t in zip(mine, torchs):
            set_lr(m, 0.01 / (k + 1))
            set_lr(t, 0.01 / (k + 1))
        left = step_together(mine)
        if k == 0:
            assert left == mine   # no state yet: each makes its own
        else:
            assert left == []
        for m in left:
            step(m)
        for t in torchs:
            t.step()
    for m, t, a, b in zip(mine, torchs, ours, theirs):
        assert torch.equal(a, b)
        assert all(torch.equal(m.state[a][key], t.state[b][key]) for key in kept)
