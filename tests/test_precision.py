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

import math

import pytest
import torch

from engine.config import load_config
from engine.training.data import batch_for, load_dataset
from engine.models import build_model
from engine.training.optim import lr_at, make_optimizer, set_lr
from engine.training.precision import DTYPES, compute_in, dtype_code, param_dtype
from engine.training.loss import cross_entropy
from tests.conftest import read_jsonl
from tests.test_figures import validate_log
from tests.test_training import DEMO

STEPS = 20
BF16 = ["precision.compute=bf16", "precision.params=bf16"]
WEIGHT_STEPS = 14   # the bf16-weight parity runs: past the pipeline's migration (checks every 3 steps)   # bf16 weights (fp32 masters where updates run)
PS = ["parallel.world_size=3", "parallel.param_server.servers=1", "parallel.param_server.workers=2", "parallel.param_server.sync=bsp"]


def one_process_losses(overrides: list[str], steps: int, config: str = DEMO) -> list[float]:
    """The global batch's loss at each step, one process, in the config's precision (one_process_run)."""
    return one_process_run(overrides, steps, config)[0]


def one_process_run(overrides: list[str], steps: int, config: str = DEMO) -> tuple[list[float], list[float]]:
    """The global batch's loss and gradient norm at each step, one process, in the config's precision: with bf16
    weights, an fp32 master copy steps on the widened gradient and is narrowed back into the weights (written
    out here, apart from engine/techniques/updates/layer.py, which the strategies use). The learning rate follows
    the schedule; the norm is taken as the step guard takes it (fp32 norms of the gradients, summed in fp64),
    and a clip scales the gradient in its own dtype before it is widened."""
    cfg = load_config(config, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed).to(param_dtype(cfg.precision))
    weights = list(model.parameters())
    wide = cfg.precision.params == "bf16"
    master = [p.detach().float() for p in weights] if wide else weights
    opt = make_optimizer(cfg.optim, master)
    losses, norms = [], []
    for step in range(steps):
        set_lr(opt, lr_at(cfg.optim, step, steps))
        x, y = batch_for(ds, step, cfg.data.batch_size, cfg.run.seed)
        for p in weights:
            p.grad = None
        with compute_in(cfg.precision, torch.device("cpu")):
            loss = cross_entropy(model(x), y)
            loss.backward()
        losses.append(loss.item())
        grads = [p.grad for p in weights]
        norms.append(math.sqrt(float(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double()
                                     .square().sum())))
        if cfg.optim.clip_grad_norm and cfg.optim.clip_grad_norm / (norms[-1] + 1e-6) < 1:
            for g in grads:
                g.mul_(cfg.optim.clip_grad_norm / (norms[-1] + 1e-6))
        if wide:
            for p, m in zip(weights, master):
                m.grad = p.grad.float()
        opt.step()
        if wide:
            with torch.no_grad():
                for p, m in zip(weights, master):
                    p.copy_(m)
    return losses, norms


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
    with pytest.raises(ConfigError, match=r'precision.params = "fp16": must be one of "fp32", "bf16"'):
        load_config(DEMO, ["precision.params=fp16"])
    with pytest.raises(ConfigError, match=r'precision.params = "bf16" needs precision.compute = "bf16" '
                                          r'\(got "fp32"\): an fp32 forward cannot compute with bf16 weights'):
        load_config(DEMO, ["precision.params=bf16"])
    with pytest.raises(ConfigError, match=r'precision.reduce = "bf16" needs precision.params = "bf16" '
                                          r'\(got "fp32"\).*gradient compression'):
        load_config(DEMO, ["precision.compute=bf16", "precision.reduce=bf16"])
    for ok in (["precision.compute=bf16"], BF16, [*BF16, "precision.reduce=bf16"]):
        load_config(DEMO, ok)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, extra", [("pipeline", [])], ids=["pipeline"])
def test_every_strategy_in_bf16_equals_one_process_in_bf16(cli, strategy, extra):
    """bf16 compute over fp32 weights: the sharded and parameter-server paths are those of fp32 under autocast
    (their bf16-weight runs below cover them), and so is ddp's; the pipeline's boundary (its tensors' own
    dtype) here. Stage 0 sends its last layer's activations, stage 1 their gradients back: bf16 under
    autocast, in the payload's own dtype (the header names it), so each step's bytes are half of fp32's:
    the batch times the boundary's width (the MLP's hidden size) times 2 bytes, each way."""
    log = cli.tmp_path / "bf16.jsonl"
    sets = [f"parallel.strategy={strategy}", *extra, "precision.compute=bf16", "run.eval_every=0",
            "telemetry.rank_every=1"]
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args(f"bf16-{strategy}"),
                *(a for s in sets for a in ("--set", s)), "--telemetry-log", str(log), timeout=230)
    assert r.returncode == 0, r.stderr
    start = read_jsonl(log)[0]
    assert start["config"]["precision"] == {"compute": "bf16", "params": "fp32", "reduce": "fp32"}
    got = [rec["loss"] for rec in read_jsonl(log) if rec["type"] == "step"]
    bf16, fp32 = one_process_losses(["precision.compute=bf16"], STEPS), one_process_losses([], STEPS)
    noise = max(abs(a - b) for a, b in zip(bf16, fp32))   # what bf16's rounding moves the losses by: ~2e-4 here
    gap = max(abs(a - b) for a, b in zip(got, bf16))      # measured: 0.9e-4 (ddp, sharded, ps), 1.3e-4 (pipeline)
    assert noise > 1e-5   # bf16 really computes in bf16: it moves the losses
    assert got[0] == pytest.approx(bf16[0], abs=1e-6)     # the first forward, on the same weights: equal
    assert gap <= TOLERANCE(noise), (gap, noise)
    config = start["config"]
    boundary = config["data"]["batch_size"] * config["model"]["hidden"] * 2
    sent = [[stage["sent_bytes"] for stage in rec["stages"]] for rec in read_jsonl(log) if rec["type"] == "step"]
    assert sent and all(step == [boundary, boundary] for step in sent), (sent[:3], boundary)


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
    for precision, shown in (({"compute": "bf16", "params": "bf16", "reduce": "fp32"}, "ddp×2  bf16 weights  "),
                             ({"compute": "bf16", "params": "bf16", "reduce": "bf16"}, "ddp×2  bf16 weights+sum")):
        state.apply({"type": "hello", "run": "w", "mode": "ddp", "world_size": 2, "config": {"precision": precision}})
        assert shown in headline(state, wide=True, live=False).plain


# --- bf16 weights: fp32 masters where the updates run ----------------------------------------------------

PIPELINE_MIGRATING = ["parallel.strategy=pipeline", "model.hidden=512", "model.depth=3",
                      'parallel.pipeline.partition=[["fc0"], ["act0", "fc1", "act1", "fc2", "act2", "head"]]',
                      "parallel.pipeline.rebalance_check_every=3", 'memory.policy={fc1 = "swap", fc2 = "recompute"}']
WEIGHT_CASES = {
    "ddp": ["parallel.strategy=ddp"],
    "sharded-gated": ["parallel.strategy=sharded", "parallel.sharded.overlap_forward=true"],
    "hybrid-host-reduce-bf16": ["parallel.strategy=ddp", "update.placement=host", "precision.reduce=bf16"],
    "pipeline-migration-swap-recompute": PIPELINE_MIGRATING,
    "ps-bsp": ["parallel.strategy=param_server", *PS],
}


def run_records(cli, name: str, sets: list[str], steps: int, timeout: int = 230) -> list[dict]:
    log = cli.tmp_path / f"{name}.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", str(steps), *cli.base_args(name), "--set", "run.eval_every=0",
                *(a for s in sets for a in ("--set", s)), "--telemetry-log", str(log), timeout=timeout)
    assert r.returncode == 0, r.stderr
    return validate_log(log)   # every rank entry closed over the declared figures (bf16's masters among them)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c in ("ddp", "sharded-gated") else pytest.mark.slow)
                                  for c in WEIGHT_CASES])
def test_every_strategy_with_bf16_weights_equals_one_process_with_bf16_weights(cli, case):
    """compute = params = "bf16": bf16 weights and gradients everywhere, fp32 masters where the updates run
    (ddp: every rank; sharded: the owner; a host-placed layer: the host; the pipeline: the stage, carried along
    by a live migration; the parameter server: the server). Equal to one process doing the same."""
    records = run_records(cli, f"w16-{case}", [*BF16, *WEIGHT_CASES[case]], WEIGHT_STEPS)
    assert records[0]["config"]["precision"]["params"] == "bf16"
    got = [rec["loss"] for rec in records if rec["type"] == "step"]
    model = [s for s in WEIGHT_CASES[case] if s.startswith("model.")]
    bf16, fp32 = one_process_losses([*BF16, *model], WEIGHT_STEPS), one_process_losses(model, WEIGHT_STEPS)
    noise = max(abs(a - b) for a, b in zip(bf16, fp32))   # bf16 weights move the losses by ~1e-3 here
    gap = max(abs(a - b) for a, b in zip(got, bf16))
    assert noise > 1e-4
    assert got[0] == pytest.approx(bf16[0], abs=1e-6)
    assert gap <= TOLERANCE(noise), (gap, noise)
    ranks = [r for rec in records if rec["type"] == "step" for r in rec.get("ranks", [])]
    if case.startswith("pipeline"):   # it really migrated, swapped and recomputed
        assert any(rec.get("kind") == "migration" for rec in records)
        assert any(r.get("swap_layers") for r in ranks) and any(r.get("recompute_layers") for r in ranks)
        assert all("recv_wait_ms" in r for r in ranks) and any(r["migration_bytes"] for r in ranks)
    if case.startswith("sharded"):   # its own figures reach the log
        assert all({"reduce_ms", "broadcast_wait_ms", "reduce_span_ms", "gate_ms"} <= set(r) for r in ranks)


def test_bf16_weights_halve_the_parameters_and_the_mlp_activations_exactly():
    """The ledger counts each tensor's own bytes: bf16 weights are half of fp32, and so is every activation
    an MLP layer saves under autocast (its input, its output, the ReLU's mask). The masters are counted on
    their own (`master`), never as parameters."""
    from engine.runtime.devices import MemoryLedger
    from engine.techniques.updates.updater import LayerUpdates
    from engine.models.layers import params_by_layer
    from engine.config import UpdateConfig
    from engine.runtime.devices import LedgerDevice
    counted = {}
    for name, sets in (("fp32", []), ("bf16", BF16)):
        cfg = load_config(DEMO, sets)
        ds = load_dataset(cfg.data, cfg.run.seed)
        model = build_model(cfg.model, ds.meta, cfg.run.seed).to(param_dtype(cfg.precision))
        device = LedgerDevice(1 << 30)
        updater = LayerUpdates(model, params_by_layer(model), cfg.optim, device, UpdateConfig())
        device.ledger.track_module(model, updater)
        for layer_name, layer in zip(model.names, model.layers):
            layer.register_forward_pre_hook(lambda *_, n=layer_name: setattr(device.ledger, "current_layer", n))
        x, y = batch_for(ds, 0, cfg.data.batch_size, cfg.run.seed)
        with compute_in(cfg.precision, torch.device("cpu")), device.ledger.saved_activations():
            logits = model(x)
            device.ledger.current_layer = None   # the loss's own saves (fp32 under autocast) are no layer's
            loss = cross_entropy(logits, y)
            loss.backward()
        updater.end_backward()
        device.ledger.refresh()
        counted[name] = {"parameters": device.ledger.bytes["parameters"], "master": device.ledger.bytes["master"],
                         "layers": {n: b for n, b in device.ledger.activations_by_layer.items() if n}}
        updater.close()
    fp32, bf16 = counted["fp32"], counted["bf16"]
    assert fp32["parameters"] == 2 * bf16["parameters"] and fp32["master"] == 0
    assert bf16["master"] == fp32["parameters"]   # the fp32 master: as many bytes as fp32 weights
    assert fp32["layers"] and set(fp32["layers"]) == set(bf16["layers"])
    assert {n: 2 * b for n, b in bf16["layers"].items()} == fp32["layers"]


def _per_step(records, key):
    return [key(rec) for rec in records if rec["type"] == "step"]


@pytest.mark.timeout(240)
def test_bf16_weights_halve_the_broadcast_the_host_link_and_the_all_reduce(cli):
    """Byte counts, exactly, against the fp32 model's own bytes: sharded's sliced broadcast per step carries every
    weight once (fp32: all of the model's parameter bytes); the host link of host-placed layers carries every
    gradient down and every weight up (fp32: twice them, per rank); ddp's all-reduce with
    precision.reduce = "bf16" carries every gradient once. With bf16 weights each is exactly half. (With
    reduce = "fp32", the default, the all-reduce carries fp32: the sum runs on the link.)"""
    cfg = load_config(DEMO)
    model = build_model(cfg.model, load_dataset(cfg.data, cfg.run.seed).meta, cfg.run.seed)
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())   # 104,488 for the digits MLP
    full = ["telemetry.rank_every=1"]
    sharded = run_records(cli, "sh-bf16", [*BF16, "parallel.strategy=sharded", *full], 3)
    # step 1 also carries the start's broadcast of the owners' weights (every rank starts from them)
    assert _per_step(sharded, lambda r: sum(s["bytes"] for s in r["streams"])) == [fp32_bytes, *[fp32_bytes // 2] * 2]
    host = run_records(cli, "host-bf16", [*BF16, "precision.reduce=bf16", "update.placement=host", *full], 3)
    assert _per_step(host, lambda r: [rank["host_link_bytes"] for rank in r["ranks"]]) == [[fp32_bytes] * 2] * 3
    assert _per_step(host, lambda r: r["streams"][0]["bytes"]) == [fp32_bytes // 2] * 3
    fp32 = run_records(cli, "host-fp32", ["update.placement=host", *full], 1)   # the same figures in fp32: the model's
    assert _per_step(fp32, lambda r: [rank["host_link_bytes"] for rank in r["ranks"]]) == [[2 * fp32_bytes] * 2]
    assert _per_step(fp32, lambda r: r["streams"][0]["bytes"]) == [fp32_bytes]

@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["sharded-host"])
def test_a_bf16_run_resumes_exactly_from_its_fp32_masters_and_refuses_another_precision(cli, case):
    """A checkpoint holds the fp32 masters (not the bf16 weights), so a resumed run repeats the losses of an
    uninterrupted one bit for bit; resuming it in another precision is refused by name. Sharded with its
    updates on the host: the masters live on the host and are written from there. (ddp and the pipeline's
    stages write theirs through the same LayerUpdates.weights_state; a server's layers are fp32 already;
    resumed by hand here with ps-bsp and pipeline, bit for bit.)"""
    from engine.runtime.checkpoint import list_checkpoints, model_state
    sets = {"sharded-host": ["parallel.strategy=sharded", "update.placement=host", "optim.name=adamw"],
            "pipeline": ["parallel.strategy=pipeline"], "ps-bsp": ["parallel.strategy=param_server", *PS]}[case]
    sets = [*BF16, *sets, "checkpoint.every=5"]

    def losses(records):
        return {rec["step"]: rec["loss"] for rec in records if rec["type"] == "step"}
    straight = losses(run_records(cli, "straight", sets, 12))
    at_6 = [c for c in list_checkpoints(cli.tmp_path / "runs" / "straight") if int(c.name[-6:]) <= 6][-1]
    assert all(v.dtype == torch.float32 for k, v in model_state(at_6).items() if "weight" in k)   # the masters
    first = int(at_6.name[-6:])
    log = cli.tmp_path / "split.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "12", *cli.base_args("split"), "--set", "run.eval_every=0",
                *(a for s in sets for a in ("--set", s)), "--telemetry-log", str(log), "--resume", str(at_6))
    assert r.returncode == 0, r.stderr
    split = losses(read_jsonl(log))
    assert sorted(split) == list(range(first + 1, 13)) and all(split[s] == straight[s] for s in split)
    if case != "sharded-host":   # the refusal is the launcher's, before any strategy: once is enough
        return
    fp32 = [s for s in sets if not s.startswith("precision.")]
    r = cli.run("run", DEMO, "--headless", "--steps", "12", *cli.base_args("other"),
                *(a for s in fp32 for a in ("--set", s)), "--resume", str(at_6))
    assert r.returncode != 0
    assert (f'{at_6}: written with precision.compute = "bf16"; this run has precision.compute = "fp32" (resume '
            f'in the precision the run was started with)') in r.stderr


def one_process_accuracy(overrides: list[str], steps: int) -> float:
    """The digits demo trained `steps` steps in one process (as one_process_losses), then its test accuracy."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    model = build_model(cfg.model, ds.meta, cfg.run.seed).to(param_dtype(cfg.precision))
    weights = list(model.parameters())
    master = [p.detach().float() for p in weights] if cfg.precision.params == "bf16" else weights
    opt = make_optimizer(cfg.optim, master)
    for step in range(steps):
        x, y = batch_for(ds, step, cfg.data.batch_size, cfg.run.seed)
        for p in weights:
            p.grad = None
        with compute_in(cfg.precision, torch.device("cpu")):
            cross_entropy(model(x), y).backward()
        if master is not weights:
            for p, m in zip(weights, master):
                m.grad = p.grad.float()
        opt.step()
        if master is not weights:
            with torch.no_grad():
                for p, m in zip(weights, master):
                    p.copy_(m)
    with torch.no_grad(), compute_in(cfg.precision, torch.device("cpu")):
        return (model(ds.x_test).argmax(-1) == ds.y_test).float().mean().item()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_weights_converge_as_fp32_does(cli):
    """Digits in bf16 (compute and weights) reaches fp32's test accuracy within 0.5 points (300 steps, one
    process: the parity tests above tie every strategy to it). The text transformer trained by the engine
    (ddp, world 2, 150 steps) ends within 2% of fp32's loss, at half its demo's batch (16): bf16 matmuls cost
    this CPU, which has no bf16 units, about 60 times fp32's. Measured: digits 95.54% in both; text at batch 32,
    300 steps 2.0177 (fp32) against 2.0158 (bf16); at batch 16, 150 steps 2.4165 against 2.4184."""
    from pathlib import Path
    accuracy = {name: one_process_accuracy(sets, 300) for name, sets in (("fp32", []), ("bf16", BF16))}
    # bf16 not worse by more than 0.5 points (better is no failure: torch's AVX2 kernels gave bf16 96.10%, fp32
    # 95.54%, two samples of the 359 apart; its AVX-512 ones 95.54% in both)
    assert accuracy["fp32"] > 0.9 and accuracy["bf16"] >= accuracy["fp32"] - 0.005, accuracy
    text = str(Path(DEMO).with_name("text_sharded.toml"))
    as_ddp = ["parallel.strategy=ddp", "parallel.world_size=2", "data.batch_size=16", "run.steps=150",
              "run.eval_every=0", "checkpoint.every=0"]
    loss = {}
    for name, sets in (("fp32", []), ("bf16", BF16)):
        log = cli.tmp_path / f"text-{name}.jsonl"
        r = cli.run("run", text, "--headless", *cli.base_args(f"text-{name}"),
                    *(a for s in [*as_ddp, *sets] for a in ("--set", s)), "--telemetry-log", str(log), timeout=280)
        assert r.returncode == 0, r.stderr
        steps = [rec for rec in read_jsonl(log) if rec["type"] == "step"]
        assert steps[-1]["step"] == 150
        loss[name] = steps[-1]["loss"]
    assert loss["fp32"] < 2.6 and abs(loss["bf16"] - loss["fp32"]) <= 0.02 * loss["fp32"], loss
