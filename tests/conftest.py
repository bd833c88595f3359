"""Shared helpers: run the `trainyard` CLI in its own process session, and reap it.

Every multi-process test goes through `cli`: the launcher starts in a new session, killed whole at teardown
whatever happened to the test. Its workers fork from the session's shared fork server (TRAINYARD_FORK_SERVER),
outside that session: they follow their launcher's end by their lifeline (engine/processes/lifeline.py), as on
any launcher's death. A test marked own_fork_server has its runs start their own servers, in their sessions.

Nothing is left in the temp dir: every process the tests start keeps its temporary files in a
folder of this session's own (TMPDIR, inherited), and an entry there named as a run's or a bench's
litter (LITTER) at the end fails the session. Whatever else runs on the machine writes elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import engine.run  # noqa: F401  (the session's fork server preloads the engine too)
from engine.processes import forkserver

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent

# torch's elastic agent's log folders, torch.multiprocessing's error files, our benches' folders
LITTER = ("torchelastic_", "pytorch-errorfile-", "trainyard-bench-", "pymp-", "torchinductor_")
HF_PRELOAD = ("gpt2", "llama", "mistral", "mixtral", "qwen2_moe")   # the families the tests' runs train
_session: dict = {}   # in hooks, not at import: tests import this module a second time as tests.conftest


@pytest.hookimpl(tryfirst=True)   # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config):
    # in the system temp dir, which this process goes on using (mkdtemp fixes it before TMPDIR changes)
    _session["tmp"] = Path(tempfile.mkdtemp(prefix="trainyard-tests-"))
    os.environ["TMPDIR"] = str(_session["tmp"])
    # pytest's own tmp_path folders too, removed with it (not /tmp/pytest-of-USER); an xdist worker is given
    # its controller's, and `--basetemp DIR` keeps them where the caller says
    if config.option.basetemp is None:
        config.option.basetemp = str(_session["tmp"] / "pytest")
    # torch's compile cache, for this process's own optimizers (torch._dynamo makes it on import); the runs
    # the tests start keep theirs in their runtime dir (engine/processes/children.py)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_session["tmp"] / "inductor")
    # one warm fork server for the session's runs (TRAINYARD_FORK_SERVER): each run it starts saves the server's
    # imports, 4-5 s of CPU, and a Hugging Face run's workers their transformers; a test marked own_fork_server
    # starts its own, as a user's launcher does
    if importlib.util.find_spec("transformers") is not None:
        forkserver.PRELOADS.extend(f"transformers.models.{kind}.modeling_{kind}" for kind in HF_PRELOAD)
    os.environ[forkserver.SHARED] = forkserver.share()


def pytest_sessionfinish(session, exitstatus):
    forkserver.stop()   # not still importing when the temp dir goes (it would make its inductor folder again)
    tmp = _session["tmp"]
    _session["litter"] = sorted(name for name in os.listdir(tmp) if name.startswith(LITTER))
    shutil.rmtree(tmp, ignore_errors=True)
    if _session["litter"]:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _session.get("litter"):
        terminalreporter.write_line(f"FAILED: the tests' processes left {len(_session['litter'])} entries in the "
                                    f"temp dir (TMPDIR): {', '.join(_session['litter'])}", red=True, bold=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class CLI:
    def __init__(self, tmp_path: Path, runtime_dir: Path):
        self.tmp_path = tmp_path
        self.runtime_dir = runtime_dir   # where this test's runs put their sockets
        self.procs: list[subprocess.Popen] = []

    def base_args(self, name: str) -> list[str]:
        return ["--set", f"run.dir={self.tmp_path / 'runs'}", "--set", f"run.name={name}"]

    def start(self, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """`trainyard ARGS` in a new session; `prefix`: a command that runs it (e.g. `ip netns exec NS`)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "120",
               "TRAINYARD_RUNTIME_DIR": str(self.runtime_dir)}
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "engine.cli", *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        proc = self.start(*args)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            out, err = proc.communicate()
            pytest.fail(f"trainyard {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)
                proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def own_fork_server(request, monkeypatch):
    """A test marked own_fork_server: the runs it starts start their own fork servers, as a user's launcher
    does (a test of the processes of a run's tree, its sessions or signals)."""
    if request.node.get_closest_marker("own_fork_server"):
        monkeypatch.delenv(forkserver.SHARED, raising=False)


@pytest.fixture
def runtime_dir(monkeypatch):
    """A private runtime directory for sockets, short enough for AF_UNIX paths (108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ty", dir="/tmp"))
    monkeypatch.setenv("TRAINYARD_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cli(tmp_path, runtime_dir):
    runner = CLI(tmp_path, runtime_dir)
    yield runner
    runner.reap()


def read_jsonl(path: Path) -> list[dict]:
    """A telemetry log's records (every part), each step's rank rows in full (engine.telemetry.log.read_log)."""
    from engine.telemetry.log import read_log
    return read_log(path)


def fill_disk(disk: Path, name: str = "filler") -> Path:
    """Fill what is left of the (small, test-mounted) filesystem holding `disk` with a file `name`."""
    filler = disk / name
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    return filler


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def train_one_process(model, optim_cfg, batches, optimizer_state: dict | None = None) -> tuple[dict, list[float]]:
    """The reference every parallel layout must equal: one process, one update per whole global batch.
    Returns the final state_dict and each step's loss; fills `optimizer_state` (given) with the optimizer's
    state under the parameters' names (what Strategy.optimizer_state gives)."""
    from engine.training.loss import cross_entropy
    from engine.training.optim import make_optimizer
    opt = make_optimizer(optim_cfg, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        if optim_cfg.clip_grad_norm > 0:   # torch's own, over each parameter once (a tied weight once)
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.clip_grad_norm)
        opt.step()
        losses.append(loss.item())
    if optimizer_state is not None:
        from engine.strategies.base import parameter_names
        from engine.techniques.updates.state import named_state
        optimizer_state.update(named_state(opt, list(model.parameters()), parameter_names(model)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def assert_named_state_close(got: dict, want: dict, atol: float, what: str = "") -> None:
    """Two optimizer states by parameter name (Strategy.optimizer_state's form) hold the same names, keys and
    values."""
    assert sorted(got) == sorted(want), f"{what}: names {sorted(set(got) ^ set(want))} differ"
    for name, entry in want.items():
        assert sorted(got[name]) == sorted(entry), f"{what} {name}: keys {sorted(got[name])} != {sorted(entry)}"
        for key, value in entry.items():
            if torch.is_tensor(value):
                torch.testing.assert_close(got[name][key].float(), value.float(), atol=atol, rtol=0,
                                           msg=lambda m, n=name, k=key: f"{what} {n}.{k}: {m}")
            else:
                assert got[name][key] == value, f"{what} {name}.{key}: {got[name][key]!r} != {value!r}"


class Told:
    """A rank 0 Telemetry that keeps what it is told (events and notes)."""

    def __init__(self):
        self.events, self.notes = [], []

    def event(self, kind, step, **fields):
        self.events.append((kind, step, fields))

    def note(self, text):
        self.notes.append(text)
