"""A user's own model through `engine.train`: every strategy equals one worker on models the project did
not define (torch's nn.TransformerEncoderLayer wrapped by hand; GPT-2 and Llama from transformers, as they
are), no worker shares the caller's memory, and the caller's model holds the run's final weights when `train`
returns."""

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
from engine.data import batch_for
from engine.runtime.handover import HandoverError, hand_over, load_final_weights, received_model
from engine.runtime.rank import Job
from tests.conftest import ROOT, train_one_process
from tests.user_models import BLOCKS, MODELS, SEQ_LEN, VOCAB, as_layers, masked_token_data, token_data

STEPS, BATCH, SEED = 8, 32, 0
OPTIM = {"name": "adamw", "lr": 3e-3}
BLOCK_NAMES = [f"block{i}" for i in range(BLOCKS)]
STRATEGIES = {
    "ddp": {"parallel": {"strategy": "ddp"}},
    "ddp-host": {"parallel": {"strategy": "ddp"}, "update": {"placement": "host"}},
    "sharded-gated-host": {"parallel": {"strategy": "sharded", "overlap_forward": True},
                           "update": {"placement": "host"}},
    # a skewed start that the last stage rebalances at step 2: layers migrate while training runs, their
    # activations swapped to the host or recomputed in backward
    "pipeline-migrating": {"parallel": {"strategy": "pipeline", "partition": [["embed"], [*BLOCK_NAMES, "norm", "head"]],
                                        "rebalance": "auto", "rebalance_check_every": 2},
                           "memory": {"policy": {"block0": "swap", "block1": "recompute", "block3": "swap",
                                                 "head": "recompute"}}},
    "param_server-bsp": {"parallel": {"strategy": "param_server", "servers": 1, "workers": 2, "sync": "bsp",
                                      "slow_workers": {}}},
}
WORLDS = {"ddp": [1, 2], "param_server-bsp": [3]}


def reference(model_name: str, data: str = "tokens") -> tuple[dict, list[float]]:
    """One process, one AdamW step per whole global batch: what every strategy must equal."""
    ds = masked_token_data() if data == "masked" else token_data()
    batches = [batch_for(ds, step, BATCH, SEED) for step in range(STEPS)]
    return train_one_process(as_layers(MODELS[model_name](seed=0)), OptimConfig(**OPTIM), batches)


def train_in_a_script(tmp_path, model_name: str, strategies: list[str], timeout_s: float = 150,
                      data: str = "tokens") -> list[dict]:
    """tests/user_model_run.py in a process session of its own, reaped whatever happens: each strategy at each
    of its world sizes, one after the other in one process (as a user's script would; transformers is
    imported once, and the workers fork from a server that has it)."""
    runs = [{"label": strategy, "world": world,
             "config": {"run": {"name": f"user-{strategy}", "steps": STEPS, "seed": SEED,
                                "dir": str(tmp_path / "runs")},
                        "data": {"batch_size": BATCH}, "optim": OPTIM, "telemetry": {"hub": False},
                        **STRATEGIES[strategy]}}
            for strategy in strategies for world in WORLDS.get(strategy, [2])]
    out = tmp_path / "results.pt"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "user_model_run.py"), str(out),
                             json.dumps({"model": model_name, "runs": runs, "data": data})],
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
            assert len(run["losses"]) == STEPS
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
@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_every_strategy_equals_one_worker_on_a_hugging_face_model_as_it_is(tmp_path, model_name):
    """GPT-2 (tied input and output embeddings) and Llama (rotary, grouped-query attention), passed to
    engine.train as transformers builds them."""
    want_state, want_losses = reference(model_name)
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
    with pytest.raises(ValueError, match=r"looked for GPT-2's modules \(transformer.wte"):
        engine.layers(Odd())


@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
def test_a_model_whose_forward_does_more_than_its_layout_is_refused_not_trained_wrong():
    import engine
    hf = MODELS["gpt2"](seed=0)
    forward = hf.forward

    def scaled(*args, **kwargs):   # a logit scale, as some families add: the layers alone cannot know it
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out
    hf.forward = scaled
    with pytest.raises(ValueError, match="computes something else .*logits differ"):
        engine.layers(hf)


@pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed (pip install -e '.[hf]')")
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen2-tied"])
def test_the_llama_family_is_taken_as_it_is(family):
    """Mistral and Qwen2 are built as Llama is: engine.layers takes them, its own check of the logits passes,
    and a tied Qwen2 declares its tie."""
    import transformers

    import engine
    kind = family.split("-")[0]
    config_class = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_class = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                          tie_word_embeddings=family.endswith("tied"), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = model_class(config)
    layers = engine.layers(hf)   # raises if its logits differ from the model's
    assert layers.names == ["embed", "block0", "block1", "norm", "head"]
    assert layers.ties == ([[("embed", "weight"), ("head", "weight")]] if family.endswith("tied") else [])
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN))
    hf.eval()
    torch.testing.assert_close(layers(ids), hf(ids).logits, rtol=0, atol=1e-5)
