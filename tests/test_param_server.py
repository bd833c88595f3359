"""Parameter-server runs through the CLI: bsp equals synchronous data parallel, soft converges with a slow
worker, a dead worker does not stop the servers, a dead server restarts the run from its checkpoint."""

from __future__ import annotations

import os
import signal

import jsonschema
import pytest

from engine import protocol
from engine.telemetry.schema import RECORD_SCHEMA
from tests.conftest import ROOT, pid_alive, read_jsonl, wait_for
from tests.test_training import final_model, single_process_reference

DEMO = str(ROOT / "demo" / "configs" / "digits_ps.toml")


def ps_args(servers: int, workers: int, *extra: str) -> list[str]:
    return ["--set", "parallel.strategy=param_server", "--set", f"parallel.world_size={servers + workers}",
            "--set", f"parallel.param_server.servers={servers}", "--set", f"parallel.param_server.workers={workers}",
            "--set", "parallel.param_server.slow_workers={}", *extra]


def run_pids(run_dir) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")]


@pytest.mark.timeout(120)
def test_bsp_equals_synchronous_data_parallel(cli):
    """2 servers, 2 workers, every layer waits for both: the same weights as one process on the whole batch."""
    steps = 6
    overrides = ["run.steps=6", "checkpoint.every=3"]
    log = cli.tmp_path / "bsp.jsonl"
    result = cli.run("run", str(ROOT / "demo" / "configs" / "digits_ddp.toml"), "--headless", *cli.base_args("bsp"),
                     *ps_args(2, 2, "--set", "parallel.param_server.sync=bsp"), *[a for o in overrides for a in ("--set", o)],
                     "--telemetry-log", str(log), timeout=100)
    assert result.returncode == 0, result.stderr
    records = read_jsonl(log)
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in records:
        validator.validate(record)
    assert records[-1]["type"] == "summary" and records[-1]["steps"] == steps
    assert [r["path"].rsplit("_", 1)[-1] for r in records if r.get("kind") == "checkpoint"] == ["000003", "000006"]
    reference = single_process_reference(overrides, steps)
    state = final_model(cli.tmp_path / "runs" / "bsp")
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert (state[key] - value).abs().max().item() <= 1e-5, key
    steps_logged = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps_logged] == list(range(1, steps + 1))
    assert all(r["ps"]["loss_workers"] == 2 for r in steps_logged)   # each loss is the whole global batch's
    last = steps_logged[-1]
    assert last["ps"]["mode"] == "bsp"
    reported = [layer for layer in last["ps"]["layers"] if layer["version"]]   # server 1's figures may lag
    assert reported and all(layer["window_workers"] == 2 and layer["mean_staleness"] == 0 for layer in reported)
    # the servers' tally: each update both workers' gradients, none stale, a full step's worth applied
    for layer in reported:
        assert layer["gradients"] == 2 * layer["windows"] == 2 * layer["version"], layer
        assert layer["staleness_sum"] == layer["staleness_max"] == 0 and layer["applied"] == layer["windows"], layer
    assert [r["role"] for r in last["ranks"]] == ["server", "server", "worker", "worker"]


@pytest.mark.timeout(150)
def test_soft_converges_with_a_worker_three_times_slower(cli):
    log = cli.tmp_path / "soft.jsonl"
    result = cli.run("run", DEMO, "--headless", *cli.base_args("soft"),
                     *ps_args(1, 2, "--set", "parallel.param_server.slow_workers={2 = 3.0}"), "--set", "run.steps=200",
                     "--set", "checkpoint.every=0", "--set", "run.eval_every=0", "--telemetry-log", str(log),
                     timeout=140)
    assert result.returncode == 0, result.stderr
    records = read_jsonl(log)
    summary = records[-1]
    assert summary["test_accuracy"] >= 0.93 and summary["sync"] == "soft"
    profile = next(r for r in records if r.get("kind") == "ps_profile")
    # the slow worker's measured slack is the longer one, for every layer after the first
    for layer in profile["layers"][1:]:
        assert layer["window_ms"]["2"] > layer["window_ms"]["1"]
    workers = {w["rank"]: w for w in [r for r in records if r["type"] == "step"][-1]["ps"]["workers"]}
    assert workers[2]["slow_factor"] == 3.0 and workers[2]["iterations"] < workers[1]["iterations"]


def start_paced(cli, name: str, log, *args: str):
    """An 80-step parameter-server run in the background, paced so a test can act on it mid-run."""
    return cli.start("run", DEMO, "--headless", *cli.base_args(name), *args, "--set", "run.steps=80",
                     "--set", "run.step_pause_ms=20", "--set", "run.eval_every=0", "--telemetry-log", str(log))


@pytest.mark.timeout(150)
def test_a_dead_worker_does_not_stop_the_servers_and_sync_changes_live(cli):
    name = "pskill"
    log = cli.tmp_path / "kill.jsonl"
    proc = start_paced(cli, name, log, *ps_args(1, 2), "--set", "checkpoint.every=0")
    run_dir = cli.tmp_path / "runs" / name
    wait_for(lambda: any(r["name"] == name for r in protocol.list_runs()), 60, "the run on its socket")
    result = cli.run("ctl", name, "set-sync", "asp", timeout=30)
    assert result.returncode == 0 and "applied" in result.stdout, result.stdout + result.stderr
    wait_for(lambda: any(r.get("kind") == "ps_profile" for r in read_jsonl(log)), 60, "the sync profile")
    victim = int((run_dir / "pids" / "rank2.pid").read_text())
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "worker rank 2 was killed by SIGKILL; the servers go on without it" in err
    records = read_jsonl(log)
    lost = [r for r in records if r.get("kind") == "worker_lost"]
    assert len(lost) == 1 and lost[0]["rank"] == 2 and "process ended" in lost[0]["reason"]
    changed = next(r for r in records if r.get("kind") == "sync_mode")
    assert changed["mode"] == "asp" and changed["previous"] == "soft" and changed["source"] == "command"
    steps = [r for r in records if r["type"] == "step"]
    assert steps[-1]["ps"]["mode"] == "asp" and steps[-1]["ps"]["workers_lost"] == [2]
    summary = records[-1]
    assert summary["steps"] == 80 and summary["workers_lost"] == [2] and not summary["stopped_early"]
    wait_for(lambda: not any(pid_alive(p) for p in run_pids(run_dir)), 10, "every process of the run to be gone")


@pytest.mark.slow   # a whole restart: about a minute here; the restart path is shared with every mode
@pytest.mark.timeout(200)
def test_a_dead_server_restarts_the_run_from_its_last_checkpoint(cli):
    name = "psrestart"
    log = cli.tmp_path / "restart.jsonl"
    proc = start_paced(cli, name, log, *ps_args(2, 1), "--set", "checkpoint.every=10",
                       "--set", "parallel.max_restarts=1")
    run_dir = cli.tmp_path / "runs" / name
    wait_for(lambda: any(r.get("kind") == "checkpoint" for r in read_jsonl(log)) if log.exists() else False,
             90, "a first checkpoint")
    os.kill(int((run_dir / "pids" / "rank1.pid").read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err
    records = read_jsonl(log)
    restart = next(r for r in records if r.get("kind") == "restart")
    resumed = next(r for r in records if r.get("kind") == "resume")
    assert restart["restart"] == 1 and resumed["step"] >= 10 and resumed["step"] % 10 == 0
    assert records[-1]["steps"] == 80 and records[-1]["restarts"] == 1
    wait_for(lambda: not any(pid_alive(p) for p in run_pids(run_dir)), 10, "every process of the run to be gone")


def test_a_steps_loss_is_the_mean_of_its_iteration_once_every_live_worker_sent_it():
    from engine.strategies.param_server.losses import StepLosses
    book = StepLosses()
    book.add(0, 2, 4.0)                                   # worker 2's loss of iteration 0 (step 1)
    assert book.of_step(1, {2, 3}, global_step=1) is None   # worker 3's share is still on its way
    book.add(0, 3, 5.0)
    assert book.of_step(1, {2, 3}, global_step=1) == (4.5, 2)   # the global batch's mean
    book.add(1, 2, 3.0)                                   # step 2: worker 3 is slow (asp, soft)
    assert book.of_step(2, {2, 3}, global_step=2) is None
    assert book.of_step(2, {2, 3}, global_step=3) == (3.0, 1)   # step 3 is done: no more waiting
    assert book.of_step(2, {2}, global_step=2) == (3.0, 1)      # worker 3 was lost
    assert book.of_step(3, {2, 3}, global_step=5, final=True) is None   # nothing ever came for it
    book.forget_before(1)   # step 1's record is written: iteration 0's losses go
    assert sorted(book.by_iteration) == [1]
