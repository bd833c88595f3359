"""A user's own model through `engine.train`: every strategy equals one worker on models the project did
not define (torch's nn.TransformerEncoderLayer wrapped by hand; GPT-2 and Mistral from transformers, as they
are, in fp32 and with bf16 weights; Mixtral and Qwen2-MoE in data parallel), no worker shares the caller's
memory, and the caller's model holds the run's final weights when `train` returns. (Each family's function
against transformers' own forward: tests/test_hf_models.py.)"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from engine.config import OptimConfig, config_from_dict
from engine.training.data import batch_for
from engine.run.handover import HandoverError, hand_over, load_final_weights, received_model
from engine.run.rank import Job
from tests.conftest import ROOT, train_one_process
from tests.user_models import BLOCKS, MODELS, RARE, SEQ_LEN, VOCAB, as_layers, masked_token_data, token_data

STEPS, BATCH, SEED = 8, 32, 0
MOE_STEPS = 3   # test_mixture_of_experts_...: before a router's near tie can part the runs
OPTIM = {"name": "adamw", "lr": 3e-3}
BLOCK_NAMES = [f"block{i}" for i in range(BLOCKS)]
STRATEGIES = {
    "ddp": {"parallel": {"strategy": "ddp"}},
    "ddp-host": {"parallel": {"strategy": "ddp"}, "update": {"placement": "host"}},
    "sharded-gated-host": {"parallel": {"strategy": "sharded", "sharded": {"overlap_forward": True}},
                           "update": {"placement": "host"}},
    # a skewed start that the last stage rebalances at step 2: layers migrate while training runs, their
    # activations swapped to the host or recomputed in backward
    "pipeline-migrating": {"parallel": {"strategy": "pipeline",
                                        "pipeline": {"partition": [["embed"], [*BLOCK_NAMES, "norm", "head"]],
                                                     "rebalance": "auto", "rebalance_check_every": 2}},
                           "memory": {"policy": {"block0": "swap", "block1": "recompute", "block3": "swap",
                                                 "head": "recompute"}}},
    "param_server-bsp": {"parallel": {"strategy": "param_server",
                                      "param_server": {"servers": 1, "workers": 2, "sync": "bsp", "slow_workers": {}}}},
}
WORLDS = {"ddp": [1, 2], "param_server-bsp": [3]}


def reference(model_name: str, data: str = "tokens", steps: int = STEPS) -> tuple[dict, list[float]]:
    """One process, one AdamW step per whole global batch: what every strategy must equal."""
    ds = masked_token_data() if data == "masked" else token_data()
    batches = [batch_for(ds, step, BATCH, SEED) for step in range(steps)]
    return train_one_process(as_layers(MODELS[model_name](seed=0)), OptimConfig(**OPTIM), batches)


def train_in_a_script(tmp_path, model_name: str | list[str], strategies: list[str], timeout_s: float = 150,
                      data: str = "tokens", worlds: dict | None = None, precision: dict | None = None,
                      steps: int = STEPS, find_unused: list[str] = ()) -> list[dict]:
    """tests/user_model_run.py in a process session of its own, reaped whatever happens: each model (one name or
    several), each strategy at each of its world sizes (`worlds`, else WORLDS), one after the other in one
    process (as a user's script would; transformers is imported once, and the workers fork from a server that
    has it). `precision`: the [precision] section of every run."""
    names = [model_name] if isinstance(model_name, str) else model_name
    runs = [{"label": strategy, "world": world, "model": name,
             "config": {"run": {"name": f"user-{name}-{strategy}", "steps": steps, "seed": SEED,
                                "dir": str(tmp_path / "runs")},
                        "data": {"batch_size": BATCH}, "optim": OPTIM, "telemetry": {"hub": False},
                        **({"precision": precision} if precision else {}), **STRATEGIES[strategy]}}
            for name in names for strategy in strategies for world in (worlds or WORLDS).get(strategy, [2])]
    for run in runs:   # `find_unused`: the models that leave a parameter without a gradient in some step
        if run["model"] in find_unused and run["label"].startswith("ddp"):
            run["config"]["parallel"] = {**run["config"].get("parallel", {}), "ddp": {"find_unused_parameters": True}}
    out = tmp_path / "results.pt"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "user_model_run.py"), str(out),
                             json.dumps({"model": names[0], "runs": runs, "data": data})],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        _, err = proc.communicate()
        pytest.fail(f"the runs did not finish in {timeout_s:g} s\n{err}")
    finally:
        try:
            os.killpg(proc.pid, 9)   # nothing of the run outlives the test
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err
    return torch.load(out, weights_only=False)


def assert_states_equal(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


def check_runs(runs: list[dict], want_state: dict, want_losses: list[float]) -> list[str]:
    """Every run equals the one-process reference; the failures, by strategy and world, else []."""
    failures = []
    for run in runs:
        where = f"{run['label']} at world {run['world']}"
        try:
            assert len(run["losses"]) == len(want_losses)
            assert run["losses"] == pytest.approx(want_losses, abs=1e-5)
            assert_states_equal(run["checkpoint"], want_state)
            # the caller's model holds the run's final weights, exactly the final checkpoint's
            assert_states_equal(run["caller"], run["checkpoint"], atol=0)
            assert not any(name.startswith("user_model") for name in run["left_in_run_dir"]), run["left_in_run_dir"]
            if run["label"] == "pipeline-migrating":
                assert "migration" in run["events"], run["events"]
        except AssertionError as e:
            failures.append(f"{where}: {str(e)[:1500]}")
    return failures


def _has_transformers() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformers") is not None


def test_ddp_equals_one_worker_on_a_model_wrapped_by_hand(tmp_path):
    want_state, want_losses = reference("encoder")
    runs = train_in_a_script(tmp_path, "encoder", ["ddp"])
    assert check_runs(runs, want_state, want_losses) == []
    assert_states_equal(runs[1]["caller"], runs[0]["caller"])   # world 2 leaves the caller's model as world 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_labels_of_minus_100_count_for_nothing_and_every_strategy_still_equals_one_worker(tmp_path):
    """A third of the targets are -100, at random: the ranks' shares count different numbers of them, and the
    loss is still the mean over the global batch's counted targets (each share weighed by its count)."""
    ds = masked_token_data()
    counts = [int((batch_for(ds, 0, BATCH, SEED, rank, 2)[1] != -100).sum()) for rank in range(2)]
    assert counts[0] != counts[1], counts   # the case in point: shares that count differently
    want_state, want_losses = reference("encoder", data="masked")
    runs = train_in_a_script(tmp_path, "encoder", ["ddp", "sharded-gated-host", "pipeline-migrating",
                                                   "param_server-bsp"], timeout_s=280, data="masked")
    assert check_runs(runs, want_state, want_losses) == []
    assert all(r["summary"]["test_accuracy"] is not None for r in runs)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
@pytest.mark.parametrize("model_name", ["gpt2", "mistral"])
def test_every_strategy_equals_one_worker_on_a_hugging_face_model_as_it_is(tmp_path, model_name):
    """GPT-2 (learned positions, tied input and output embeddings) and Mistral (rotary, grouped-query attention,
    a sliding window of 5 in sequences of 16), passed to engine.train as transformers builds them. The one
    worker computes the model's own function: its first loss is the cross entropy of the model's own logits."""
    want_state, want_losses = reference(model_name)
    x, y = batch_for(token_data(), 0, BATCH, SEED)
    with torch.no_grad():
        logits = MODELS[model_name](seed=0).eval()(input_ids=x).logits   # T targets for T inputs: no labels=
    own = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    assert want_losses[0] == pytest.approx(own, abs=1e-6)
    runs = train_in_a_script(tmp_path, model_name, list(STRATEGIES), timeout_s=360)
    assert [(r["label"], r["world"]) for r in runs] == [(s, w) for s in STRATEGIES for w in WORLDS.get(s, [2])]
    assert check_runs(runs, want_state, want_losses) == []
    if model_name == "gpt2":   # one weight for both ends, in the caller's model after every strategy
        for run in runs:
            assert run["tied"], run["label"]


def test_a_job_handed_to_workers_carries_no_tensor_of_the_callers(tmp_path):
    model, data = MODELS["encoder"](seed=0), token_data()
    cfg = config_from_dict({"run": {"name": "handover", "dir": str(tmp_path / "runs")}})
    job = Job(config=cfg, model=model, data=data)
    with pytest.raises(RuntimeError, match="hand_over"):
        pickle.dumps(job)   # never the caller's model itself
    hand_over(job)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(job)   # what spawning a worker does with its arguments
    assert not any(p.is_shared() for p in model.parameters())
    assert not data.x_train.is_shared() and job.data is not data and job.data.x_train.is_shared()
    worker_job = pickle.loads(buffer.getvalue())
    assert worker_job.model is None and worker_job.model_file == job.model_file
    mine = received_model(worker_job)
    assert_states_equal(mine.state_dict(), model.state_dict(), atol=0)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(mine.parameters(), model.parameters()))
    with torch.no_grad():
        next(mine.parameters()).add_(1.0)   # a worker's update
    assert_states_equal(MODELS["encoder"](seed=0).state_dict(), model.state_dict(), atol=0)


class Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.hook = lambda x: x   # a lambda does not pickle

    def forward(self, x):
        return self.fc(x)


def test_a_model_that_does_not_pickle_is_refused_by_name(tmp_path):
    from engine.models import LayerList
    cfg = config_from_dict({"run": {"name": "handover", "dir": str(tmp_path / "runs")}})
    cfg.run_dir.mkdir(parents=True)
    job = Job(config=cfg, model=LayerList([("odd", Unpicklable())]))
    with pytest.raises(HandoverError, match="torch.save failed.*module level"):
        hand_over(job)
    assert list(cfg.run_dir.iterdir()) == []


def test_final_weights_that_do_not_fit_the_model_are_refused(tmp_path):
    from engine.runtime import checkpoint as ckpt
    model = MODELS["encoder"](seed=0)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        load_final_weights(model, tmp_path)


@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
def test_a_hugging_face_model_from_a_config_file_or_a_weights_folder(tmp_path):
    """`[model] name = "hf"`: hf_config builds the model with random weights seeded by run.seed; hf_weights loads
    a save_pretrained folder as it is. Nothing is downloaded."""
    from engine.config import ModelConfig
    from engine.models import build_model
    hf = MODELS["llama"](seed=3)
    hf.config.to_json_file(tmp_path / "config.json")
    built = build_model(ModelConfig(name="hf", hf_config=str(tmp_path / "config.json")), {"vocab_size": 40}, seed=0)
    again = build_model(ModelConfig(name="hf", hf_config=str(tmp_path)), {}, seed=0)
    assert built.names == ["embed", *BLOCK_NAMES, "norm", "head"]
    assert_states_equal(built.state_dict(), again.state_dict(), atol=0)   # seeded: every rank builds the same
    hf.save_pretrained(tmp_path / "weights")
    loaded = build_model(ModelConfig(name="hf", hf_weights=str(tmp_path / "weights")), {}, seed=0)
    assert_states_equal(loaded.state_dict(), as_layers(hf).state_dict(), atol=0)
    with pytest.raises(ValueError, match="token ids go up to 99, past the model's vocab_size 48"):
        build_model(ModelConfig(name="hf", hf_config=str(tmp_path / "config.json")), {"vocab_size": 100}, seed=0)


def test_a_model_of_an_unknown_layout_is_refused_naming_what_was_looked_for():
    import engine
    with pytest.raises(TypeError, match="LayerList or a Hugging Face causal LM"):
        engine.layers(torch.nn.Linear(2, 2))

    class Odd(torch.nn.Module):
        config = object()
    with pytest.raises(ValueError, match=r"Odd: its config has no num_hidden_layers, so its blocks cannot be found"):
        engine.layers(Odd())


def reference_bf16(model_name: str) -> list[float]:
    """One process with bf16 weights under bf16 autocast, an fp32 master stepping on the widened gradient and
    narrowed back into the weights (as tests/test_precision.py's one_process_run): each step's loss."""
    from engine.training.loss import cross_entropy
    from engine.training.optim import make_optimizer
    ds = token_data()
    layers = as_layers(MODELS[model_name](seed=0)).to(torch.bfloat16)
    weights = list(layers.parameters())
    master = [p.detach().float() for p in weights]
    opt = make_optimizer(OptimConfig(**OPTIM), master)
    losses = []
    for step in range(STEPS):
        x, y = batch_for(ds, step, BATCH, SEED)
        for p in weights:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy(layers(x), y)
        loss.backward()
        losses.append(loss.item())
        for p, m in zip(weights, master):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(weights, master):
                p.copy_(m)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
def test_bf16_weights_on_a_hugging_face_model_equal_one_process_in_bf16(tmp_path):
    """precision.params = "bf16" on Mistral (a sliding window: its masks and rotary tables made in bf16 where
    its weights are) and GPT-2 (a tied embedding, bf16 on the pipeline's tie link): ddp, sharded and a
    migrating pipeline equal one process in bf16 within test_precision's tolerance (bf16's own noise, measured
    beside it)."""
    from tests.test_precision import TOLERANCE
    runs = train_in_a_script(tmp_path, ["mistral", "gpt2"], ["ddp", "sharded-gated-host", "pipeline-migrating"],
                             timeout_s=380, worlds={"ddp": [2]}, precision={"compute": "bf16", "params": "bf16"})
    failures = []
    for name in ("mistral", "gpt2"):
        bf16, fp32 = reference_bf16(name), reference(name)[1]
        noise = max(abs(a - b) for a, b in zip(bf16, fp32))
        assert noise > 1e-4, (name, noise)   # bf16 really moves the losses
        for run in (r for r in runs if r["model"] == name):
            gap = max(abs(a - b) for a, b in zip(run["losses"], bf16))
            print(f"{name} {run['label']}: gap {gap:.3g}, tolerance {TOLERANCE(noise):.3g} (bf16 against fp32: {noise:.3g})")
            if not (len(run["losses"]) == STEPS and gap <= TOLERANCE(noise)):
                failures.append(f"{name} {run['label']}: gap {gap:.3g} over {TOLERANCE(noise):.3g} (noise {noise:.3g})")
            if run["label"] == "pipeline-migrating" and "migration" not in run["events"]:
                failures.append(f"{name} {run['label']}: no migration")
    assert failures == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
def test_mixture_of_experts_models_under_data_parallel_equal_one_worker(tmp_path):
    """Mixtral and Qwen2-MoE in ddp and sharded at world 2, 64 experts and one per token: a rank's share sends
    no token to many of the experts, and their gradient there is zero (transformers keeps a block's experts
    in one tensor), so the sum over ranks is the one worker's gradient. A user's model with an expert per
    module (tests/user_models.py RoutedEmbedding) equals one worker in sharded as it is, and in ddp with
    parallel.ddp.find_unused_parameters (torch's DDP cannot do without: its buckets would wait for the gradient). Three steps: a top-1 router picks
    between experts that score alike to within a rounding, and the sum over two ranks rounds otherwise than one
    process's sum (1e-7), so over more steps a token can change experts and the runs part (seen: 1.5e-4 at the
    fourth step), in torch's DDP as here; the first steps show whether the gradients are summed right."""
    for name in ("mixtral", "qwen2-moe"):
        model = MODELS[name](seed=0)
        mlp = model.model.layers[0].mlp
        routed = []
        hook = mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[-1].flatten()))
        x, y = batch_for(token_data(), 0, BATCH, SEED, 0, 2)   # rank 0's share at step 0
        torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).backward()
        hook.remove()
        idle = torch.bincount(routed[0], minlength=mlp.experts.gate_up_proj.shape[0]) == 0
        assert idle.sum() > 10, (name, int(idle.sum()))
        grad = mlp.experts.gate_up_proj.grad
        assert grad is not None and not grad[idle].any() and grad[~idle].any()
    ds = token_data()   # the routed model of tests/user_models.py: a step where one rank runs its rare expert
    rare = [[bool((batch_for(ds, step, BATCH, SEED, rank, 2)[0][:, 0] == RARE).any()) for rank in (0, 1)]
            for step in range(MOE_STEPS)]
    assert all(a or b for a, b in rare) and any(a != b for a, b in rare), rare
    runs = train_in_a_script(tmp_path, ["mixtral", "qwen2-moe", "routed"], ["ddp", "sharded-gated-host"],
                             timeout_s=280, worlds={"ddp": [2]}, steps=MOE_STEPS, find_unused=["routed"])
    failures = []
    for name in ("mixtral", "qwen2-moe", "routed"):
        want_state, want_losses = reference(name, steps=MOE_STEPS)
        failures += [f"{name}: {f}" for f in check_runs([r for r in runs if r["model"] == name], want_state,
                                                        want_losses)]
    assert failures == []
