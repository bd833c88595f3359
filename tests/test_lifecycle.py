"""A run's life and death: worker killed and restarted, Ctrl-C, damaged checkpoints."""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from engine.runtime.checkpoint import list_checkpoints, model_state, verify
from tests.conftest import CLI, ROOT, fill_disk, pid_alive, read_jsonl, wait_for
from tests.test_training import single_process_reference

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


def steps_logged(log) -> int:
    if not log.exists():
        return 0
    return max((r["step"] for r in read_jsonl(log) if r["type"] == "step"), default=0)


def read_pid(run_dir, who: str) -> int | None:
    path = run_dir / "pids" / f"{who}.pid"
    return int(path.read_text()) if path.exists() and path.read_text() else None


@pytest.mark.timeout(150)
# slow: the elastic restart is also tested through a pipeline run (tests/test_rebalance.py: SIGKILL, restart
# from the last checkpoint, parameters equal to one process), which `pytest -m 'not slow'` keeps
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "sharded"])
def test_a_worker_killed_by_sigkill_is_restarted_and_the_run_completes(cli, strategy):
    log = cli.tmp_path / "run.jsonl"
    run_dir = cli.tmp_path / "runs" / "killed"
    paced = ["--set", "run.step_pause_ms=40", "--set", "checkpoint.every=10", "--set", "parallel.max_restarts=2",
             "--set", f"parallel.strategy={strategy}"]
    proc = cli.start("run", DEMO, "--headless", "--steps", "60", *cli.base_args("killed"), *paced,
                     "--telemetry-log", str(log))
    wait_for(lambda: steps_logged(log) >= 15, 60, "step 15")
    victim = read_pid(run_dir, "rank1")
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err

    records = read_jsonl(log)
    restarts = [r for r in records if r.get("kind") == "restart"]
    assert restarts and restarts[0]["step"] in (10, 20)     # resumed from a checkpoint, not from scratch
    assert records[-1]["type"] == "summary" and records[-1]["steps"] == 60
    assert records[-1]["restarts"] == 1
    assert read_pid(run_dir, "rank1") != victim
    assert "restart 1 of 2" in out
    # the restarted run continued exactly: the result equals one uninterrupted computation
    got = model_state(list_checkpoints(run_dir)[-1])
    want = single_process_reference([], 60)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_every_process_with_a_final_checkpoint(cli, sig):
    log = cli.tmp_path / "run.jsonl"
    run_dir = cli.tmp_path / "runs" / "interrupted"
    proc = cli.start("run", DEMO, "--headless", "--steps", "100000", *cli.base_args("interrupted"),
                     "--set", "run.step_pause_ms=20", "--telemetry-log", str(log))
    wait_for(lambda: steps_logged(log) >= 5, 40, "step 5")
    pids = [read_pid(run_dir, who) for who in ("launcher", "rank0", "rank1")]
    assert pids[0] == proc.pid and all(pids)
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within 10 s of {sig.name}")
    assert proc.returncode == 128 + sig
    wait_for(lambda: not any(pid_alive(p) for p in pids), 2, "every process of the run to be gone")
    final = list_checkpoints(run_dir)[-1]
    manifest = verify(final)
    assert manifest["step"] >= 5
    stops = [r for r in read_jsonl(log) if r.get("kind") == "stop"]
    assert stops and stops[0]["step"] == manifest["step"]


@pytest.fixture(scope="module")
def finished_template(tmp_path_factory):
    """One finished 10-step run for the module; each test gets its own copy."""
    root = tmp_path_factory.mktemp("finished")
    runtime = Path(tempfile.mkdtemp(prefix="ty", dir="/tmp"))
    runner = CLI(root, runtime)
    try:
        result = runner.run("run", DEMO, "--headless", "--steps", "10", *runner.base_args("done"),
                            "--set", "checkpoint.every=5")
    finally:
        runner.reap()
        shutil.rmtree(runtime, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    return root / "runs" / "done"


@pytest.fixture
def finished_run(cli, finished_template):
    target = cli.tmp_path / "runs" / "done"
    shutil.copytree(finished_template, target)
    return target


@pytest.mark.timeout(90)
def test_damaged_checkpoints_are_refused_naming_the_file(cli, finished_run):
    latest = list_checkpoints(finished_run)[-1]

    def resume():
        return cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("done"),
                       "--resume", str(finished_run), timeout=30)

    model = latest / "rank0.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    r = resume()
    assert r.returncode == 2
    assert str(model) in r.stderr and "corrupted" in r.stderr
    previous = list_checkpoints(finished_run)[-2]   # the run's earlier checkpoint, whole: offered instead
    assert f"The previous checkpoint verifies (step 5): resume from it with --resume {previous}" in r.stderr

    model.write_bytes(bytes(data[: len(data) // 3]))
    r = resume()
    assert r.returncode == 2 and "truncated" in r.stderr

    (latest / "manifest.json").unlink()
    r = cli.run("run", DEMO, "--headless", "--resume", str(latest), *cli.base_args("done"), timeout=30)
    assert r.returncode == 2 and "manifest.json" in r.stderr and "incomplete" in r.stderr


@pytest.mark.timeout(60)
def test_a_run_directory_with_checkpoints_is_not_overwritten_silently(cli, finished_run):
    r = cli.run("run", DEMO, "--headless", *cli.base_args("done"), timeout=30)
    assert r.returncode == 2
    assert "already holds checkpoints" in r.stderr and "--resume" in r.stderr
    assert list_checkpoints(finished_run)   # nothing was deleted


@pytest.mark.timeout(60)
def test_what_cannot_carry_over_is_refused_by_name_before_any_worker_starts(cli, finished_run):
    """Another world size or strategy is no reason to refuse (tests/test_resume.py); another kind of optimizer
    is, and so is a checkpoint in the format of before 2026-11-26, naming its format and what to do."""
    latest = list_checkpoints(finished_run)[-1]
    r = cli.run("run", DEMO, "--headless", *cli.base_args("done"), "--set", "optim.name=adamw",
                "--resume", str(finished_run), timeout=30)
    assert r.returncode == 2
    assert "its optimizer state is 'sgd''s; this run has optim.name = 'adamw'" in r.stderr
    manifest = json.loads((latest / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k != "manifest_sha256"}   # format 1 had no checksum of its own
    (latest / "manifest.json").write_text(json.dumps({**old, "format": 1}))
    r = cli.run("run", DEMO, "--headless", *cli.base_args("done"), "--resume", str(latest), timeout=30)
    assert r.returncode == 2
    assert "written in trainyard's checkpoint format 1" in r.stderr and "trainyard export" in r.stderr


@pytest.mark.timeout(120)
def test_a_hung_peer_becomes_an_error_within_the_collective_timeout(cli):
    log = cli.tmp_path / "run.jsonl"
    run_dir = cli.tmp_path / "runs" / "hung"
    proc = cli.start("run", DEMO, "--headless", "--steps", "100000", *cli.base_args("hung"),
                     "--set", "run.step_pause_ms=20", "--set", "parallel.collective_timeout_s=3",
                     "--set", "parallel.max_restarts=0", "--telemetry-log", str(log))
    wait_for(lambda: steps_logged(log) >= 3, 40, "step 3")
    pids = [read_pid(run_dir, who) for who in ("rank0", "rank1")]
    os.kill(pids[1], signal.SIGSTOP)          # alive but silent: only a timeout can notice
    # the collective times out after 3 s and rank 0 fails; then the peer wakes, and the agent's SIGTERM
    # ends it (left stopped, it would get torch's fixed 30 s grace before SIGKILL: the same end, later)
    wait_for(lambda: not pid_alive(pids[0]), 30, "rank 0 to fail on the timeout")
    os.kill(pids[1], signal.SIGCONT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a hung peer hung the run")
    assert proc.returncode == 1
    assert "run failed: worker rank 0" in err and "Timed out" in err and "parallel.max_restarts" in err
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5, "the workers to be gone")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "param_server"])
def test_a_full_disk_stops_the_run_and_the_previous_checkpoint_resumes_it(cli, tmp_path, strategy):
    """run.dir on a small tmpfs, filled once the step-10 checkpoint is published: the step-20 checkpoint cannot
    be written, every rank stops with an error that says so and names the checkpoint to resume from; nothing
    half-written is left, and `--resume` takes the step-10 checkpoint once there is room again. On a parameter
    server each server writes its own layers' file and says in its answer whether it could."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        run_dir = disk / "full"
        args = ["run", DEMO, "--headless", *cli.base_args("full"), "--set", f"run.dir={disk}", "--set",
                "checkpoint.every=10", "--set", "run.eval_every=0", "--set", "parallel.max_restarts=1"]
        if strategy == "param_server":
            args += [a for o in ("parallel.strategy=param_server", "parallel.world_size=4", "parallel.param_server.servers=2",
                                 "parallel.param_server.workers=2", "parallel.param_server.sync=bsp") for a in ("--set", o)]
        proc = cli.start(*args, "--steps", "40", "--set", "run.step_pause_ms=60",
                         "--telemetry-log", str(tmp_path / "full.jsonl"))
        wait_for(lambda: [c.name for c in list_checkpoints(run_dir)] == ["step_000010"], 60, "the first checkpoint")
        filler = fill_disk(disk)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 2, err
        first = list_checkpoints(run_dir)[0]
        assert f"the checkpoint of step 20 could not be written in {run_dir / 'checkpoints'}: No space left on device" in err
        assert f"; the previous checkpoint, {first}, is whole: resume from it with --resume {run_dir}" in err
        assert [c.name for c in list_checkpoints(run_dir)] == ["step_000010"]
        assert not list((run_dir / "checkpoints").glob("*.tmp"))   # nothing half-written left
        filler.unlink()
        r = cli.run(*args, "--steps", "15", "--resume", str(run_dir), timeout=60)
        assert r.returncode == 0, r.stderr
        assert [c.name for c in list_checkpoints(run_dir)] == ["step_000010", "step_000015"]
    finally:
        cli.reap()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_every_restart_of_the_worker_group_is_counted_into_the_next_starts_job(capsys, tmp_path):
    """torch counts a failure's restart (TORCHELASTIC_RESTART_COUNT) but not one for a host that joins; the
    launcher counts both in job.generation, which the next start's pickled Job carries (meet takes the largest),
    and says which it was. A restart for a joining host is marked for the workers (rank.restart_marker) before
    the agent signals them; a failure's is not."""
    import logging
    import pickle

    from engine.config import load_config
    from engine.run.launch import _RestartReporter
    from engine.run.rank import Job, restart_marked
    from tests.test_training import DEMO
    job = Job(config=load_config(DEMO, ["cluster.nnodes=2", "cluster.rdzv_endpoint=127.0.0.1:29400",
                                        f"run.dir={tmp_path}"]))
    reporter = _RestartReporter(job)

    def say(text: str) -> None:
        reporter.emit(logging.LogRecord("torch", logging.INFO, __file__, 0, text, None, None))
    say("[default] Worker group FAILED. 1/2 attempts left; will restart worker group")
    assert restart_marked(job.config.run_dir, 0) == -1
    say("[default] Detected 1 new nodes from group_rank=0; will restart worker group")
    assert restart_marked(job.config.run_dir, 0) == 2
    say("[default] Rendezvous complete")
    assert job.generation == 2 and pickle.loads(pickle.dumps(job)).generation == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["trainyard: host 0: a worker failed; restarting the worker group from the last checkpoint "
                   "(1 of 2 restarts left); waiting for all 2 hosts at the rendezvous",
                   "trainyard: host 0: a host is waiting to join; restarting the worker group from the last "
                   "checkpoint; waiting for all 2 hosts at the rendezvous"]


@pytest.mark.parametrize("hosts,error", [
    ([0, 0, 2, 2], None),
    ([0, 0, 2, 1], "numbered the ranks over hosts [0, 0, 2, 1] (by rank), not in host order"),
    ([0, 0, 1, 1, 1, 1], "host number(s) 1 joined the run from two hosts: every host needs its own --node-rank"),
])
def test_meet_checks_that_the_ranks_follow_the_host_numbers(monkeypatch, hosts, error):
    """Every rank's host number, gathered at start: the hosts there in host order, each once (2 ranks a host
    here), which then name every rank's host (run_start's `hosts`)."""
    from engine.run import rank as rank_module
    from engine.runtime.topology import Topology
    topo = Topology(rank=0, world_size=len(hosts), local_rank=0, local_world_size=2, backend="gloo", timeout_s=5)

    def gather(into, mine, group=None):
        into[:] = [(3 if r == 1 else 0, f"dev{r}", host) for r, host in enumerate(hosts)]
    monkeypatch.setattr(rank_module.dist, "all_gather_object", gather)
    if error:
        with pytest.raises(RuntimeError, match=re.escape(error)):
            rank_module.meet(topo, "dev0", 1, 0)
        return
    assert rank_module.meet(topo, "dev0", 1, 0) == (3, ["dev0", "dev1", "dev2", "dev3"])
    assert topo.hosts() == [0, 0, 2, 2]
