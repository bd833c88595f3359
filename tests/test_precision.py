"""`[precision] compute = "bf16"`: every strategy computes under autocast and equals one process computing the
same way, step by step, far closer than bf16 is to fp32; fp32 enters no autocast (the parity tests elsewhere
stay bit for bit).

Why a tolerance at all: a strategy splits the global batch over ranks (and micro-batches), so a bf16 matmul's
sum over the batch is rounded per part and the parts are summed in fp32, where one process rounds the whole
sum once. Those roundings differ by about bf16's epsilon (2^-8) relative, per step: the same kind of noise,
and the same size, as bf16 against fp32, which the test measures beside them (TOLERANCE); a real fault (a
10% slower learning rate) moves the losses by over 20 times the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import load_config
from engine.data import batch_for, load_dataset
from engine.models import build_model
from engine.optim import make_optimizer
from engine.precision import DTYPES, compute_in, dtype_code
from engine.strategies.ddp import cross_entropy
from tests.conftest import read_jsonl
from tests.test_training import DEMO

STEPS = 20
PS = ["parallel.world_size=3", "parallel.servers=1", "parallel.workers=2", "parallel.sync=bsp"]


def one_process_losses(overrides: list[str], steps: int) -> list[float]:
    """The global batch's loss at each step, one process, in the config's precision."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed)
    opt = make_optimizer(cfg.optim, model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch_for(ds, step, cfg.data.batch_size, cfg.run.seed)
        opt.zero_grad()
        with compute_in(cfg.precision, torch.device("cpu")):
            loss = cross_entropy(model(x), y)
            loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


def test_fp32_enters_no_autocast_and_bf16_computes_matmuls_in_bf16():
    cfg32, cfg16 = load_config(DEMO), load_config(DEMO, ["precision.compute=bf16"])
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with compute_in(cfg32.precision, torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu") and layer(x).dtype == torch.float32
    with compute_in(cfg16.precision, torch.device("cpu")):
        assert layer(x).dtype == torch.bfloat16
        assert cross_entropy(layer(x), torch.tensor([0, 1])).dtype == torch.float32   # the loss stays fp32
    assert DTYPES[dtype_code(torch.bfloat16)] == torch.bfloat16
    with pytest.raises(ValueError, match="cannot cross a link"):
        dtype_code(torch.complex64)


def test_a_bad_precision_is_refused_by_name():
    from engine.config import ConfigError
    with pytest.raises(ConfigError, match=r'precision.compute = "fp16": must be one of "fp32", "bf16"'):
        load_config(DEMO, ["precision.compute=fp16"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, extra", [("ddp", []), ("sharded", []), ("pipeline", []),
                                             ("param_server", PS)], ids=["ddp", "sharded", "pipeline", "ps-bsp"])
def test_every_strategy_in_bf16_equals_one_process_in_bf16(cli, strategy, extra):
    log = cli.tmp_path / "bf16.jsonl"
    sets = [f"parallel.strategy={strategy}", *extra, "precision.compute=bf16", "run.eval_every=0"]
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args(f"bf16-{strategy}"),
                *(a for s in sets for a in ("--set", s)), "--telemetry-log", str(log), timeout=230)
    assert r.returncode == 0, r.stderr
    start = read_jsonl(log)[0]
    assert start["config"]["precision"] == {"compute": "bf16"}
    got = [rec["loss"] for rec in read_jsonl(log) if rec["type"] == "step"]
    bf16, fp32 = one_process_losses(["precision.compute=bf16"], STEPS), one_process_losses([], STEPS)
    noise = max(abs(a - b) for a, b in zip(bf16, fp32))   # what bf16's rounding moves the losses by: ~2e-4 here
    gap = max(abs(a - b) for a, b in zip(got, bf16))      # measured: 0.9e-4 (ddp, sharded, ps), 1.3e-4 (pipeline)
    assert noise > 1e-5   # bf16 really computes in bf16: it moves the losses
    assert got[0] == pytest.approx(bf16[0], abs=1e-6)     # the first forward, on the same weights: equal
    assert gap <= TOLERANCE(noise), (gap, noise)


def TOLERANCE(noise: float) -> float:
    """Splitting a batch changes which partial sums bf16 rounds, so a strategy differs from one process by
    rounding noise of the size bf16 differs from fp32 (measured beside it), not less: twice that, plus 1e-4."""
    return 2 * noise + 1e-4


def test_the_tolerance_would_catch_a_real_fault():
    """A fault as small as a 10% slower learning rate moves the bf16 losses by about 50 times the tolerance."""
    bf16, fp32 = one_process_losses(["precision.compute=bf16"], STEPS), one_process_losses([], STEPS)
    noise = max(abs(a - b) for a, b in zip(bf16, fp32))
    slower = one_process_losses(["precision.compute=bf16", "optim.lr=0.045"], STEPS)
    assert max(abs(a - b) for a, b in zip(slower, bf16)) > 20 * TOLERANCE(noise)


def test_the_console_header_says_bf16():
    from console.state import RunState, headline
    state = RunState()
    state.apply({"type": "hello", "run": "r", "mode": "ddp", "world_size": 2, "config": {"precision": {"compute": "bf16"}}})
    assert "ddp×2  bf16" in headline(state, wide=True, live=False).plain
    state.apply({"type": "hello", "run": "s", "mode": "ddp", "world_size": 2, "config": {"precision": {"compute": "fp32"}}})
    assert "fp32" not in headline(state, wide=True, live=False).plain and state.precision == "fp32"


@pytest.mark.timeout(120)
def test_a_pipeline_boundary_carries_half_the_bytes_in_bf16(cli):
    """Stage 0 sends its last layer's activations, stage 1 their gradients back: bf16 under autocast, in the
    payload's own dtype (the header names it), so each step's bytes halve exactly."""
    sent = {}
    for compute in ("fp32", "bf16"):
        log = cli.tmp_path / f"{compute}.jsonl"
        r = cli.run("run", DEMO, "--headless", "--steps", "3", *cli.base_args(f"pipe-{compute}"), "--set",
                    "parallel.strategy=pipeline", "--set", f"precision.compute={compute}", "--set", "run.eval_every=0",
                    "--set", "telemetry.rank_every=1", "--telemetry-log", str(log))
        assert r.returncode == 0, r.stderr
        sent[compute] = [[stage["sent_bytes"] for stage in rec["stages"]] for rec in read_jsonl(log)
                         if rec["type"] == "step"]
    assert all(b > 0 for step in sent["fp32"] for b in step)
    assert [[2 * b for b in step] for step in sent["bf16"]] == sent["fp32"]
