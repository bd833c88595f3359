"""Trackers beside the console (docs/telemetry.md, Trackers): the feed's bounded queue and its thread, a tracker
that fails, TensorBoard and W&B resumes in-process; then one short run with both on, read back with TensorBoard's
EventAccumulator and W&B's own record format, and a run whose trackers both fail, whose losses are the same."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from engine.config import ConfigError, config_from_dict
from engine.config import extras
from engine.telemetry.log import TelemetryLog
from engine.telemetry.records import log_parts
from engine.telemetry.trackers.feed import TrackerFeed
from engine.telemetry.trackers.follow import LogFollower
from engine.telemetry.trackers.tensorboard_run import TensorBoardTracker
from engine.telemetry.trackers.wandb_run import WandbTracker
from tests.conftest import CLI, ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")
STEPS = 6


class Recorder:
    """A tracker that keeps every call; `gate`: its first call waits for it."""

    def __init__(self, name: str = "recorder", gate: threading.Event | None = None):
        self.name, self.where, self.gate = name, f"{name} in memory", gate
        self.entered, self.calls = threading.Event(), []

    def __getattr__(self, call: str):
        if call not in ("start", "scalars", "text", "close"):
            raise AttributeError(call)

        def record(*args):
            self.entered.set()
            if self.gate is not None:
                self.gate.wait()
            self.calls.append((call, *args))
        return record


class Raising:
    name, where = "raising", "nowhere"

    def __getattr__(self, call: str):
        def fail(*args):
            raise OSError(f"{call} failed")
        return fail


def records(steps: int, first: int = 0, offset: float = 0.0) -> list[dict]:
    start = {"type": "run_start", "name": "t", "first_step": first, "config": {"run": {"seed": 0}}}
    return [start, *({"type": "step", "step": s, "loss": offset + s, "lr": 0.1} for s in range(first + 1, steps + 1))]


def test_the_feed_drops_and_counts_what_does_not_fit_and_its_thread_ends_at_close():
    gate = threading.Event()
    tracker = Recorder(gate=gate)
    feed = TrackerFeed([tracker], queue_len=2)
    feed.put({"type": "step", "step": 1, "loss": 1.0})
    assert tracker.entered.wait(30)   # the thread holds step 1; the queue holds two more
    for step in range(2, 7):
        feed.put({"type": "step", "step": step, "loss": float(step)})
    assert feed.dropped == 3
    gate.set()
    assert feed.close(timeout_s=30)
    assert not feed._thread.is_alive()
    assert [c[1] for c in tracker.calls if c[0] == "scalars"] == [1, 2, 3]
    assert tracker.calls[-1] == ("close",)
    assert "3 log records dropped" in feed.closing_line(True)


def test_a_tracker_that_raises_on_every_call_is_said_once_and_the_others_go_on(capsys):
    good = Recorder()
    feed = TrackerFeed([Raising(), good], queue_len=64)
    for record in [*records(4), {"type": "event", "kind": "eval", "step": 4, "test_accuracy": 0.5,
                                 "val_loss": 1.5, "perplexity": None},
                   {"type": "event", "kind": "migration", "step": 4, "moves": [["fc2", 1, 0]]}]:
        feed.put(record)
    assert feed.close(timeout_s=30)
    said = capsys.readouterr().err
    assert said.count("the raising tracker failed") == 1 and "OSError: start failed" in said
    assert [c[0] for c in good.calls] == ["start", *["scalars"] * 5, "text", "close"]
    assert good.calls[1] == ("scalars", 1, {"train/loss": 1.0, "train/lr": 0.1})
    assert good.calls[5] == ("scalars", 4, {"eval/test_accuracy": 0.5, "eval/val_loss": 1.5})
    assert good.calls[6][1:3] == (4, "events/migration") and '"moves"' in good.calls[6][3]
    assert "raising failed (said above)" in feed.closing_line(True)


def test_the_follower_reads_every_part_written_after_it_began(tmp_path):
    log = TelemetryLog(tmp_path / "run.jsonl", max_bytes=400)   # a part every few records
    log.write({"type": "step", "step": 0, "loss": 0.0, "ranks": [{"rank": 0, "peak_bytes": 1}]})   # an earlier launch's
    got = []
    follower = LogFollower(tmp_path / "run.jsonl", got.append)
    follower.start()
    log.write({"type": "run_start", "name": "t", "first_step": 0})
    log.write({"type": "step", "step": 1, "loss": 1.0, "ranks": [{"rank": 0, "peak_bytes": 7}]})
    for step in range(2, 12):   # between full rows, the compact columns: filled in as every reader does
        log.write({"type": "step", "step": step, "loss": float(step),
                   "per_rank": {"step_ms": [1.0], "peak": [step]}})
    log.close()
    follower.stop()
    assert len(log_parts(tmp_path / "run.jsonl")) > 2
    assert [r.get("step") for r in got] == [None, *range(1, 12)]
    assert [r["ranks"][0]["peak_bytes"] for r in got[1:]] == [7, *range(2, 12)]


def scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_a_resumed_tensorboard_run_drops_the_steps_past_its_checkpoint(tmp_path):
    first = TensorBoardTracker(tmp_path / "tb", resumed=False)
    first.start(records(5)[0])
    for r in records(5)[1:]:
        first.scalars(r["step"], {"train/loss": r["loss"]})
    first.close()
    again = TensorBoardTracker(tmp_path / "tb", resumed=True)   # from the checkpoint at step 3
    again.start(records(6, first=3)[0])
    for r in records(6, first=3, offset=10)[1:]:
        again.scalars(r["step"], {"train/loss": r["loss"]})
    again.close()
    assert scalars(tmp_path / "tb", "train/loss") == {1: 1, 2: 2, 3: 3, 4: 14, 5: 15, 6: 16}


def wandb_records(run_folder: Path):
    """The records of an offline W&B run's .wandb file: W&B's header, then a LevelDB-style log (32 KiB blocks,
    each chunk a 7-byte header: crc, length, type) of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = next(run_folder.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:   # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # a full record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_history(run_folder: Path) -> dict[int, dict]:
    rows = {}
    for record in wandb_records(run_folder):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows[row["_step"]] = row
    return rows


def wandb_config(run_folder: Path) -> dict:
    for record in wandb_records(run_folder):
        if record.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return {}


def wandb_services(pid: int) -> list[psutil.Process]:
    """The W&B service processes started for process `pid` (it passes `--pid PID`), still alive."""
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "wandb-core" in (p.info["name"] or "") and str(pid) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


@contextmanager
def environ(**values):
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for key in (k for k, v in values.items() if v is None):
        os.environ.pop(key, None)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_an_offline_resumed_wandb_run_names_its_parent_and_its_service_ends(tmp_path):
    with environ(WANDB_MODE="offline", WANDB_API_KEY=None):
        first = WandbTracker("trainyard-tests", tmp_path, resumed=False)
        first.start(records(3)[0])
        first.scalars(1, {"train/loss": 1.0})
        first.close()
        again = WandbTracker("trainyard-tests", tmp_path, resumed=True)
        again.start(records(3, first=1)[0])
        again.scalars(2, {"train/loss": 2.0})
        again.close()
    assert wandb_services(os.getpid()) == []
    parent, child = (Path(t.run.dir).parent for t in (first, again))
    assert parent != child and (tmp_path / "wandb" / "run_id").read_text() == again.run.id
    assert wandb_config(child)["resumed_from"] == first.run.id
    assert wandb_history(child)[2]["train/loss"] == 2.0
    assert (tmp_path / "wandb" / "cache").is_dir()   # W&B's cache and service logs stay in the run folder


def test_a_tracker_whose_package_is_missing_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setattr(extras, "find_spec", lambda name: None if name == "wandb" else object())
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install -e '\.\[wandb\]'"):
        config_from_dict({"telemetry": {"tensorboard": True, "wandb": "p"}})
    config_from_dict({"telemetry": {"tensorboard": True}})


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    runtime = Path(tempfile.mkdtemp(prefix="ty", dir="/tmp"))   # short, for AF_UNIX paths
    cli = CLI(tmp_path_factory.mktemp("trackers"), runtime)
    yield cli
    cli.reap()
    import shutil
    shutil.rmtree(runtime, ignore_errors=True)


def run_demo(cli: CLI, name: str, **env):
    with environ(TRAINYARD_RUNTIME_DIR=str(cli.runtime_dir), **env):
        proc = cli.start("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args(name),
                         "--set", "parallel.world_size=1", "--set", "run.eval_every=3",
                         "--set", "checkpoint.every=0", "--set", "telemetry.tensorboard=true",
                         "--set", "telemetry.wandb=trainyard-tests")
    out, err = proc.communicate(timeout=150)
    run_dir = cli.tmp_path / "runs" / name
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "telemetry.jsonl") if r["type"] == "step"}
    return proc, err, run_dir, losses


@pytest.fixture(scope="module")
def tracked(runner):
    """One short run with both trackers on, W&B offline."""
    return run_demo(runner, "tracked", WANDB_MODE="offline", WANDB_API_KEY=None)


@pytest.mark.timeout(200)
def test_the_runs_tensorboard_scalars_are_the_logs(tracked):
    proc, err, run_dir, losses = tracked
    assert proc.returncode == 0, err
    assert len(losses) == STEPS
    assert scalars(run_dir / "tb", "train/loss") == pytest.approx(losses)
    assert set(scalars(run_dir / "tb", "memory/peak_bytes/rank0")) == set(losses)
    assert set(scalars(run_dir / "tb", "eval/test_accuracy")) == {3, 6}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")   # the config
    assert "events/checkpoint/text_summary" in acc.Tags()["tensors"]             # the events, as text
    assert "trackers: tensorboard in" in err and "no log record dropped" in err


@pytest.mark.timeout(200)
def test_the_runs_offline_wandb_history_is_the_logs(tracked):
    proc, err, run_dir, losses = tracked
    assert proc.returncode == 0, err
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    history = wandb_history(folder)
    assert {step: row["train/loss"] for step, row in history.items() if "train/loss" in row} == pytest.approx(losses)
    assert wandb_config(folder)["run"]["name"] == "tracked"
    assert wandb_services(proc.pid) == []
    assert f"upload: wandb sync {folder}" in err


@pytest.mark.timeout(200)
def test_failing_trackers_leave_the_losses_and_the_run_alone(runner, tracked):
    blocked = runner.tmp_path / "runs" / "failing"
    blocked.mkdir(parents=True)
    (blocked / "tb").write_text("a file where tb/ would go")
    # W&B online with no key: refused at its start, never a prompt
    proc, err, _, losses = run_demo(runner, "failing", WANDB_MODE="online", WANDB_API_KEY=None)
    assert proc.returncode == 0, err
    assert losses == tracked[3]
    assert err.count("the tensorboard tracker failed") == 1 and err.count("the wandb tracker failed") == 1
    assert wandb_services(proc.pid) == []
