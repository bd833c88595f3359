"""The telemetry hub, in process: real sockets, the protocol's own client, no training.

    /tmp/v/bin/python -m pytest tests/test_hub.py -q -p no:cacheprovider

The test thread plays the training worker (publish, take_commands, reply); clients are
engine.protocol connections, some driven from threads. Runtime folders live under a short
/tmp path, since a unix socket path may hold at most 107 bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from engine import protocol
from engine.processes import forkserver
from engine.telemetry.hub import Hub
from tests.conftest import ROOT, wait_for

HELLO = {"run": "hubtest", "mode": "ddp", "world_size": 2, "config": {"run": {"steps": 100}},
         "layout": {"ranks": [0, 1]}, "capabilities": ["pause", "resume", "stop", "checkpoint", "set-policy"]}
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def rundir():
    path = Path(tempfile.mkdtemp(prefix="ty", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hubs(rundir):
    """make(**kwargs) -> a started Hub in `rundir`; every hub is closed at teardown."""
    made = []

    def make(**kwargs) -> Hub:
        hub = Hub(kwargs.pop("hello", HELLO), directory=rundir, **kwargs)
        hub.start()
        made.append(hub)
        return hub
    yield make
    for hub in made:
        hub.close()


@pytest.fixture
def clients():
    """open(target, **kwargs) -> a protocol.Connection, closed at teardown."""
    opened = []

    def open_(target, **kwargs) -> protocol.Connection:
        conn = protocol.connect(str(target), **kwargs)
        opened.append(conn)
        return conn
    yield open_
    for conn in opened:
        conn.close()


def read_until(conn: protocol.Connection, predicate, timeout: float = 10.0) -> list[dict]:
    """Messages read up to and including the first that satisfies `predicate`."""
    seen = []
    while True:
        seen.append(conn.read(timeout))
        if predicate(seen[-1]):
            return seen


def step(n: int, **fields) -> dict:
    return {"type": "step", "step": n, "loss": 2.0 - n / 1000, "samples_per_s": 100.0, "step_ms": 1.0,
            "ranks": [], **fields}


def test_a_console_joining_between_full_rows_gets_every_ranks_row_in_its_snapshot(hubs, clients):
    hub = hubs()
    rows = [{"rank": r, "step_ms": 5.0, "compute_ms": 4.0, "wait_ms": 0.1, "used_bytes": 100, "peak_bytes": 200,
             "capacity_bytes": 1000, "rss_bytes": 7} for r in range(2)]
    hub.publish(step(1, ranks=rows))
    columns = protocol.rank_columns([{**e, "used_bytes": 150} for e in rows])
    hub.publish({k: v for k, v in step(2, per_rank=columns).items() if k != "ranks"})   # a step between full rows
    conn = clients(hub.socket_path)
    last = conn.read(5)["last_step"]
    assert last["step"] == 2 and "per_rank" not in last
    assert [(e["used_bytes"], e["capacity_bytes"], e["rss_bytes"]) for e in last["ranks"]] == [(150, 1000, 7)] * 2


def test_hello_then_snapshot_then_live_steps(hubs, clients):
    hub = hubs()
    hub.update_state(step=1, steps=100, paused=False, layers=[{"name": "fc0", "policy": "keep"}])
    hub.publish(step(1))
    hub.publish({"type": "event", "kind": "checkpoint", "step": 1, "path": "runs/x/step_1"})
    conn = clients(hub.socket_path)
    assert conn.hello["type"] == "hello" and conn.hello["protocol"] == protocol.VERSION
    assert conn.hello["run"] == "hubtest" and conn.hello["world_size"] == 2
    assert conn.hello["capabilities"] == HELLO["capabilities"]
    snapshot = conn.read(5)
    assert snapshot["type"] == "snapshot"
    assert snapshot["last_step"]["step"] == 1 and snapshot["steps"] == 100 and snapshot["paused"] is False
    assert snapshot["layers"][0]["name"] == "fc0"
    assert [e["kind"] for e in snapshot["events"]] == ["checkpoint"]
    hub.publish({"type": "log_only", "steps": 3})   # a type clients do not know is not forwarded
    for n in (2, 3):
        hub.publish(step(n, time_split={"compute_ms": 1.0, "comm_ms": 0.5, "wait_ms": 0.1}))
    assert [conn.read(5)["step"] for _ in range(2)] == [2, 3]
    hub.publish({"type": "summary", "steps": 3})
    assert conn.read(5) == {"v": protocol.VERSION, "type": "summary", "steps": 3}


def test_without_a_console_nothing_wakes_the_loop_until_one_connects_or_the_inbox_is_half_full(hubs, clients):
    """engine/telemetry/hub.py `_submit`: a step or a state update given while no console is connected waits
    for the next connection (a wake a step cost the step loop a thread switch); the console still gets it all."""
    from engine.telemetry.hub import INBOX_MAX
    hub = hubs()
    wakes = []
    drain = hub._drain_inbox
    hub._drain_inbox = lambda: (wakes.append(len(hub._published)), drain())[1]
    for n in range(1, 11):
        hub.update_state(step=n)
        hub.publish(step(n))
    hub.publish({"type": "event", "kind": "checkpoint", "step": 10, "path": "runs/x/step_10"})
    assert wakes == [] and len(hub._published) == 11
    conn = clients(hub.socket_path)
    snapshot = conn.read(5)
    assert snapshot["step"] == 10 and snapshot["last_step"]["step"] == 10
    assert [e["kind"] for e in snapshot["events"]] == ["checkpoint"]
    hub.publish(step(11))   # with a console: at once
    assert conn.read(5)["step"] == 11
    conn.close()
    wait_for(lambda: hub.client_count == 0, 5, "the console gone")
    wakes.clear()
    for n in range(12, 12 + INBOX_MAX // 2):
        hub.publish(step(n))
    wait_for(lambda: wakes, 5, "a wake")   # half full: the loop takes them, so none is shed
    assert wakes[0] == INBOX_MAX // 2


def test_many_clients_all_receive_every_message(hubs, clients):
    hub = hubs()
    conns = [clients(hub.socket_path, client=f"c{i}") for i in range(12)]
    for conn in conns:
        assert conn.read(5)["type"] == "snapshot"
    assert hub.client_count == 12
    for n in range(1, 51):
        hub.publish(step(n))
    for conn in conns:
        assert [conn.read(5)["step"] for _ in range(50)] == list(range(1, 51))


def test_socket_is_private_and_registered(hubs, rundir, monkeypatch):
    hub = hubs()
    assert hub.socket_path == rundir / "hubtest.sock"
    assert stat.S_IMODE(hub.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((rundir / "hubtest.json").stat().st_mode) == 0o600
    monkeypatch.setenv("TRAINYARD_RUNTIME_DIR", str(rundir))
    [run] = protocol.list_runs()
    assert run["name"] == "hubtest" and run["pid"] == os.getpid() and run["uid"] == os.getuid()
    assert run["socket"] == str(hub.socket_path) and run["mode"] == "ddp" and run["world_size"] == 2
    assert run["tcp"] is None and run["token_file"] is None


def test_a_live_name_gets_the_pid_and_a_stale_socket_is_replaced(hubs, rundir):
    first = hubs()
    second = hubs()
    assert second.socket_path.name == f"hubtest-{os.getpid()}.sock"
    assert first.socket_path.exists() and second.socket_path.exists()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # a run that died without cleaning up
    stale.bind(str(rundir / "gone.sock"))
    stale.close()
    assert hubs(hello={**HELLO, "run": "gone"}).socket_path.name == "gone.sock"


def test_tcp_needs_the_token(hubs, clients):
    hub = hubs(listen="tcp://127.0.0.1:0")
    assert hub.tcp_address.startswith("tcp://127.0.0.1:") and not hub.tcp_address.endswith(":0")
    assert stat.S_IMODE(hub.token_path.stat().st_mode) == 0o600
    with pytest.raises(ConnectionRefusedError, match="token"):
        clients(hub.tcp_address)
    with pytest.raises(ConnectionRefusedError, match="token"):
        clients(hub.tcp_address, token="0" * 32)
    conn = clients(hub.tcp_address, token=hub.token_path.read_text().strip())
    assert conn.read(5)["type"] == "snapshot"
    hub.publish(step(1))
    assert conn.read(5)["step"] == 1


@pytest.mark.parametrize("listen", ["tcp://0.0.0.0:0", "tcp://192.168.1.5:7000", "tcp://example.com:7000"])
def test_only_loopback_is_served(listen):
    with pytest.raises(ValueError, match="only loopback addresses|expected tcp://"):
        Hub(HELLO, listen=listen)


def test_garbage_gets_an_error_and_the_connection_goes_on(hubs, clients):
    conn = clients(hubs().socket_path)
    conn.read(5)
    conn.sock.sendall(b"this is not json\n")
    error = read_until(conn, lambda m: m["type"] != "snapshot")[-1]
    assert error["type"] == "error" and "not JSON" in error["reason"]
    conn.sock.sendall(b"[" * 60000 + b"\n")   # nested too deep for the JSON parser
    assert conn.read(5)["type"] == "error"
    conn.send({"type": "ping", "id": 7})
    assert conn.read(5) == {"v": protocol.VERSION, "type": "pong", "id": 7}


def test_unknown_type_and_bad_version_are_errors(hubs, clients):
    conn = clients(hubs().socket_path)
    conn.read(5)
    conn.send({"type": "frobnicate"})
    assert "unknown message type 'frobnicate'" in conn.read(5)["reason"]
    conn.sock.sendall(b'{"v":99,"type":"command","id":"c9","name":"pause","args":[]}\n')
    error = conn.read(5)
    assert error["type"] == "error" and "version 99" in error["reason"]
    conn.send({"type": "ping", "id": "still-here"})
    assert conn.read(5)["type"] == "pong"


def test_an_oversized_line_is_refused_and_the_connection_closed(hubs, clients):
    hub = hubs()
    conn = clients(hub.socket_path)
    conn.read(5)
    conn.sock.sendall(b'{"v":1,"type":"ping","pad":"' + b"x" * protocol.MAX_CLIENT_LINE_BYTES + b'"}\n')
    error = conn.read(5)
    assert error["type"] == "error" and error["reason"] == f"message longer than {protocol.MAX_CLIENT_LINE_BYTES} bytes"
    with pytest.raises(EOFError):
        conn.read(5)
    other = clients(hub.socket_path)           # the hub itself is fine
    assert other.read(5)["type"] == "snapshot"


def test_command_pending_then_applied_reaches_only_its_sender(hubs, clients):
    hub = hubs()
    conn, bystander = clients(hub.socket_path), clients(hub.socket_path)
    conn.read(5), bystander.read(5)
    conn.send({"type": "command", "id": "a1", "name": "set-policy", "args": ["fc0", "swap"]})
    assert conn.read(5) == {"v": 1, "type": "reply", "id": "a1", "name": "set-policy", "status": "pending"}
    [command] = wait_for(hub.take_commands, 5, "the command to be queued")
    assert {k: command[k] for k in ("id", "name", "args")} == {"id": "a1", "name": "set-policy",
                                                                "args": ["fc0", "swap"]}
    assert hub.take_commands() == []
    hub.reply(command, "applied", step=5)
    hub.publish(step(5))
    reply = conn.read(5)
    assert reply["type"] == "reply" and reply["status"] == "applied" and reply["step"] == 5 and reply["id"] == "a1"
    assert [m["type"] for m in read_until(bystander, lambda m: m["type"] == "step")] == ["step"]


def test_command_from_a_client_thread(hubs, clients):
    hub = hubs()
    conn = clients(hub.socket_path)
    result = {}
    thread = threading.Thread(target=lambda: result.update(conn.command("pause", timeout=20)))
    thread.start()
    [command] = wait_for(hub.take_commands, 10, "the pause command")
    hub.reply(command, "applied", step=5)
    thread.join(20)
    assert result["status"] == "applied" and result["step"] == 5 and result["name"] == "pause"


def test_rejections(hubs, clients):
    def validate(name, args):
        if name == "checkpoint":
            raise RuntimeError("boom")
        if name == "set-policy" and args[0] != "fc0":
            return f"unknown layer {args[0]!r}"
        return None if name in HELLO["capabilities"] else f"{name} is not available in mode ddp"
    hub = hubs(validate=validate)
    conn = clients(hub.socket_path)
    cases = [(("set-policy", "nope", "swap"), "unknown layer 'nope'"),
             (("set-sync", "soft"), "not available in mode ddp"),
             (("set-policy", "fc0", "bogus"), "policy must be one of"),
             (("warp-speed",), "unknown command"),
             (("pause", "now"), "takes 0 argument"),
             (("checkpoint",), "could not check")]
    for (name, *args), reason in cases:
        reply = conn.command(name, *args, timeout=5)
        assert reply["status"] == "rejected" and reason in reply["reason"], reply
    conn.send({"type": "command", "name": "pause", "args": []})
    assert "needs an `id`" in read_until(conn, lambda m: m["type"] == "reply")[-1]["reason"]
    assert hub.take_commands() == []


def test_read_only_connection_cannot_command(hubs, clients):
    hub = hubs()
    reply = clients(hub.socket_path, read_only=True).command("pause", timeout=5)
    assert reply["status"] == "rejected" and reply["reason"] == "this connection is read-only"
    assert hub.take_commands() == []


PAYLOAD = "x" * 2000


def test_a_client_that_never_reads_loses_the_oldest_and_is_told(hubs, clients):
    hub = hubs(queue_len=16, stall_timeout_s=25)
    silent = clients(hub.socket_path)             # reads its hello, then nothing for a while
    watcher = clients(hub.socket_path)
    for n in range(1, 20001):                     # ~40 MB: far more than any socket buffer
        hub.publish(step(n, pad=PAYLOAD))
    for conn in (watcher, silent):
        seen = read_until(conn, lambda m: m.get("step") == 20000, timeout=20)
        dropped = sum(m["count"] for m in seen if m["type"] == "dropped")
        steps = [m["step"] for m in seen if m["type"] == "step"]
        assert dropped > 0 and steps == sorted(steps)
        assert len(steps) + dropped == 20000      # every message arrived or was counted


def test_a_stalled_client_is_disconnected(hubs, clients):
    hub = hubs(queue_len=8, stall_timeout_s=0.5)
    silent = clients(hub.socket_path)
    for n in range(1, 301):                       # 64 KB each: the queue alone outgrows the socket buffers
        hub.publish(step(n, pad="x" * 65536))
    wait_for(lambda: hub.client_count == 0, 20, "the stalled client to be dropped")
    types = {m["type"] for m in silent.messages(timeout=10)}  # what was buffered, then the end
    assert "bye" not in types
    fresh = clients(hub.socket_path)
    assert fresh.read(5)["last_step"]["step"] == 300
    hub.publish(step(301))
    assert fresh.read(5)["step"] == 301


def test_clients_that_misbehave_on_the_way_in(hubs, clients):
    hub = hubs()
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # connects, says nothing
    mute.connect(str(hub.socket_path))
    rude = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # skips the hello
    rude.connect(str(hub.socket_path))
    rude.sendall(protocol.encode({"type": "ping", "id": 1}))
    rude.settimeout(5)
    assert b"first message must be a hello" in rude.recv(4096)
    assert rude.recv(4096) == b""
    gone = clients(hub.socket_path)
    gone.close()                                              # vanishes mid-stream
    conn = clients(hub.socket_path)
    conn.read(5)
    hub.publish(step(1))
    assert conn.read(5)["step"] == 1
    mute.close(), rude.close()


def test_close_says_bye_and_removes_the_files(hubs, clients, rundir):
    hub = hubs(listen="tcp://127.0.0.1:0")
    conn = clients(hub.socket_path)
    conn.read(5)
    files = [hub.socket_path, hub.registry_path, hub.token_path]
    assert all(path.exists() for path in files)
    hub.publish(step(7))
    hub.close("stopped by the test")
    assert conn.read(5)["step"] == 7
    assert conn.read(5) == {"v": 1, "type": "bye", "reason": "stopped by the test"}
    with pytest.raises(EOFError):
        conn.read(5)
    assert not any(path.exists() for path in files) and list(rundir.iterdir()) == []
    hub.publish(step(8)), hub.update_state(step=8), hub.reply({"id": "x", "name": "pause"}, "applied", step=8)
    assert hub.take_commands() == []
    hub.close()


def test_starts_inside_a_running_event_loop(rundir):
    """A console test may run a hub inside its own asyncio loop: the hub's loop is its own."""
    async def main():
        hub = Hub(HELLO, directory=rundir)
        hub.start()
        try:
            conn = await asyncio.to_thread(protocol.connect, str(hub.socket_path))
            hub.publish(step(1))
            assert (await asyncio.to_thread(conn.read, 5))["type"] == "snapshot"
            assert (await asyncio.to_thread(conn.read, 5))["step"] == 1
            conn.close()
        finally:
            hub.close()
    asyncio.run(main())


def raw_line(conn: protocol.Connection) -> bytes:
    """The hub's next line as it was sent."""
    while b"\n" not in conn._buffer:
        conn._buffer += conn.sock.recv(65536)
    line, conn._buffer = conn._buffer.split(b"\n", 1)
    return line


def strict(line: bytes) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} in {line[:200]!r}: not JSON")
    return json.loads(line, parse_constant=refuse)


def test_a_non_finite_id_is_refused_as_malformed_and_every_answer_is_strict_json(hubs, clients):
    hub = hubs()
    conn = clients(hub.socket_path)
    conn.read(5)
    for bad, reason in ((b'"id":1e999', "not JSON (the number 1e999 is out of range)"),
                        (b'"id":NaN', "not JSON (NaN is not a JSON value)"),
                        (b'"id":-Infinity', "not JSON (-Infinity is not a JSON value)")):
        for kind in (b'"type":"command","name":"pause","args":[]', b'"type":"ping"'):
            conn.sock.sendall(b'{"v":1,' + kind + b"," + bad + b"}\n")
            assert strict(raw_line(conn)) == {"v": 1, "type": "error", "reason": reason}
    assert hub.take_commands() == []
    hub.publish(step(1, loss=float("nan"), ranks=[{"rank": 0, "step_ms": float("inf")}]))
    sent = strict(raw_line(conn))
    assert sent["loss"] is None and sent["ranks"][0]["step_ms"] is None
    assert sent["nonfinite"] == ["loss", "ranks.0.step_ms"]
    conn.send({"type": "ping", "id": 2})   # the connection goes on
    assert strict(raw_line(conn)) == {"v": 1, "type": "pong", "id": 2}


def test_a_burst_of_100_consoles_all_get_in(hubs):
    hub = hubs()
    start, results = threading.Barrier(100), []

    def attach(number: int) -> None:
        start.wait()
        try:
            with protocol.connect(str(hub.socket_path), client=f"c{number}", read_only=True) as conn:
                results.append(conn.read(10)["type"])
        except Exception as e:   # noqa: BLE001 - counted below
            results.append(repr(e))
    threads = [threading.Thread(target=attach, args=(n,)) for n in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == ["snapshot"] * 100


def test_connect_waits_out_a_full_listen_queue(rundir):
    path = str(rundir / "busy.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    first = protocol.connect_unix(path, 5)   # the queue's one place
    with pytest.raises(BlockingIOError):     # a plain connect is told EAGAIN at once
        plain = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        plain.settimeout(5)
        try:
            plain.connect(path)
        finally:
            plain.close()
    accepted = []
    taker = threading.Timer(0.3, lambda: accepted.extend(server.accept() for _ in range(2)))
    taker.start()
    second = protocol.connect_unix(path, 5)   # tried again until the queue has room
    taker.join(5)
    assert len(accepted) == 2
    for sock in (first, second, server, *(s for s, _ in accepted)):
        sock.close()
    with pytest.raises(ConnectionRefusedError):   # nobody listens: refused after CONNECT_RETRY_S, not forever
        protocol.connect_unix(path, 0.2)


@pytest.mark.own_fork_server
def test_the_fork_servers_folder_is_private(rundir, monkeypatch):
    import multiprocessing
    from multiprocessing import forkserver as mp_forkserver

    from engine.processes import forkserver
    monkeypatch.setenv("TRAINYARD_RUNTIME_DIR", str(rundir))
    monkeypatch.setattr(forkserver, "_started", False)
    monkeypatch.setattr(forkserver, "gpu_visible", lambda: False)
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", lambda modules: None)
    monkeypatch.setattr(mp_forkserver, "ensure_running", lambda: None)   # no server: only its folder
    folder = rundir / f"forkserver-{os.getpid()}"
    folder.mkdir(mode=0o755)   # left with a wider mode: made private all the same
    os.chmod(folder, 0o755)
    assert forkserver.start()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


SHARED_LAUNCHER = """
import multiprocessing, os, sys
from engine.processes import forkserver
from tests.test_hub import report_inherited
assert forkserver.start() and forkserver._shared, "did not join the shared server"
os.environ["TRAINYARD_TEST_MINE"] = "the launcher's"
child = multiprocessing.get_context("forkserver").Process(target=report_inherited, args=(forkserver.Inherit(),))
child.start()
child.join(60)
print("child exit", child.exitcode, flush=True)
"""


def report_inherited(_inherited) -> None:
    """A child of a launcher that joined a shared fork server: what it took from its launcher."""
    print(f"child of {os.getppid()}: {os.environ.get('TRAINYARD_TEST_MINE')}", flush=True)
    print("and to its stderr", file=sys.stderr, flush=True)


@pytest.mark.timeout(90)
def test_a_launcher_forks_from_the_shared_server_with_its_own_environment_and_output():
    """TRAINYARD_FORK_SERVER (the session's own, conftest.py): a launcher forks from it, and its child has the
    launcher's environment (set after the server started) and writes to the launcher's stdout and stderr."""
    shared = os.environ[forkserver.SHARED]
    server = int(shared.partition(":")[0])
    out = subprocess.run([sys.executable, "-c", SHARED_LAUNCHER], cwd=ROOT, capture_output=True, text=True,
                         timeout=80)
    assert out.returncode == 0, out.stderr
    assert f"child of {server}: the launcher's\nchild exit 0\n" in out.stdout, (out.stdout, out.stderr)
    assert "and to its stderr" in out.stderr


def test_a_shared_fork_server_that_is_gone_is_not_joined(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    socket = tmp_path / "listener"
    socket.touch()
    assert not forkserver._join(f"{gone.pid}:{socket}")   # its process is gone
    assert not forkserver._join(f"{os.getpid()}:{tmp_path / 'missing'}")   # its socket is gone
    assert not forkserver._join("garbage")
