"""The fault suite: what a long job meets, each case ending in a correct run or a named error, and never in a
process left behind or a temp file left over.

    .venv/bin/python -m pytest -q tests/test_fault_suite.py

Every process of a run carries its run folder in its environment (TRAINYARD_RUN: engine/processes/lifeline.py
mark_run), so the suite finds them among all processes, an orphan whose parent is init included. The cases:
- the launcher SIGKILLed, agent and all (`emulate.kill_how = "launcher"`: a rank kills it at a moment of its
  own: the start of a step, the middle of a checkpoint, the middle of a migration): every process is gone
  within parallel.shutdown_timeout_s + 5 s, and a resume from the run's last checkpoint trains on with the
  losses and weights of one process that never stopped;
- the hub's rank SIGKILLed at a seeded step, and the fork server SIGKILLed: restarted, equal to one process;
- an error that would recur (an IndexError in a rank): no restart, exit 1 naming the rank and the step;
- two runs of one name: the second is refused by name, with or without run.overwrite, the first untouched;
- a full disk under the telemetry log and under the launcher's own files: a named error, whole lines only;
- a NaN loss: strict JSON in the log, said once as an event.
The other faults have their own tests: a full disk at a checkpoint (tests/test_lifecycle.py), at an export
(tests/test_export.py), one byte flipped in each file a resume reads (tests/test_checkpoint.py), a rank killed
mid-migration, mid-broadcast, mid-host-update and mid-window (tests/test_faults.py), token ids past the
vocabulary (tests/test_tokens.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from engine.processes.lifeline import MARK
from engine.run.claim import Claim, live
from engine.run.checks import RunSetupError
from engine.runtime.checkpoint import list_checkpoints, model_state
from tests.conftest import Told, fill_disk, read_jsonl, wait_for
from tests.test_faults import one_process
from tests.test_lifecycle import DEMO, steps_logged
from tests.test_rebalance import MODEL_SETTINGS, SKEWED

STEPS = 10
EVERY = 3             # checkpoint.every
SHUTDOWN_S = 5        # parallel.shutdown_timeout_s (the default)
# every run's processes carry its mark from their start (found by it), its fork server one of them
pytestmark = pytest.mark.own_fork_server
SEED = 20261126       # the steps at which faults strike are drawn from it


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose environment names `run_dir` as its run (zombies are gone for our purposes)."""
    mark, found = os.path.abspath(run_dir), []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def leftovers(run_dir: Path, runtime_dir: Path) -> list[Path]:
    """Temp files a run may leave: staged checkpoints, partial files, the fork server's folder, refusal files."""
    found = [p for p in Path(run_dir).rglob("*") if p.name.endswith((".tmp", ".partial"))]
    found += [p for p in runtime_dir.iterdir() if p.name.startswith(("forkserver-", "refusal-"))]
    return found


def assert_all_gone(run_dir: Path, runtime_dir: Path, within_s: float = SHUTDOWN_S + 5) -> None:
    wait_for(lambda: not run_processes(run_dir), within_s, f"every process of {run_dir.name} to be gone")
    deadline = time.monotonic() + 5
    while leftovers(run_dir, runtime_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers(run_dir, runtime_dir), f"temp files of {run_dir.name} left"


def step_losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(log) if r["type"] == "step"}


def assert_resumes_as_one_process(cli, name: str, overrides: list[str], *settings: str) -> None:
    """`--resume` the run from its last checkpoint to STEPS: every later loss and the final weights equal one
    process's that never stopped."""
    run_dir = cli.tmp_path / "runs" / name
    resumed_at = int(json.loads((list_checkpoints(run_dir)[-1] / "manifest.json").read_text())["step"])
    log = cli.tmp_path / f"{name}-resumed.jsonl"
    r = cli.run("run", DEMO, "--headless", *cli.base_args(name), *[a for o in overrides for a in ("--set", o)],
                *settings, "--set", f"run.steps={STEPS}", "--set", "run.eval_every=0", "--resume", str(run_dir),
                "--telemetry-log", str(log), timeout=90)
    assert r.returncode == 0, r.stderr
    want_state, want_losses = one_process(overrides, STEPS)
    losses = step_losses(log)
    assert sorted(losses) == list(range(resumed_at + 1, STEPS + 1))
    assert [losses[s] for s in sorted(losses)] == pytest.approx(want_losses[resumed_at:], abs=1e-5)
    got = model_state(list_checkpoints(run_dir)[-1])
    for key in want_state:
        torch.testing.assert_close(got[key], want_state[key], rtol=0, atol=1e-5, msg=key)
    assert_all_gone(run_dir, cli.runtime_dir)


LAUNCHER_KILLS = {   # moment: (overrides, settings, the rank that kills the launcher, the steps it may strike at)
    "step": ([], [], 1, range(2, 6)),
    "checkpoint": ([], [], 1, range(2, 6)),
    # the first migration, whose source is stage 1 (the only one: the layout is balanced after it)
    "migration": (MODEL_SETTINGS, [*SKEWED, "--set", "parallel.pipeline.rebalance_check_every=3"], 1, range(1)),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("moment", list(LAUNCHER_KILLS))
def test_a_launcher_killed_leaves_no_process_and_its_run_resumes_as_one_process(cli, moment):
    overrides, settings, rank, steps = LAUNCHER_KILLS[moment]
    name, kill_step = f"gone-{moment}", random.Random(f"{SEED}{moment}").choice(steps)
    run_dir, log = cli.tmp_path / "runs" / name, cli.tmp_path / f"{name}.jsonl"
    proc = cli.start("run", DEMO, "--headless", *cli.base_args(name), *[a for o in overrides for a in ("--set", o)],
                     *settings, "--set", f"run.steps={STEPS}", "--set", f"checkpoint.every={EVERY}",
                     "--set", "run.eval_every=0", "--set", "run.step_pause_ms=30", "--set", f"emulate.kill_rank={rank}",
                     "--set", f"emulate.kill_at={moment}", "--set", f"emulate.kill_step={kill_step}",
                     "--set", "emulate.kill_how=launcher", "--telemetry-log", str(log))
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert_all_gone(run_dir, cli.runtime_dir)   # within shutdown_timeout_s + 5 s of the launcher's end
    _, err = proc.communicate(timeout=10)
    assert f"kills its launcher (pid {proc.pid}) at {moment}" in err, err
    assert "its launcher" in err and "is gone; stopping" in err
    stop = [r for r in read_jsonl(log) if r.get("kind") == "stop"]
    assert stop and "the launcher is gone" in stop[-1]["reason"], stop   # stopped at a boundary, checkpointed
    assert int(list_checkpoints(run_dir)[-1].name.split("_")[1]) == stop[-1]["step"]
    assert_resumes_as_one_process(cli, name, overrides, *settings)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", ["rank0", "forkserver"])
def test_the_hubs_rank_or_the_fork_server_killed_restarts_and_equals_one_process(cli, victim):
    """rank 0 (the hub, the log's writer) dies at a seeded step; the fork server, which forked the workers, is
    killed from outside: its workers' agent sees them end and restarts the group with a new server."""
    name, log = f"killed-{victim}", cli.tmp_path / f"killed-{victim}.jsonl"
    run_dir = cli.tmp_path / "runs" / name
    at = random.Random(f"{SEED}{victim}").randrange(4, 7)
    fault = (["--set", "emulate.kill_rank=0", "--set", "emulate.kill_at=step", "--set", f"emulate.kill_step={at}"]
             if victim == "rank0" else [])
    proc = cli.start("run", DEMO, "--headless", *cli.base_args(name), "--set", f"run.steps={STEPS}",
                     "--set", f"checkpoint.every={EVERY}", "--set", "run.eval_every=0", "--set", "run.step_pause_ms=60",
                     "--set", "parallel.max_restarts=1", *fault, "--telemetry-log", str(log))
    if victim == "forkserver":
        wait_for(lambda: steps_logged(log) >= at, 60, f"step {at}")
        [server] = [p for p in run_processes(run_dir) if p.ppid() == proc.pid and "forkserver" in " ".join(p.cmdline())]
        server.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "restarting the worker group from the last checkpoint" in err
    records = read_jsonl(log)
    [restart] = [r for r in records if r.get("kind") == "restart"]
    after = {r["step"]: r["loss"] for r in records[records.index(restart):] if r["type"] == "step"}
    want_state, want_losses = one_process([], STEPS)
    assert sorted(after) == list(range(restart["step"] + 1, STEPS + 1))
    assert [after[s] for s in sorted(after)] == pytest.approx(want_losses[restart["step"]:], abs=1e-5)
    got = model_state(list_checkpoints(run_dir)[-1])
    for key in want_state:
        torch.testing.assert_close(got[key], want_state[key], rtol=0, atol=1e-5, msg=key)
    assert_all_gone(run_dir, cli.runtime_dir)


@pytest.mark.timeout(120)
def test_an_error_that_would_recur_ends_the_run_at_once_naming_the_rank_and_step(cli):
    run_dir = cli.tmp_path / "runs" / "bug"
    r = cli.run("run", DEMO, "--headless", *cli.base_args("bug"), "--set", "run.steps=20", "--set",
                "parallel.max_restarts=3", "--set", "emulate.kill_rank=1", "--set", "emulate.kill_at=step",
                "--set", "emulate.kill_step=3", "--set", "emulate.kill_how=error", timeout=90)
    assert r.returncode == 1, r.stderr
    assert "run failed: rank 1, step 4: IndexError: " in r.stderr
    assert "(not restarted: the same error would recur)" in r.stderr
    assert "restarting" not in r.stderr and "Traceback" in r.stderr   # the rank's own traceback, once
    assert r.stderr.rstrip().splitlines()[-1].startswith("run failed:")   # the last word is the named error
    assert_all_gone(run_dir, cli.runtime_dir)


@pytest.mark.timeout(120)
def test_a_second_run_of_a_live_runs_name_is_refused_with_or_without_overwrite(cli):
    run_dir, log = cli.tmp_path / "runs" / "one", cli.tmp_path / "one.jsonl"
    first = cli.start("run", DEMO, "--headless", *cli.base_args("one"), "--steps", "100000", "--set",
                      "run.step_pause_ms=20", "--set", "checkpoint.every=5", "--telemetry-log", str(log))
    wait_for(lambda: list_checkpoints(run_dir), 60, "the first run's first checkpoint")
    assert live(run_dir)
    for overwrite in ("false", "true"):
        r = cli.run("run", DEMO, "--headless", *cli.base_args("one"), "--steps", "5", "--set",
                    f"run.overwrite={overwrite}", timeout=60)
        assert r.returncode == 2, r.stderr
        assert f"run 'one' is live in {run_dir}, held by launcher pid {first.pid}" in r.stderr
        assert "`trainyard console one`" in r.stderr
    assert list_checkpoints(run_dir) and first.poll() is None   # nothing of the live run was touched
    records = read_jsonl(log)
    assert [r["type"] for r in records].count("run_start") == 1
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 128 + signal.SIGTERM
    assert_all_gone(run_dir, cli.runtime_dir)
    assert not live(run_dir)   # the kernel released its locks: the name is free again


def test_a_folder_held_by_workers_whose_launcher_died_is_refused_and_freed_with_them(tmp_path):
    """The gate is the launcher's; a worker's share outlives a launcher killed before it (the lifeline ends the
    worker soon after). Another launcher is refused until the workers are gone too."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom engine.run.claim import hold_as_worker\n"
                               "hold_as_worker(sys.argv[1], 0)\nprint('held', flush=True)\ntime.sleep(60)",
                               str(run_dir)], cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    try:
        assert holder.stdout.readline().strip() == "held"
        (run_dir / "pids" / "rank0.pid").write_text(str(holder.pid))
        assert live(run_dir)
        with pytest.raises(RunSetupError, match=f"workers of an earlier run 'x' still hold {run_dir} "
                                                f"\\(pids {holder.pid}\\), though its launcher is gone"):
            Claim.take(run_dir, 0, "x")
    finally:
        holder.kill()
        holder.wait()
    claim = Claim.take(run_dir, 0, "x")   # the workers gone, the folder is free
    with pytest.raises(RunSetupError, match="run 'x' is live"):
        Claim.take(run_dir, 0, "x")
    claim.release()


def test_a_filesystem_whose_locks_do_not_work_is_refused_by_name(tmp_path, monkeypatch):
    import engine.run.claim as claim
    monkeypatch.setattr(claim, "_locks_work", lambda path: False)
    with pytest.raises(RunSetupError, match=f"the filesystem holding {tmp_path} has no working file locks"):
        claim.Claim.take(tmp_path, 0, "x")


def _small_disk(tmp_path: Path, size: str) -> Path:
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    return disk


@pytest.mark.timeout(150)
def test_a_full_disk_under_the_log_or_the_run_folder_is_a_named_error_with_whole_lines(cli, tmp_path):
    disk = _small_disk(tmp_path, "4m")
    try:
        run_dir, log = cli.tmp_path / "runs" / "logfull", disk / "run.jsonl"
        proc = cli.start("run", DEMO, "--headless", *cli.base_args("logfull"), "--steps", "100000", "--set",
                         "run.step_pause_ms=20", "--set", "checkpoint.every=5", "--set", "parallel.max_restarts=2",
                         "--telemetry-log", str(log))
        wait_for(lambda: list_checkpoints(run_dir) and steps_logged(log) >= 6, 60, "a checkpoint and step 6")
        fill_disk(disk)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 1, err
        assert f"the telemetry log {log} could not be written" in err and "No space left on device" in err
        assert f"mounted at {disk}" in err and "the log is whole up to step" in err
        assert "latest checkpoint" in err and "restarting" not in err and "Traceback" not in err
        assert err.rstrip().splitlines()[-1].startswith("run failed:")
        assert log.read_bytes().endswith(b"\n")   # whole lines only
        for line in log.read_text().splitlines():
            json.loads(line)
        assert_all_gone(run_dir, cli.runtime_dir)

        (disk / "filler").unlink()   # the launcher's own files: config.toml, pid files, on a full disk
        fill_disk(disk)
        r = cli.run("run", DEMO, "--headless", "--set", f"run.dir={disk}", "--set", "run.name=full", "--steps", "5",
                    timeout=60)
        assert r.returncode in (1, 2), r.stderr
        assert "No space left on device" in r.stderr and f"mounted at {disk}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        wait_for(lambda: not run_processes(disk / "full"), SHUTDOWN_S + 5, "the refused run's processes to end")
    finally:
        cli.reap()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.timeout(120)
def test_a_nan_loss_is_said_once_and_the_log_stays_strict_json(cli):
    """skip_nonfinite off: an inf gradient poisons the weights, and every later loss is NaN; the run goes on as
    asked, and says so once."""
    log = cli.tmp_path / "nan.jsonl"
    r = cli.run("run", DEMO, "--headless", *cli.base_args("nan"), "--steps", "8", "--set", "optim.skip_nonfinite=false",
                "--set", "emulate.nonfinite_layer=fc0", "--set", "emulate.nonfinite_step=3", "--telemetry-log", str(log),
                timeout=90)
    assert r.returncode == 0, r.stderr

    def strict(constant):
        raise AssertionError(f"not JSON: {constant}")
    records = [json.loads(line, parse_constant=strict) for line in log.read_text().splitlines()]
    nonfinite = [x for x in records if x.get("kind") == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["what"] == "loss", nonfinite
    steps = [x for x in records if x["type"] == "step" and x["step"] >= nonfinite[0]["step"]]
    assert steps and all(x["loss"] is None and "loss" in x["nonfinite"] for x in steps)
    assert_all_gone(cli.tmp_path / "runs" / "nan", cli.runtime_dir)




@pytest.mark.parametrize("checkpoint_s, left_s, fits", [(None, 9.0, True), (None, 0.2, False), (0.05, 0.2, True),
                                                         (2.0, 1.5, False)])
def test_a_stops_final_checkpoint_is_written_only_where_it_fits_the_time_left(monkeypatch, tmp_path, capsys,
                                                                            checkpoint_s, left_s, fits):
    """Its time: the last checkpoint's in this process, or before any, what the rank holds at a slow disk's
    rate; the time left: parallel.shutdown_timeout_s from the signal. Skipped, it is said: an event, a note,
    a line on stderr naming the latest checkpoint. (Every rank takes the smallest margin: an all-reduce, here
    of one rank.)"""
    from types import SimpleNamespace
    import torch.distributed as dist
    from engine.run.worker import Worker
    from engine.runtime.lifecycle import StopRequest
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    stop = StopRequest(grace_s=5.0)
    stop.at = time.monotonic() - (5.0 - left_s)
    worker = SimpleNamespace(stop=stop, core=SimpleNamespace(stop_reason="signal 15"), checkpoint_s=checkpoint_s,
                             tel=Told(),
                             model=torch.nn.Linear(100, 100), topo=SimpleNamespace(side=None, is_first=True),
                             run_dir=tmp_path, cfg=SimpleNamespace(parallel=SimpleNamespace(shutdown_timeout_s=5)))
    assert Worker._final_checkpoint_fits(worker, 12) is fits
    if fits:
        assert not worker.tel.events and not capsys.readouterr().err
        return
    [(kind, step, fields)] = worker.tel.events
    assert (kind, step) == ("checkpoint_skipped", 12) and fields["shutdown_timeout_s"] == 5
    err = capsys.readouterr().err
    assert "the final checkpoint of step 12 was skipped: it needs about" in err
    assert "no checkpoint was written" in err and worker.tel.notes
    worker.core.stop_reason = "command"   # a stop by `trainyard ctl RUN stop`: always checkpointed
    assert Worker._final_checkpoint_fits(worker, 12)


def test_a_crashed_runs_socket_and_registry_entry_are_removed_at_its_next_start(runtime_dir):
    from engine.run.claim import remove_leftovers
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for stem, pid in (("crashed", dead), ("crashed-9", dead), ("alive", os.getpid())):
        (runtime_dir / f"{stem}.sock").write_text("")
        (runtime_dir / f"{stem}.token").write_text("t")
        (runtime_dir / f"{stem}.json").write_text(json.dumps({
            "run": "alive" if stem == "alive" else "crashed", "pid": int(pid),
            "socket": str(runtime_dir / f"{stem}.sock"), "token_file": str(runtime_dir / f"{stem}.token")}))
    removed = remove_leftovers("crashed")
    assert sorted(p.name for p in removed) == sorted(f"{s}.{e}" for s in ("crashed", "crashed-9")
                                                     for e in ("sock", "token", "json"))
    assert sorted(p.name for p in runtime_dir.iterdir()) == ["alive.json", "alive.sock", "alive.token"]
    assert remove_leftovers("alive") == []   # a live run's are never touched
