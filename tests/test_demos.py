"""Every demo as a person meets it: `trainyard demo NAME` in a real terminal (tmux), the first step on
screen, the demo's key pressed and its effect seen on screen, then q, s (stop), and no process left.

The demos' run names, and their overrides, are unit-tested at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import pid_alive, wait_for

# one test process draws these terminals, one after another (pyproject: --dist loadgroup)
pytestmark = [pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (Debian's tmux package)"),
              pytest.mark.xdist_group("terminal"),
              pytest.mark.own_fork_server]   # as a user's demo runs: its run's processes are all its own

STEP = re.compile(r"step (\d+)/\d+")


class Terminal:
    """One tmux server of our own (its own socket), running `trainyard demo NAME` in `cwd`."""

    def __init__(self, cwd: Path, runtime_dir: Path):
        self.cwd, self.socket = cwd, f"ty-test-{os.getpid()}-{time.monotonic_ns()}"
        self.pid_file: Path | None = None
        # the terminal's own size (160x50): Textual would take COLUMNS/LINES over it (pytest-xdist's workers set
        # COLUMNS=80, and the console then folds the Layers panel into a tab)
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.env = {**inherited, "TRAINYARD_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1",
                    "TERM": "xterm-256color"}

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                              env=self.env, cwd=self.cwd).stdout

    def start(self, *command: str, pid_file: Path | None = None) -> None:
        """`command` in the terminal; with `pid_file`, it replaces the shell (and its pid is written there),
        else the shell says how it exited and stays."""
        self.pid_file = pid_file
        shell = (f"echo $$ > {pid_file}; exec " + " ".join(command) if pid_file else
                 " ".join(command) + "; echo DEMO-EXIT $?; sleep 600")
        self.tmux("new-session", "-d", "-s", "demo", "-x", "160", "-y", "50", shell)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "demo")

    def keys(self, *keys: str) -> None:
        for key in keys:
            self.tmux("send-keys", "-t", "demo", key)
            time.sleep(0.3)

    def close(self) -> None:
        self.tmux("kill-server")
        # the server leaves its socket file behind (also when its session ended first): tmux(1)'s -L path
        folder = Path(self.env.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}"
        (folder / self.socket).unlink(missing_ok=True)


def screen_match(term: Terminal, pattern: str, timeout: float) -> re.Match | None:
    """The first match of `pattern` on the screen within `timeout` s, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := re.search(pattern, term.screen(), re.S):
            return found
        time.sleep(0.5)
    return None


def wait_screen(term: Terminal, pattern: str, timeout: float, what: str, story: bool = False) -> re.Match:
    """The first match of `pattern` on the screen within `timeout` s; else a failure showing the screen (and,
    with `story`, what the run logged of its commands: the events panel shows only its last lines)."""
    if found := screen_match(term, pattern, timeout):
        return found
    pytest.fail(f"timed out after {timeout}s waiting for {what}; the screen:\n{term.screen()}"
                + (f"\n{run_story(term.cwd / 'runs')}" if story else ""))


def run_story(runs: Path) -> str:
    """Each run's command events and rebalances from its telemetry log, and its log's last lines."""
    out = []
    for log in sorted(runs.glob("*/telemetry.jsonl")):
        lines = log.read_text(errors="replace").splitlines()
        out += [f"{log}:", *(line[:400] for line in lines if '"command"' in line or '"rebalance"' in line
                             or '"run_start"' in line[:80])]
    for log in sorted(runs.glob("*/*.log")):
        out += [f"{log} (last lines):", *log.read_text(errors="replace").splitlines()[-30:]]
    return "\n".join(out) or f"nothing logged under {runs}"


def run_pids(runs: Path) -> list[int]:
    pids = []
    for path in runs.glob("*/pids/*.pid"):
        try:
            pids.append(int(path.read_text()))
        except (OSError, ValueError):
            pass
    return pids


@pytest.fixture
def terminal(tmp_path, runtime_dir):
    term = Terminal(tmp_path, runtime_dir)
    yield term
    term.close()
    for pid in run_pids(tmp_path / "runs"):   # a failed test leaves nothing training
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if term.pid_file is not None and term.pid_file.exists():   # nor a demo command stuck after a hang-up
        try:
            os.kill(int(term.pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def select(term: Terminal, layer: str, rows: list[str]) -> str:
    """Move the Layers cursor (on the first row, in the model's order) down to `layer`, once the table has its
    rows (they come with the first timed step); returns the layer's row."""
    row = wait_screen(term, rf"│ {re.escape(layer)} [^\n]*", 60, f"{layer}'s row in the Layers panel").group(0)
    term.keys(*["Down"] * rows.index(layer))
    return row


# the Layers table opens in the model's order
TRANSFORMER_ROWS = ["embed", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp", "block2.attn",
                    "block2.mlp", "block3.attn", "block3.mlp", "norm", "head"]


def press_policy(term: Terminal, layer: str, rows: list[str]) -> None:
    """Select `layer`, press the key of a policy it does not have, and see its row take it."""
    now = re.search(r"\b(keep|swap|recompute)\b", select(term, layer, rows)).group(1)
    want = "recompute" if now != "recompute" else "keep"
    term.keys({"keep": "k", "recompute": "c"}[want])
    wait_screen(term, rf"│ {re.escape(layer)} [^\n]*\b{want}\b", 60, f"{layer}'s policy to become {want}")


def press_placement(term: Terminal, layer: str, rows: list[str]) -> None:
    now = re.search(r"\b(device|host)\b", select(term, layer, rows)).group(1)
    want = "host" if now == "device" else "device"
    term.keys("u")
    wait_screen(term, rf"set-placement {re.escape(layer)} {want}: applied", 60, "the placement reply")
    wait_screen(term, rf"│ {re.escape(layer)} [^\n]*\b{want}\b", 60, f"{layer}'s update to move to the {want}")


def stages(screen: str) -> str:
    """The Stages panel's text (its layer lists change when the layout does)."""
    panel = re.search(r"╭─ Stages ─.*?╰", screen, re.S)
    assert panel, f"no Stages panel:\n{screen}"
    return panel.group(0)


def press_rebalance(term: Terminal) -> None:
    before = stages(term.screen())
    term.keys("r")
    # the console says "pending" once it has sent the command; a key pressed while its keys were dimmed does
    # nothing: press again
    if not screen_match(term, r"rebalance: (pending|applied)", 15):
        term.keys("r")
    wait_screen(term, r"rebalance: applied at step \d+", 90, "the rebalance reply", story=True)
    wait_for(lambda: stages(term.screen()) != before, 30, "the Stages panel to show the new layout", interval=0.5)


def press_sync(term: Terminal) -> None:
    wait_screen(term, r"sync soft", 60, "the sync mode in the header")
    term.keys("m")
    wait_screen(term, r"bsp", 10, "the sync mode chooser")
    term.keys("Down", "Enter")   # soft is first and marked; bsp next
    wait_screen(term, r"sync bsp", 60, "the header to show sync bsp")


def see_streams(term: Terminal) -> None:
    wait_screen(term, r"stream 3 [^\n]*\d+(\.\d+)? [KM]iB", 60, "four busy streams")
    wait_screen(term, r"gate \d", 60, "the forward gate's wait on a device card")


def press_pause(term: Terminal) -> None:
    term.keys("p")
    wait_screen(term, r"step \d+/\d+\s+paused", 60, "the header to say paused")
    term.keys("p")
    wait_screen(term, r"resume: applied", 60, "resume")


ACTIONS = {
    "tour": lambda term: (press_rebalance(term), press_policy(term, "block0.mlp", TRANSFORMER_ROWS)),
    "pipeline": press_rebalance,
    "memory": lambda term: press_policy(term, "block0.mlp", [r for r in TRANSFORMER_ROWS if "block3" not in r]),
    "hybrid": lambda term: press_placement(term, "block0.mlp", [r for r in TRANSFORMER_ROWS if "block3" not in r]),
    "sharded": see_streams,
    "ps": press_sync,
    "ddp": press_pause,
    "llm": press_rebalance,
}
SLOW = {"memory", "sharded", "ddp", "ps", "llm"}   # the tour covers policies; the others have their own CLI tests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in ACTIONS
                                  if n != "ddp"])   # ddp's: in the closing test below, which starts it anyway
def test_demo_in_a_terminal(terminal, tmp_path, name):
    terminal.start(sys.executable, "-m", "engine.cli", "demo", name)
    wait_screen(terminal, r"step ([1-9]\d*)/\d+", 120, "the console's first step")
    ACTIONS[name](terminal)
    terminal.keys("q")
    wait_screen(terminal, r"Stop the run", 10, "the quit dialog")
    terminal.keys("s")   # asks once: stop now
    wait_screen(terminal, rf"demo-{name} ended \(exit 0\)", 120, "the run to end")
    wait_screen(terminal, r"DEMO-EXIT 0", 30, "the demo command to exit 0")
    pids = run_pids(tmp_path / "runs")
    assert pids, "the run wrote no pid files"
    wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "every process of the run to be gone")


@pytest.mark.timeout(180)
def test_closing_the_terminal_stops_the_demo_run_after_its_final_checkpoint(terminal, tmp_path):
    terminal.start(sys.executable, "-m", "engine.cli", "demo", "ddp", pid_file=tmp_path / "demo.pid")
    wait_screen(terminal, r"step ([1-9]\d*)/\d+", 120, "the console's first step")
    ACTIONS["ddp"](terminal)
    terminal.close()   # the terminal goes: the console gets SIGHUP
    pids = [*run_pids(tmp_path / "runs"), int((tmp_path / "demo.pid").read_text())]
    wait_for(lambda: not any(pid_alive(p) for p in pids), 60, "the demo and every process of its run to be gone")
    log = (tmp_path / "runs" / "demo-ddp" / "demo.log").read_text()
    assert "stopped by SIGINT; latest checkpoint:" in log, log


def test_every_demo_is_tested_and_its_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # llm's files go to ./runs/demo-llm-data
    from demo import DEMOS
    from demo.launch import demo_overrides
    from engine.config import load_config
    assert set(DEMOS) == set(ACTIONS)
    for name, demo in DEMOS.items():
        cfg = load_config(demo.path, demo_overrides(name))
        assert cfg.run.name == f"demo-{name}" and cfg.run.overwrite
        assert cfg.parallel.world_size <= 6, name
    llm = load_config(DEMOS["llm"].path, demo_overrides("llm"))
    assert (llm.model.name, llm.data.name) == ("hf", "tokens")
    assert sorted(p.name for p in (tmp_path / "runs" / "demo-llm-data").iterdir()) == \
        ["corpus.txt", "llama.json", "meta.json", "tokenizer", "train.bin", "val.bin"]   # demo/prepare.py


def test_a_demo_run_takes_a_new_name_while_its_previous_run_is_live(tmp_path, runtime_dir):
    from demo import run_name
    runs = tmp_path / "runs"
    assert run_name("tour", runs) == "demo-tour"
    from engine.run.claim import Claim
    claim = Claim.take(runs / "demo-tour", 0, "demo-tour")   # still going: its launcher holds the folder
    assert run_name("tour", runs) == "demo-tour-2"
    claim.release()   # finished (or killed: the kernel releases it): overwritten
    assert run_name("tour", runs) == "demo-tour"
    claim = Claim.take(runs / "demo-tour", 0, "demo-tour")
    (runtime_dir / "demo-tour-2.json").write_text(f'{{"run": "demo-tour-2", "pid": {os.getpid()}}}')
    assert run_name("tour", runs) == "demo-tour-3"
