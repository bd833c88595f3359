"""A live run's socket: telemetry out, commands in, nothing a client does disturbs training."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import jsonschema
import pytest

from engine import protocol
import torch

from engine.runtime.checkpoint import list_checkpoints, model_state, verify
from engine.telemetry.schema import RECORD_SCHEMA
from tests.conftest import ROOT, read_jsonl, wait_for
from tests.test_training import single_process_reference

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


def start_live(cli, name: str, *extra: str, steps: int = 100000, pause_ms: int = 20):
    proc = cli.start("run", DEMO, "--headless", "--steps", str(steps), *cli.base_args(name),
                     "--set", f"run.step_pause_ms={pause_ms}", *extra)
    wait_for(lambda: any(r["name"] == name for r in protocol.list_runs()), 40, f"run {name} on the socket")
    return proc


def current_step(name: str) -> int:
    with protocol.connect(name, read_only=True) as conn:
        return conn.read(timeout=5)["step"]


def ctl(cli, *args):
    return cli.run("ctl", *args, timeout=60)


@pytest.mark.timeout(90)
def test_a_client_gets_hello_snapshot_and_schema_valid_steps(cli):
    proc = start_live(cli, "watch", "--set", "telemetry.layer_every=5", "--set", "telemetry.live_hz=0")
    with protocol.connect("watch", client="test") as conn:
        assert conn.hello["run"] == "watch" and conn.hello["mode"] == "ddp" and conn.hello["world_size"] == 2
        assert conn.hello["protocol"] == protocol.VERSION
        assert set(conn.hello["capabilities"]) == {"pause", "resume", "stop", "checkpoint", "set-placement",
                                                       "set-policy"}
        snapshot = conn.read(timeout=5)
        assert snapshot["type"] == "snapshot" and snapshot["steps"] == 100000
        steps = []
        validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
        while len(steps) < 12:
            msg = conn.read(timeout=10)
            if msg["type"] in ("step", "event"):
                validator.validate({k: v for k, v in msg.items() if k != "v"})
            if msg["type"] == "step":
                steps.append(msg)
    numbers = [m["step"] for m in steps]
    assert numbers == list(range(numbers[0], numbers[0] + 12))
    assert any("layers" in m for m in steps)
    layer_rows = next(m["layers"] for m in steps if "layers" in m)
    assert [r["name"] for r in layer_rows] == ["fc0", "act0", "fc1", "act1", "head"]
    assert all(m["streams"][0]["bytes"] > 0 for m in steps)   # DDP's all-reduce was metered
    assert proc.poll() is None


@pytest.mark.timeout(150)
def test_commands_pause_resume_reject_and_stop(cli):
    log = cli.tmp_path / "run.jsonl"
    proc = start_live(cli, "steer", "--telemetry-log", str(log))
    r = ctl(cli, "steer", "pause")
    assert r.returncode == 0 and "pause: applied at step" in r.stdout
    paused_at = int(r.stdout.rsplit(" ", 1)[1])
    time.sleep(1.0)
    assert current_step("steer") == paused_at            # no step while paused

    r = ctl(cli, "steer", "resume")
    assert r.returncode == 0 and f"applied at step {paused_at}" in r.stdout
    wait_for(lambda: current_step("steer") > paused_at + 5, 20, "steps after resume")

    r = ctl(cli, "steer", "set-policy", "blocks.3", "recompute")
    assert r.returncode == 1 and "unknown layer 'blocks.3'" in r.stderr
    r = ctl(cli, "steer", "set-policy", "act1", "swap")   # act1's saved output goes to the host and back
    assert r.returncode == 0 and "set-policy act1 swap: applied at step" in r.stdout
    swapped_at = int(r.stdout.rsplit(" ", 1)[1])
    # a copy still queued when backward frees its tensor is skipped (the link's thread may not get a core
    # before act1's backward on a busy machine), so wait for a step that did copy rather than count on one
    wait_for(lambda: any(r["type"] == "step" and r["step"] > swapped_at + 1
                         and sum(e["swapped_out_bytes"] for e in r["ranks"]) > 0 for r in read_jsonl(log)),
             60, "a swapping step that copied act1's output to the host")
    r = ctl(cli, "steer", "set-policy", "fc0", "sometimes")
    assert r.returncode == 2 and "keep, swap, recompute" in r.stderr
    r = ctl(cli, "steer", "set-placement", "act0", "host")
    assert r.returncode == 1 and "has no parameters" in r.stderr
    r = ctl(cli, "steer", "set-placement", "fc1", "host")   # fc1's optimizer update moves to the host
    assert r.returncode == 0 and "set-placement fc1 host: applied at step" in r.stdout
    moved_at = int(r.stdout.rsplit(" ", 1)[1])
    wait_for(lambda: current_step("steer") > moved_at + 3, 20, "steps after the move")

    r = ctl(cli, "steer", "stop")
    assert r.returncode == 0
    stopped_at = int(r.stdout.rsplit(" ", 1)[1])
    proc.wait(timeout=30)
    assert proc.returncode == 0
    assert verify(list_checkpoints(cli.tmp_path / "runs" / "steer")[-1])["step"] == stopped_at
    records = read_jsonl(log)
    assert records[-1]["type"] == "summary" and records[-1]["stopped_early"]
    rejected = [r for r in records if r.get("kind") == "command" and r["status"] == "rejected"]
    assert [r["reason"] for r in rejected] == ["unknown layer 'blocks.3'",
                                               "layer 'act0' has no parameters: it has no optimizer update to place"]
    policies = [r for r in records if r.get("kind") == "policy"]
    assert [(p["step"], p["layer"], p["policy"]) for p in policies] == [(swapped_at, "act1", "swap")]
    swapping = [r for r in records if r["type"] == "step" and r["step"] > swapped_at + 1]
    next_step = next(r for r in records if r["type"] == "step" and r["step"] == swapped_at + 1)
    assert {row["name"]: row["policy"] for row in next_step["layers"]}["act1"] == "swap"   # the layer table follows
    assert swapping and all(e["swap_layers"] == 1 for r in swapping for e in r["ranks"])
    assert sum(e["swapped_out_bytes"] for r in swapping for e in r["ranks"]) > 0
    assert all(e["link_wait_ms"] >= 0 for r in swapping for e in r["ranks"])   # the compute's waits for the link
    moves = [r for r in records if r.get("kind") == "placement"]
    assert [(m["step"], m["layer"], m["placement"]) for m in moves] == [(moved_at, "fc1", "host")]
    # the step the reply named is where the update moved, and the result is the same computation
    placed = {r["step"]: {e["name"]: e.get("placement") for e in r["layers"]} for r in records
              if r["type"] == "step" and "layers" in r}
    assert all(p["fc1"] == ("host" if s > moved_at else "device") for s, p in placed.items())
    got = model_state(list_checkpoints(cli.tmp_path / "runs" / "steer")[-1])
    want = single_process_reference([], stopped_at)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    assert not protocol.list_runs()      # socket and registry entry are gone


@pytest.mark.timeout(90)
def test_garbage_gets_an_error_and_training_goes_on(cli):
    start_live(cli, "rude")
    info = protocol.find_run("rude")
    assert stat.S_IMODE(os.stat(info["socket"]).st_mode) == 0o600
    with socket.socket(socket.AF_UNIX) as raw:
        raw.settimeout(10)
        raw.connect(info["socket"])
        raw.sendall(b"this is not json\n")
        reply = json.loads(raw.makefile().readline())
        assert reply["type"] == "error" and ("hello" in reply["reason"] or "JSON" in reply["reason"])
    with protocol.connect("rude") as conn:
        conn.send({"type": "command", "id": 1, "name": "set-sync"})   # missing its argument
        conn.sock.sendall(b"{\"v\": 1, \"type\": \"command\", \"id\": 2, \"name\": \"pause\", \"args\": \n")
        conn.sock.sendall(b"\xff\xfe garbage\n")
        conn.send({"type": "ping", "id": "p"})
        answers = []
        while not answers or answers[-1]["type"] != "pong":
            msg = conn.read(timeout=10)
            if msg["type"] in ("reply", "error", "pong"):
                answers.append(msg)
        assert answers[0]["status"] == "rejected" and "set-sync takes 1 argument" in answers[0]["reason"]
        assert [a["type"] for a in answers[1:]] == ["error", "error", "pong"]
    before = current_step("rude")
    wait_for(lambda: current_step("rude") > before + 3, 20, "training to go on")


@pytest.mark.timeout(90)
def test_tcp_needs_the_token(cli):
    start_live(cli, "tcp", "--listen", "tcp://127.0.0.1:0")
    info = protocol.find_run("tcp")
    address, token_file = info["tcp"], info["token_file"]
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    with pytest.raises(ConnectionRefusedError, match="token"):
        protocol.connect(address)
    with pytest.raises(ConnectionRefusedError, match="token"):
        protocol.connect(address, token="0" * 32)
    with protocol.connect(address, token=open(token_file).read().strip()) as conn:
        assert conn.hello["run"] == "tcp"
    r = ctl(cli, address, "checkpoint", "--token-file", token_file)
    assert r.returncode == 0 and "checkpoint: applied" in r.stdout


@pytest.mark.timeout(120)
def test_a_client_that_never_reads_does_not_stop_training(cli):
    start_live(cli, "stuck", "--set", "telemetry.queue_len=8", pause_ms=5)
    info = protocol.find_run("stuck")
    sleeper = socket.socket(socket.AF_UNIX)
    sleeper.connect(info["socket"])
    sleeper.sendall(protocol.encode({"type": "hello", "client": "sleeper", "read_only": True}))
    sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    first = current_step("stuck")
    seen = [first]
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:    # 4 s of a client that reads nothing (its queue of 8 is full at once)
        time.sleep(1)
        seen.append(current_step("stuck"))
    sleeper.close()
    assert all(b > a for a, b in zip(seen, seen[1:])), seen
