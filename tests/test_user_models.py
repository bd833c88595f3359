"""A user's own model through `engine.train`: every strategy equals one worker on models the project did
not define (torch's nn.TransformerEncoderLayer, GPT-2 blocks from transformers), no worker shares the
caller's memory, and the caller's model holds the run's final weights when `train` returns."""

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
from tests.user_models import BLOCKS, MODELS, token_data

STEPS, BATCH, SEED = 8, 32, 0
OPTIM = {"name": "adamw", "lr": 3e-3}
BLOCK_NAMES = [f"block{i}" for i in range(BLOCKS)]
STRATEGIES = {
    "ddp": {"parallel": {"strategy": "ddp"}},
    "ddp-host": {"parallel": {"strategy": "ddp"}, "update": {"placement": "host"}},
    "sharded-gated": {"parallel": {"strategy": "sharded", "overlap_forward": True}},
    # a skewed start that the last stage rebalances at step 2: layers migrate while training runs
    "pipeline-migrating": {"parallel": {"strategy": "pipeline", "partition": [["embed"], [*BLOCK_NAMES, "norm", "head"]],
                                        "rebalance": "auto", "rebalance_check_every": 2}},
    "param_server-bsp": {"parallel": {"strategy": "param_server", "servers": 1, "workers": 2, "sync": "bsp",
                                      "slow_workers": {}}},
}
WORLDS = {"ddp": [1, 2], "param_server-bsp": [3]}
# GPT-2 blocks: data parallel and a pipeline whose layers migrate. Each worker imports transformers (about 4 s
# here), so the other strategies, whose code paths do not depend on which blocks a model is made of, run
# on the encoder alone.
GPT2_STRATEGIES = ("ddp", "pipeline-migrating")


def reference(model_name: str) -> tuple[dict, list[float]]:
    """One process, one AdamW step per whole global batch: what every strategy must equal."""
    ds = token_data()
    batches = [batch_for(ds, step, BATCH, SEED) for step in range(STEPS)]
    return train_one_process(MODELS[model_name](seed=0), OptimConfig(**OPTIM), batches)


def train_in_a_script(tmp_path, model_name: str, config: dict, worlds: list[int]) -> list[dict]:
    """tests/user_model_run.py in a process session of its own, reaped whatever happens."""
    spec = {"model": model_name, "worlds": worlds,
            "config": {"run": {"name": "user", "steps": STEPS, "seed": SEED, "dir": str(tmp_path / "runs")},
                       "data": {"batch_size": BATCH}, "optim": OPTIM, "telemetry": {"hub": False}, **config}}
    out = tmp_path / "results.pt"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "user_model_run.py"), str(out), json.dumps(spec)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        _, err = proc.communicate()
        pytest.fail(f"the run did not finish in 150 s\n{err}")
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


def _cases():
    for model_name in MODELS:
        for strategy in STRATEGIES:
            marks = [] if (model_name, strategy) == ("encoder", "ddp") else [pytest.mark.slow]
            if model_name == "gpt2":
                if strategy not in GPT2_STRATEGIES:
                    continue
                marks.append(pytest.mark.skipif(not _has_transformers(), reason="transformers is not installed"))
            yield pytest.param(model_name, strategy, marks=marks, id=f"{model_name}-{strategy}")


def _has_transformers() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformers") is not None


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model_name,strategy", list(_cases()))
def test_every_strategy_equals_one_worker_on_a_users_model(tmp_path, model_name, strategy):
    want_state, want_losses = reference(model_name)
    runs = train_in_a_script(tmp_path, model_name, STRATEGIES[strategy], WORLDS.get(strategy, [2]))
    for run in runs:
        where = f"{strategy} at world {run['world']}"
        assert len(run["losses"]) == STEPS, where
        assert run["losses"] == pytest.approx(want_losses, abs=1e-5), where
        assert_states_equal(run["checkpoint"], want_state)
        # the caller's model holds the run's final weights, exactly the final checkpoint's
        assert_states_equal(run["caller"], run["checkpoint"], atol=0)
        assert not any(name.startswith("user_model") for name in run["left_in_run_dir"]), run["left_in_run_dir"]
    if strategy == "pipeline-migrating":
        assert "migration" in runs[0]["events"], runs[0]["events"]
    if len(runs) == 2:   # world 2 leaves the caller's model as a run at world 1 does
        assert_states_equal(runs[1]["caller"], runs[0]["caller"])


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
