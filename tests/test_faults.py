"""Faults in the middle of the techniques' own moments (`[emulate] kill_rank, kill_at, kill_step`,
engine/runtime/emulate.py): the named rank SIGKILLs itself there, in the run's first attempt; the elastic
agent restarts the worker group from the last checkpoint, and the run goes on as if never interrupted: every
loss from the restart on and the final weights equal one process's.

    .venv/bin/python -m pytest -q tests/test_faults.py
"""

from __future__ import annotations

import signal

import pytest
import torch

from engine.config import EmulateConfig, load_config
from engine.config.rules import either
from engine.training.data import batch_for, load_dataset
from engine.models import build_model
from engine.runtime import emulate
from engine.runtime.checkpoint import list_checkpoints, model_state
from engine.runtime.emulate import Fault
from engine.strategies.specs import STRATEGIES
from tests.conftest import pid_alive, read_jsonl, train_one_process, wait_for
from tests.test_config import error_of
from tests.test_param_server import ps_args, run_pids
from tests.test_rebalance import MODEL_SETTINGS, SKEWED
from tests.test_training import DEMO

STEPS = 8
EVERY = 2   # checkpoint.every: a kill in step 4 or later restarts from a checkpoint, not from scratch


def one_process(overrides: list[str], steps: int) -> tuple[dict, list[float]]:
    """tests/test_training.py's single_process_reference, with each step's loss."""
    cfg = load_config(DEMO, overrides)
    ds = load_dataset(cfg.data, cfg.run.seed)
    batches = [batch_for(ds, step, cfg.data.batch_size, cfg.run.seed) for step in range(steps)]
    return train_one_process(build_model(cfg.model, ds.meta, cfg.run.seed), cfg.optim, batches)


def run_killed(cli, name: str, moment: str, overrides: list[str], *settings: str) -> tuple[list[dict], list[dict]]:
    """A run whose `emulate.kill_rank` dies at `moment`; checks the restart and that the run then equals one
    process on the same batches. Returns its records before and from the restart."""
    log = cli.tmp_path / f"{name}.jsonl"
    run_dir = cli.tmp_path / "runs" / name
    r = cli.run("run", DEMO, "--headless", *cli.base_args(name), *[a for o in overrides for a in ("--set", o)],
                "--set", f"run.steps={STEPS}", "--set", f"checkpoint.every={EVERY}", "--set", "run.eval_every=0",
                "--set", "parallel.max_restarts=1", "--set", f"emulate.kill_at={moment}", *settings,
                "--telemetry-log", str(log), timeout=100)
    assert r.returncode == 0, r.stderr
    assert f"kills itself at {moment}" in r.stderr, r.stderr
    records = read_jsonl(log)
    [restart] = [e for e in records if e.get("kind") == "restart"]
    before, after = records[:records.index(restart)], records[records.index(restart):]
    saved = [e["step"] for e in before if e.get("kind") == "checkpoint"]
    assert restart["restart"] == 1 and saved and restart["step"] == saved[-1], (restart, saved)
    assert records[-1]["type"] == "summary" and records[-1]["steps"] == STEPS and records[-1]["restarts"] == 1
    losses = {e["step"]: e["loss"] for e in after if e["type"] == "step"}
    assert sorted(losses) == list(range(restart["step"] + 1, STEPS + 1))
    want_state, want_losses = one_process(overrides, STEPS)
    assert [losses[s] for s in sorted(losses)] == pytest.approx(want_losses[restart["step"]:], abs=1e-5)
    got = model_state(list_checkpoints(run_dir)[-1])
    for key in want_state:
        torch.testing.assert_close(got[key], want_state[key], rtol=0, atol=1e-5, msg=key)
    wait_for(lambda: not any(pid_alive(p) for p in run_pids(run_dir)), 10, "every process of the run to be gone")
    return before, after


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("side, rank", [("source", 1), ("target", 0)])   # the layers move from stage 1 to 0
def test_a_pipeline_worker_killed_mid_migration_restarts_in_its_checkpoints_layout(cli, side, rank):
    before, after = run_killed(cli, f"mig-{side}", "migration", MODEL_SETTINGS,
                               # checkpoints written in the step (a background one is published a boundary
                               # or two later, racing the kill: test_a_rank_killed_mid_checkpoint covers that)
                               *SKEWED, "--set", "checkpoint.background=false",
                               "--set", "parallel.pipeline.rebalance_check_every=3", "--set",
                               f"emulate.kill_rank={rank}")
    assert [e for e in before if e.get("kind") == "rebalance"] and not [
        e for e in before if e.get("kind") == "migration"]   # decided, and killed before it completed
    stages = {e["step"]: [s["layers"] for s in e["stages"]] for e in before if e["type"] == "step"}
    first = next(e for e in after if e["type"] == "step")
    assert [s["layers"] for s in first["stages"]] == stages[after[0]["step"]]   # the checkpoint's layout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_owner_killed_mid_broadcast_restarts_from_its_checkpoint(cli):
    run_killed(cli, "bcast", "broadcast", ["parallel.strategy=sharded"], "--set", "emulate.kill_rank=1",
               "--set", "emulate.kill_step=3", "--set", "checkpoint.background=false")   # written in the step


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_killed_with_host_updates_queued_restarts_from_its_checkpoint(cli):
    run_killed(cli, "host", "host_update", ["update.placement=host"], "--set", "emulate.kill_rank=1",
               "--set", "emulate.kill_step=3", "--set", "checkpoint.background=false")   # written in the step


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_killed_mid_window_restarts_and_bsp_equals_one_process(cli):
    run_killed(cli, "window", "window", [], *ps_args(1, 2, "--set", "parallel.param_server.sync=bsp"),
               "--set", "emulate.kill_rank=0", "--set", "emulate.kill_step=3")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_checkpoint_restarts_from_the_one_before_and_leaves_no_staged_folder(cli):
    """Rank 1's writer dies once its file of the step-6 checkpoint is written, before the checkpoint is
    published: the run restarts from the last one published (step 2's, or step 4's once every rank's
    column of the boundary said it was written: engine/run/checkpointer.py), and the staged folder goes at
    the next checkpoint. (Step 2's is published by then: rank 1 waited for its write before step 4's.)"""
    before, _ = run_killed(cli, "midckpt", "checkpoint", [], "--set", "emulate.kill_rank=1",
                           "--set", "emulate.kill_step=5")
    assert [e["step"] for e in before if e.get("kind") == "checkpoint"] in ([2], [2, 4])
    assert not list((cli.tmp_path / "runs" / "midckpt" / "checkpoints").glob("*.tmp"))


# --- the fault itself, no processes ---------------------------------------------------------------

@pytest.fixture
def kills(monkeypatch):
    sent = []
    monkeypatch.setattr(emulate.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    yield sent
    Fault.install(EmulateConfig(), 0, 0)   # disarmed again


def test_only_the_named_rank_dies_at_its_moment_from_its_step_in_the_first_attempt(kills):
    settings = EmulateConfig(kill_rank=1, kill_at="broadcast", kill_step=3)
    assert Fault.install(settings, 0, 0) is None and Fault.install(settings, 1, 1) is None   # another rank; a restart
    emulate.reached("broadcast")
    fault = Fault.install(settings, 1, 0)
    fault.step = 2
    emulate.reached("broadcast")                    # before its step
    fault.step = 3
    emulate.reached("migration")                    # another moment
    emulate.reached("window", 7)
    assert kills == []
    emulate.reached("broadcast")
    assert kills == [(emulate.os.getpid(), signal.SIGKILL)]
    Fault.install(EmulateConfig(kill_rank=0, kill_at="window", kill_step=5), 0, 0)
    emulate.reached("window", 4)                    # a parameter server passes its global step
    emulate.reached("window", 5)
    assert len(kills) == 2


# the strategies that run the step loop, as the message offers them ("ddp", "sharded" or "pipeline")
STEPPING = either(name for name, spec in STRATEGIES.items() if not spec.loops)


@pytest.mark.parametrize("data, expected", [
    ({"emulate": {"kill_rank": 1, "kill_at": "migrate"}},
     'emulate.kill_at = "migrate": must be one of "migration", "broadcast", "host_update", "window", "step", '
     '"checkpoint" (did you mean "migration"?)'),
    ({"emulate": {"kill_rank": 0, "kill_at": "step"},
      "parallel": {"strategy": "param_server", "world_size": 3, "param_server": {"servers": 1, "workers": 2}}},
     f'emulate.kill_at = "step": needs the step loop of parallel.strategy = {STEPPING} (got "param_server")'),
    ({"emulate": {"kill_rank": 2, "kill_at": "broadcast"}, "parallel": {"strategy": "sharded"}},
     "emulate.kill_rank = 2: no such rank; parallel.world_size = 2 has ranks 0 to 1"),
    ({"emulate": {"kill_rank": 1}},
     'emulate.kill_at = "migration": needs parallel.strategy = "pipeline" with parallel.pipeline.rebalance = "auto" or '
     '"manual", where layers migrate (got parallel.strategy = "ddp", parallel.pipeline.rebalance = "auto")'),
    ({"emulate": {"kill_rank": 1, "kill_at": "broadcast"}},
     'emulate.kill_at = "broadcast": needs parallel.strategy = "sharded", whose broadcast it is (got "ddp")'),
    ({"emulate": {"kill_rank": 1, "kill_at": "host_update"}, "update": {"placement": {"fc0": "device"}}},
     'emulate.kill_at = "host_update": needs update.placement = "host", "auto" or a table naming "host" '
     '(got {fc0 = "device"})'),
    ({"emulate": {"kill_rank": 0, "kill_at": "window"},
      "parallel": {"strategy": "param_server", "world_size": 3,
                   "param_server": {"servers": 1, "workers": 2, "sync": "asp"}}},
     'emulate.kill_at = "window": needs parallel.strategy = "param_server" with parallel.param_server.sync = "soft" or "bsp" '
     '(got parallel.strategy = "param_server", parallel.param_server.sync = "asp")'),
    ({"emulate": {"kill_rank": 2, "kill_at": "window"},
      "parallel": {"strategy": "param_server", "world_size": 3, "param_server": {"servers": 1, "workers": 2}}},
     "emulate.kill_at = \"window\": emulate.kill_rank = 2 is a worker; the windows are the servers' (rank 0)"),
])
def test_a_fault_without_its_moment_or_rank_is_refused_by_name(data, expected):
    assert error_of(data) == expected
