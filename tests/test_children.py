"""Nothing left behind (engine/processes/children.py, engine/run/launch.py): a command that starts a child
run owns it, and a run leaves nothing in the system temp dir.

A command killed mid-run (SIGTERM to it alone, as `kill` does) takes its child run's whole session with it
within 15 s, and removes the folders it made; the same holds for SIGINT, SIGHUP and an exception, checked
on ChildRuns itself with plain processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from engine.processes import cluster
from tests.conftest import ROOT, wait_for

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")
pytestmark = pytest.mark.own_fork_server   # the processes of each run's own session, its fork server's included
GONE_WITHIN_S = 15


def alive_in_sessions(*sids: int) -> list[str]:
    """The live processes (zombies aside) of these process sessions: 'pid command'."""
    found = []
    for p in psutil.process_iter(["status", "cmdline"]):
        try:
            if os.getsid(p.pid) in sids and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:160]}")
        except OSError:
            pass
    return found


def assert_gone_after(sig: int, command: int, *sessions: int, proc: subprocess.Popen | None = None) -> None:
    """Send `sig` to `command` (pid of a command leading a session of its own) and see every process of its
    session and of `sessions` gone within GONE_WITHIN_S (`proc`: the command's Popen, reaped meanwhile)."""
    os.kill(command, sig)
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        if not (left := alive_in_sessions(command, *sessions)):
            return
        time.sleep(0.2)
    pytest.fail(f"still alive {GONE_WITHIN_S} s after {signal.Signals(sig).name}: {left}")


def steps_logged(log: Path) -> int:
    """Step records in a telemetry log being written (compact JSON lines; one still being written is fine)."""
    return log.read_text().count('"type":"step"') if log.exists() else 0


def child_run(command: subprocess.Popen) -> int:
    """The pid of the `trainyard run` that `command` started; it leads a process session of its own."""
    def find():
        for child in psutil.Process(command.pid).children():
            try:
                if "engine.cli" in child.cmdline() and "run" in child.cmdline():
                    return child.pid
            except psutil.Error:
                pass
        assert command.poll() is None, command.communicate()
    pid = wait_for(find, 60, "the command's child run")
    assert os.getsid(pid) == pid, "the child run is not in a session of its own"
    return pid


@pytest.fixture
def sessions():
    """Process sessions a test saw (ids, appended): whatever of them a failed test leaves is killed."""
    seen: list[int] = []
    yield seen
    for pid in (p.pid for p in psutil.process_iter() if _sid(p.pid) in seen):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """A temp dir (TMPDIR) for the processes this test starts, to see what they leave there: nothing, torch's
    compile cache included (torchinductor_USER, made in the temp dir when torch._dynamo is imported, goes to
    the runtime dir: children.torch_cache_out_of_temp)."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return path


# --- ChildRuns itself, on plain processes -------------------------------------------------------------------

# A command owning a child, which has a grandchild in another process group of its session that ignores
# SIGINT: only the session scan and the SIGKILL after the grace find it.
OWNER = textwrap.dedent("""
    import json, signal, subprocess, sys, time
    from engine.processes import children
    # a command started from a terminal: a suite run as a shell's background job inherits SIGINT ignored, which
    # ChildRuns rightly leaves be (the SIGINT case then never ends the owner)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    children.STOP_GRACE_S = 1.0
    CHILD = '''
    import subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.setpgid(0, 0); "
                          "signal.signal(signal.SIGINT, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"],
                         stdout=subprocess.PIPE)
    g.stdout.readline()
    print(g.pid, flush=True)
    time.sleep(600)
    '''
    with children.ChildRuns() as runs:
        tmp = runs.temp_dir("trainyard-bench-test-")
        proc = runs.start([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        kept = runs.start([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
        runs.release(kept)
        grandchild = int(proc.stdout.readline())
        print(json.dumps({"child": proc.pid, "grandchild": grandchild, "kept": kept.pid, "tmp": str(tmp)}),
              flush=True)
        if sys.argv[1] == "raise":
            raise RuntimeError("the command failed")
        time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "raise"])
def test_an_owner_stops_its_childs_whole_session_and_removes_its_folders(own_tmp, how):
    """Whichever way the owner ends, the child and its grandchild are gone, the folder too, a released child
    goes on, and the owner ends as it would have without ChildRuns: by the signal (or the exception)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, how], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    sessions = [owner.pid]
    try:
        line = owner.stdout.readline()
        assert line, owner.communicate()[1]
        info = json.loads(line)
        sessions += [info["child"], info["kept"]]
        assert os.getsid(info["child"]) == info["child"] and os.getsid(info["grandchild"]) == info["child"]
        if how == "raise":
            assert owner.wait(timeout=GONE_WITHIN_S) == 1
            assert "the command failed" in owner.stderr.read()
            assert not alive_in_sessions(info["child"])
        else:
            assert_gone_after(getattr(signal, how), owner.pid, info["child"], proc=owner)
            assert owner.wait() == -getattr(signal, how)
        assert not Path(info["tmp"]).exists() and not list(own_tmp.iterdir())
        assert alive_in_sessions(info["kept"]), "the released child was stopped"
    finally:
        for sid in sessions:
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        owner.wait()


def test_the_handlers_before_an_owner_come_back_after_it():
    from engine.processes.children import SIGNALS, ChildRuns
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # ignored before: left ignored
    try:
        with ChildRuns() as runs:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == runs._on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# --- each command that starts a child run, SIGTERMed mid-run ---------------------------------------------------

BENCHES = {   # each bench, long enough to be killed mid-run; its folder; the log of its first run
    "ps": (["--seconds", "120", "--modes", "bsp", "--eval-every", "100"], "trainyard-bench-ps-*", "bsp.jsonl"),
    "telemetry": (["--rounds", "1", "--steps", "100000", "--warmup", "10"], "trainyard-bench-telemetry-*",
                  "bench0.jsonl"),
}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(BENCHES))
def test_a_bench_killed_mid_run_leaves_no_process_and_no_folder(cli, own_tmp, sessions, name):
    args, folder, log = BENCHES[name]
    bench = cli.start("bench", name, "--json", *args)
    run = child_run(bench)
    sessions.append(run)
    work = wait_for(lambda: next(own_tmp.glob(folder), None), 10, "the bench's folder")
    wait_for(lambda: steps_logged(work / log) >= 2, 90, "the run's second step")
    assert_gone_after(signal.SIGTERM, bench.pid, run, proc=bench)
    assert bench.wait() == -signal.SIGTERM
    assert not list(own_tmp.iterdir())
    assert not list(cli.runtime_dir.glob("bench-*")), "bench telemetry's runtime folder for its runs is left"


POOL_BENCHES = {   # benches whose ranks are a DistPool's processes, in the bench's own session
    "broadcast": ["--world", "2", "--rounds", "1000", "--hidden", "64", "--depth", "4", "--steps", "3"],
    "pipeline": ["--stages", "2", "--rounds", "1000"],
}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(POOL_BENCHES))
def test_a_pool_bench_killed_mid_run_leaves_no_rank_behind(cli, own_tmp, sessions, name):
    """A bench measuring in a DistPool, SIGTERMed while its ranks work: the ranks are killed with it (they
    were orphaned, processes still running the job)."""
    bench = cli.start("bench", name, "--json", *POOL_BENCHES[name])
    sessions.append(bench.pid)
    def pool_ranks():   # spawned, or forked from the bench's fork server (engine/processes/forkserver.py)
        procs = psutil.Process(bench.pid).children(recursive=True)
        servers = {p.pid for p in procs if "forkserver import main" in " ".join(p.cmdline())}
        return [p for p in procs if "spawn" in " ".join(p.cmdline()) or p.ppid() in servers] or None
    ranks = wait_for(pool_ranks, 30, "the pool's ranks")
    time.sleep(3)   # into the measuring
    assert all(p.is_running() for p in ranks) and bench.poll() is None
    assert_gone_after(signal.SIGTERM, bench.pid, proc=bench)
    assert bench.wait() == -signal.SIGTERM
    assert not list(own_tmp.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (Debian's tmux package)")
def test_the_demo_killed_mid_run_stops_its_run_after_the_final_checkpoint(tmp_path, runtime_dir, own_tmp,
                                                                           sessions):
    from tests.test_demos import Terminal, wait_screen
    term = Terminal(tmp_path, runtime_dir)   # its processes inherit own_tmp as TMPDIR
    pid_file = tmp_path / "demo.pid"
    try:
        term.start(sys.executable, "-m", "engine.cli", "demo", "ddp", "--steps", "2000", pid_file=pid_file)
        wait_screen(term, r"step ([1-9]\d*)/\d+", 120, "the console's first step")
        demo = int(pid_file.read_text())   # the terminal's shell, exec'd: it leads the terminal's session
        launcher = int((tmp_path / "runs" / "demo-ddp" / "pids" / "launcher.pid").read_text())
        sessions += [demo, launcher]
        assert os.getsid(demo) == demo and os.getsid(launcher) == launcher
        assert_gone_after(signal.SIGTERM, demo, launcher)
        log = (tmp_path / "runs" / "demo-ddp" / "demo.log").read_text()
        assert "stopped by SIGINT; latest checkpoint:" in log, log
        assert not list(own_tmp.iterdir())
    finally:
        term.close()


needs_cluster = pytest.mark.skipif(cluster.available() is not None, reason=cluster.available() or "")

# A process owning an emulated cluster (what `trainyard bench broadcast --hosts` and the cluster tests do), with
# a process running inside host 1.
CLUSTER_OWNER = textwrap.dedent("""
    import json, subprocess, sys, time
    from engine.processes.cluster import emulated_cluster
    with emulated_cluster(hosts=2, link="10mbit", name=sys.argv[1]) as c:
        inside = subprocess.Popen(c.command(1, ["sleep", "600"]))
        print(json.dumps({"inside": inside.pid}), flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.timeout(60)
@needs_cluster
@pytest.mark.xdist_group("netns")   # with tests/test_cluster.py: one test process builds namespaces
def test_an_emulated_clusters_owner_killed_takes_the_cluster_down(sessions):
    name = f"tk{os.getpid() % 100000}"
    owner = subprocess.Popen([sys.executable, "-c", CLUSTER_OWNER, name], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    sessions.append(owner.pid)
    try:
        inside = json.loads(owner.stdout.readline())["inside"]
        assert_gone_after(signal.SIGTERM, owner.pid, proc=owner)
        assert owner.wait() == -signal.SIGTERM
        assert not psutil.pid_exists(inside) or psutil.Process(inside).status() == psutil.STATUS_ZOMBIE
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"trainyard-{name}-" not in listed
    finally:
        cluster.down(name)


@pytest.mark.slow
@pytest.mark.timeout(90)
@needs_cluster
@pytest.mark.xdist_group("netns")
def test_a_run_through_cluster_exec_killed_mid_run_leaves_no_process(cli, own_tmp):
    """`trainyard cluster exec` becomes the command it runs (no child of its own): SIGTERM reaches the run."""
    name = f"tx{os.getpid() % 100000}"
    cluster.up(2, "1gbit", name=name, owner_pid=os.getpid())
    try:
        log = cli.tmp_path / "run.jsonl"
        proc = cli.start("cluster", "exec", "--name", name, "0", "--", sys.executable, "-m", "engine.cli", "run",
                         DEMO, "--headless", "--steps", "100000", *cli.base_args("inside"),
                         "--set", "run.step_pause_ms=20", "--telemetry-log", str(log))
        wait_for(lambda: steps_logged(log) >= 3, 60, "step 3")
        assert_gone_after(signal.SIGTERM, proc.pid, proc=proc)
        out, err = proc.communicate()   # what it said, should it end otherwise (one suite saw -6: SIGABRT, once)
        assert proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
        assert not list(own_tmp.iterdir())
    finally:
        cluster.down(name)


# --- nothing in the temp dir after a run; the agent's logs in the run directory --------------------------------

@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_run_leaves_nothing_in_the_temp_dir(cli, own_tmp):
    r = cli.run("run", DEMO, "--headless", "--steps", "5", *cli.base_args("tidy"), timeout=80)
    assert r.returncode == 0, r.stderr
    assert not list(own_tmp.iterdir())
    # the agent's folders are in the run directory, and removed where they stayed empty (no worker failed)
    assert not (cli.tmp_path / "runs" / "tidy" / "agent").exists()


def test_the_agent_keeps_its_logs_in_the_run_directory(tmp_path):
    from engine.config import load_config
    from engine.run.launch import _launch_config
    from engine.run.rank import agent_dir
    from engine.run.rank import Job
    job = Job(config=load_config(DEMO, [f"run.dir={tmp_path}", "run.name=logs"]))
    logs = agent_dir(job.config.run_dir, 0)
    assert logs == tmp_path / "logs" / "agent" / "node0"
    assert _launch_config(job, logs).logs_specs.root_log_dir == str(logs)


def test_a_fresh_start_removes_the_earlier_agent_logs(tmp_path):
    from engine.config import load_config
    from engine.run.launch import prepare_run_dir
    from engine.run.rank import agent_dir
    from engine.run.rank import Job
    cfg = load_config(DEMO, [f"run.dir={tmp_path}", "run.name=again"])
    old = agent_dir(cfg.run_dir, 0) / "again-1_x" / "attempt_0" / "1" / "error.json"
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    prepare_run_dir(Job(config=cfg))
    assert not agent_dir(cfg.run_dir, 0).exists()


def test_empty_agent_folders_are_removed_and_a_failed_workers_error_kept(tmp_path):
    from engine.run.launch import _remove_empty_folders
    agent = tmp_path / "agent" / "node0"
    for rank in (0, 1):
        (agent / "run-1_x" / "attempt_0" / str(rank)).mkdir(parents=True)
    (agent / "run-1_x" / "attempt_1" / "0").mkdir(parents=True)
    (agent / "run-1_x" / "attempt_0" / "1" / "error.json").write_text("{}")
    _remove_empty_folders(agent)
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "agent", "agent/node0", "agent/node0/run-1_x", "agent/node0/run-1_x/attempt_0",
        "agent/node0/run-1_x/attempt_0/1", "agent/node0/run-1_x/attempt_0/1/error.json"]
    (agent / "run-1_x" / "attempt_0" / "1" / "error.json").unlink()
    _remove_empty_folders(agent)
    assert not list(tmp_path.iterdir())


WORKER_RAISES = textwrap.dedent("""
    import sys
    from types import SimpleNamespace
    from engine.processes import lifeline
    from engine.run import worker_entry
    def worker_main(job):
        raise RuntimeError("a worker's own error")
    worker_entry.worker_main = worker_main
    job = SimpleNamespace(launcher=lifeline.identity(), config=SimpleNamespace(
        parallel=SimpleNamespace(shutdown_timeout_s=5), cluster=SimpleNamespace(nnodes=1)))
    try:
        worker_entry.run_worker(job)
    except SystemExit as e:
        print("exit", e.code)
""")


WORKER_FINISHES = textwrap.dedent("""
    import signal
    from types import SimpleNamespace
    from engine.processes import lifeline
    from engine.run import worker_entry
    worker_entry.worker_main = lambda job: "done"
    job = SimpleNamespace(launcher=lifeline.identity(), config=SimpleNamespace(
        parallel=SimpleNamespace(shutdown_timeout_s=5), cluster=SimpleNamespace(nnodes=1)))
    signal.signal(signal.SIGTERM, lambda *a: None)   # the step loop's StopRequest, still installed
    print(worker_entry.run_worker(job), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
""")


@pytest.mark.timeout(60)
def test_a_worker_that_finished_its_work_is_ended_by_a_stop():
    """The agent may keep a finished worker waiting for its result to be read: a SIGTERM must end it then (a
    handler left installed swallowed it, and a rank stayed for minutes after its launcher)."""
    r = subprocess.run([sys.executable, "-c", WORKER_FINISHES], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert r.stdout.split() == ["done", "True"], r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_a_worker_that_raises_writes_the_agents_error_file_and_no_pickle(tmp_path, own_tmp):
    """torch.multiprocessing pickles an error raised out of a worker into pytorch-errorfile-*.pickle in the
    temp dir and never removes it; run_worker ends the worker with exit status 1 once the error is where the
    agent reads it, written whole (a full disk once left it empty, and the agent failed to parse it)."""
    error_file = tmp_path / "error.json"
    r = subprocess.run([sys.executable, "-c", WORKER_RAISES], cwd=ROOT, capture_output=True, text=True, timeout=50,
                       env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert r.stdout.strip() == "exit 1", r.stderr
    assert "a worker's own error" in json.loads(error_file.read_text())["message"]["message"]
    assert not list(own_tmp.iterdir()) and not list(tmp_path.glob("*.partial"))


def test_bench_processes_allocate_with_fixed_thresholds_unless_the_user_set_their_own():
    """glibc's dynamic thresholds gave one worker 5,300 page faults a second and an identical one 15
    (children.steady_host_allocator); a user's own MALLOC_* settings win."""
    import platform
    from engine.processes import children
    got = children.steady_host_allocator({"PATH": "/bin"})
    glibc = platform.libc_ver()[0] == "glibc"
    assert got == ({"PATH": "/bin", **children.HOST_ALLOCATOR} if glibc else {"PATH": "/bin"})
    assert children.steady_host_allocator({"MALLOC_TRIM_THRESHOLD_": "0"}) == {"MALLOC_TRIM_THRESHOLD_": "0"}


POOL_OWNER = """
import sys, time
from engine.processes.procpool import DistPool
pool = DistPool(world=2)
print(*(proc.pid for proc in pool.procs), flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(90)
def test_a_pools_ranks_end_with_their_owner_killed_alone():
    """A pool's maker SIGKILLed by itself (not its session): its ranks, forks of a fork server and not its
    children, end by their lifeline; they held the server's liveness pipe, so they had kept it alive too."""
    owner = subprocess.Popen([sys.executable, "-c", POOL_OWNER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        ranks = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(ranks) == 2
        owner.kill()
        owner.wait()
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in ranks), 15, "the pool's ranks to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
