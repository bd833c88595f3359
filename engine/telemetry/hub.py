"""The telemetry hub: rank 0's live feed to consoles, and their way in for commands.

    hub = Hub({"run": "digits-ddp", "mode": "ddp", "world_size": 2, "capabilities": ["pause", ...]},
              validate=check, listen="tcp://127.0.0.1:0")    # check(name, args) -> reason or None
    hub.start()                                    # binds, writes the registry file, starts its thread
    hub.publish({"type": "step", "step": 1, ...})  # returns at once; the hub owns the dict from now on
    hub.update_state(step=1, steps=100, paused=False)
    for command in hub.take_commands():            # {"id", "name", "args", "client"}, in arrival order
        ...; hub.reply(command, "applied", step=1)
    hub.close("run finished")                      # bye to every client; socket and files removed

One asyncio loop on a daemon thread serves every connection. The training thread only
appends to an inbox under a lock and wakes the loop, so no client can hold it up: each
client has a bounded queue that loses its oldest messages (and says how many), and a
client whose write stalls for `stall_timeout_s` is disconnected. The wire is
engine/telemetry/protocol.py, described in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hmac
import itertools
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from engine.telemetry import protocol
from engine.telemetry.client import Client, TooLong
from engine.telemetry.endpoint import free_stem, parse_listen, write_private
from engine.telemetry.protocol import MAX_CLIENT_LINE_BYTES, ProtocolError, encode

log = logging.getLogger("trainyard.hub")
RECENT_EVENTS = 200     # events a new client gets in its snapshot
INBOX_MAX = 4096        # published messages waiting for the loop thread; past that the oldest go
CLOSE_GRACE_S = 1.0     # how long close() lets clients take their last messages and bye
TOO_LONG = f"message longer than {MAX_CLIENT_LINE_BYTES} bytes"
BACKLOG = socket.SOMAXCONN   # connections waiting to be accepted: a burst of consoles (asyncio listens again)


class Hub:
    def __init__(self, hello: dict, *, validate=None, listen: str | None = None, queue_len: int = 256,
                 stall_timeout_s: float = 10.0, directory: Path | None = None, state: dict | None = None):
        self.hello = {**hello, "type": "hello", "protocol": protocol.VERSION}
        encode(self.hello)   # not JSON: fail here, not at every connection
        self.validate, self.queue_len, self.stall_timeout_s = validate, max(1, int(queue_len)), stall_timeout_s
        self.tcp_bind = parse_listen(listen) if listen else None
        self.directory = Path(directory) if directory else None
        self.socket_path = self.registry_path = self.token_path = self.tcp_address = self._token = None
        self._socks: list[tuple[str, socket.socket]] = []
        self._files: list[Path] = []         # what close() removes: only what this hub created
        self._loop = self._thread = self._failure = None
        self._bye_reason = "run finished"
        # shared with the training thread, under the lock
        self._lock = threading.Lock()
        self._published: collections.deque[dict] = collections.deque(maxlen=INBOX_MAX)
        self._replies: list[tuple[int, dict]] = []     # (client, reply): never shed
        # state updates, merged: they wake no loop (one a step cost the step a thread switch); the loop takes
        # them with what wakes it next (a publish, a reply), and before a new client's snapshot
        self._state_due: dict = {}
        self._lost, self._wake_pending, self._closed, self._commands = 0, False, False, []
        # the loop thread's alone
        self._state, self._last_step = dict(state or {}), None   # `state`: what the first snapshot holds
        self._events: collections.deque[dict] = collections.deque(maxlen=RECENT_EVENTS)
        self._clients: dict[int, Client] = {}
        self._writers: set[asyncio.StreamWriter] = set()   # every connection, greeted or not
        self._numbers = itertools.count(1)

    # --- called from the training thread --------------------------------------------

    def start(self) -> None:
        directory = self.directory or protocol.runtime_dir()
        try:
            stem = free_stem(directory, str(self.hello.get("run") or "run").replace("/", "_"))
            self.socket_path = directory / f"{stem}.sock"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socks.append(("unix", unix))
            unix.bind(str(self.socket_path))
            self._files.append(self.socket_path)
            os.chmod(self.socket_path, 0o600)   # before listen; the folder is 0700 besides
            unix.listen(BACKLOG)
            if self.tcp_bind:
                host, port = self.tcp_bind
                tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
                self._socks.append(("tcp", tcp))
                self.tcp_address = f"tcp://{f'[{host}]' if ':' in host else host}:{tcp.getsockname()[1]}"
                self._token, self.token_path = secrets.token_hex(16), directory / f"{stem}.token"
                self._files.append(self.token_path)
                write_private(self.token_path, self._token)
            self._loop, self._stopping, ready = asyncio.new_event_loop(), asyncio.Event(), threading.Event()
            self._thread = threading.Thread(target=self._run, args=(ready,), name="trainyard-hub", daemon=True)
            self._thread.start()
            if not ready.wait(10) or self._failure:
                raise RuntimeError(f"the hub's event loop did not start ({self._failure or 'timed out'})")
            self.registry_path = directory / f"{stem}.json"
            self._files.append(self.registry_path)
            write_private(self.registry_path, json.dumps({
                "name": stem, "run": self.hello.get("run"), "pid": os.getpid(), "mode": self.hello.get("mode"),
                "world_size": self.hello.get("world_size"), "max_world_size": self.hello.get("max_world_size"),
                "socket": str(self.socket_path),
                "tcp": self.tcp_address, "token_file": self.token_path and str(self.token_path),
                "started": round(time.time(), 3), "uid": os.getuid()}))
        except BaseException:
            self.close("the hub could not start")
            for _, sock in self._socks:
                sock.close()
            raise

    @property
    def client_count(self) -> int:
        """Clients connected now (past their hello)."""
        return len(self._clients)

    def publish(self, msg: dict) -> None:
        self._submit("publish", msg)

    def update_state(self, **fields) -> None:
        with self._lock:
            self._state_due.update(fields)

    def take_commands(self) -> list[dict]:
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def reply(self, command: dict, status: str, *, step: int | None = None, reason: str | None = None) -> None:
        try:
            msg = {"type": "reply", "id": command.get("id"), "name": command.get("name"), "status": status}
            msg.update({k: v for k, v in (("step", step), ("reason", reason)) if v is not None})
            self._submit("reply", (command.get("client"), msg))
        except Exception:
            log.exception("telemetry hub: could not reply to %r", command)

    def close(self, reason: str = "run finished") -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._thread is not None and self._thread.is_alive():
                self._bye_reason = reason
                self._loop.call_soon_threadsafe(self._stopping.set)
                self._thread.join(CLOSE_GRACE_S + 5)
        except Exception:
            log.exception("telemetry hub: trouble while closing")
        for path in self._files:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def _submit(self, kind: str, payload) -> None:
        """Hand something to the loop thread: a lock held for an append, never raises. Without a console a
        publish wakes no loop (a wake cost the step loop a thread switch, about 0.4 ms on this CPU) until the
        inbox is half full: the loop takes what waits at the next connection, before its snapshot."""
        with self._lock:
            if self._closed or (self._thread is not None and not self._thread.is_alive()):
                return
            if kind == "reply":
                self._replies.append(payload)
            else:   # the loop is far behind when this is full: shed the oldest, count them
                self._lost += len(self._published) == INBOX_MAX
                self._published.append(payload)
                if not self._clients and len(self._published) < INBOX_MAX // 2:
                    return   # no console to send it to: the loop takes it at the next connection (or later)
            if self._wake_pending or self._loop is None:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain_inbox)
        except RuntimeError:   # the loop has stopped
            pass

    # --- the loop thread --------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(ready))
        except BaseException as e:
            self._failure = e
            log.exception("telemetry hub: stopped")
        finally:
            ready.set()
            self._loop.close()

    async def _main(self, ready: threading.Event) -> None:
        servers = []
        for kind, sock in self._socks:
            serve = asyncio.start_unix_server if kind == "unix" else asyncio.start_server
            servers.append(await serve(functools.partial(self._serve, tcp=kind == "tcp"), sock=sock,
                                       limit=MAX_CLIENT_LINE_BYTES + 1, backlog=BACKLOG))
        ready.set()
        self._drain_inbox()      # what was published before start()
        await self._stopping.wait()
        for server in servers:
            server.close()
        self._drain_inbox()      # everything published before close() goes out before bye
        for client in self._clients.values():
            client.finish({"type": "bye", "reason": self._bye_reason})
        if writers := [c.task for c in self._clients.values()]:
            await asyncio.wait(writers, timeout=CLOSE_GRACE_S)
        for writer in self._writers:
            writer.transport.abort()   # each connection's task sees the end of its stream and returns
        if rest := [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            _, stuck = await asyncio.wait(rest, timeout=CLOSE_GRACE_S)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=CLOSE_GRACE_S)

    def _drain_inbox(self) -> None:
        with self._lock:
            replies, published, self._replies = self._replies, self._published, []
            self._published = collections.deque(maxlen=INBOX_MAX)
            lost, self._lost, self._wake_pending = self._lost, 0, False
            state, self._state_due = self._state_due, {}
        for key, value in state.items():
            try:
                encode({key: value})   # a field that cannot be sent would spoil every snapshot
                self._state[key] = value
            except (TypeError, ValueError):
                log.warning("telemetry hub: state %r not JSON-serialisable, ignored: %r", key, value)
        for number, reply in replies:   # to their senders
            if (client := self._clients.get(number)) is not None:
                client.send(reply)
        for client in self._clients.values():
            client.dropped += lost
        for msg in published:
            try:
                self._fan_out(msg)
            except Exception:
                log.exception("telemetry hub: could not send %r", msg)

    def _fan_out(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind not in protocol.SERVER_TYPES:   # a client would refuse it (a log-only record, say)
            return
        if kind == "step":   # a snapshot's last step has every rank's full row, whenever a console joins
            self._last_step = protocol.with_ranks(msg, self._last_step)
            if "step" in msg:
                self._state["step"] = msg["step"]
        elif kind == "event":
            self._events.append(msg)
        if self._clients:
            data = encode(msg)                  # once, shared by every client
            for client in self._clients.values():
                client.push(data)

    def _snapshot(self) -> dict:
        return {"type": "snapshot", **self._state, "last_step": self._last_step, "events": list(self._events)}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tcp: bool) -> None:
        client = None
        self._writers.add(writer)
        try:
            hello, refusal = await self._handshake(reader, writer, tcp)
            if hello is None:
                if refusal:
                    writer.write(encode({"type": "error", "reason": refusal}))
                writer.close()    # gently, so that the refusal is read before the end of the stream
                await asyncio.wait_for(writer.wait_closed(), self.stall_timeout_s)
                return
            client = Client(next(self._numbers), writer, bool(hello.get("read_only")), self.queue_len)
            client.send(self.hello)
            self._drain_inbox()   # the state updates merged since the last wake, in its snapshot
            client.send(self._snapshot())
            self._clients[client.number] = client
            self._drain_inbox()   # what came between the snapshot and now, which woke nothing without a client
            client.task = asyncio.create_task(self._write_loop(client))
            try:
                while (line := await read_line(reader)) and client.final is None:
                    self._handle(client, line)
                    while len(client.urgent) > self.queue_len and not writer.transport.is_closing():
                        await asyncio.sleep(0.01)   # it asks and does not read the answers: stop listening
            except TooLong:
                client.live.clear()
                client.finish({"type": "error", "reason": TOO_LONG})
                await asyncio.wait([client.task])
        except (OSError, asyncio.TimeoutError):   # the peer went away or stalled
            pass
        except Exception:
            log.warning("telemetry hub: a connection failed", exc_info=True)
        finally:
            self._writers.discard(writer)
            if client is not None:   # no task.cancel(): 3.11's wait_for can swallow it
                self._clients.pop(client.number, None)
                client.gone = True
                client.wake.set()
            if not writer.transport.is_closing():
                writer.transport.abort()

    async def _handshake(self, reader, writer, tcp: bool) -> tuple[dict | None, str | None]:
        """(the client's hello, None), or (None, why it is refused; "" to close without a word)."""
        if not tcp:
            creds = writer.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i"))
            if (uid := struct.unpack("3i", creds)[1]) != os.getuid():
                return None, f"uid {uid} may not connect: this run belongs to uid {os.getuid()}"
        try:
            line = await asyncio.wait_for(read_line(reader), self.stall_timeout_s)
            hello = protocol.decode(line) if line else None
        except asyncio.TimeoutError:
            return None, f"no hello within {self.stall_timeout_s:g} s"
        except TooLong:
            return None, TOO_LONG
        except ProtocolError as e:
            return None, str(e)
        if hello is None:   # gone before a word
            return None, ""
        if hello["type"] != "hello":
            return None, "the first message must be a hello"
        if tcp and not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):
            return None, f"missing or wrong token (TCP clients send the one in {self.token_path})"
        return hello, None

    def _handle(self, client: Client, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except ProtocolError as e:
            client.send({"type": "error", "reason": str(e)})
            return
        if msg["type"] == "ping":
            client.send({"type": "pong", "id": msg.get("id")})
        elif msg["type"] == "hello":
            client.send({"type": "error", "reason": "hello already received"})
        else:
            self._command(client, msg)

    def _command(self, client: Client, msg: dict) -> None:
        reply = {"type": "reply", "id": msg.get("id"), "name": msg.get("name")}
        try:
            name, args = protocol.check_command(msg)
            reason = "this connection is read-only" if client.read_only else (
                self.validate and self.validate(name, args))
        except ProtocolError as e:
            reason = str(e)
        except Exception as e:   # the engine's check failed: say so, and train on
            log.warning("telemetry hub: validate(%r) failed", msg, exc_info=True)
            reason = f"the engine could not check this command ({e})"
        if reason:
            client.send({**reply, "status": "rejected", "reason": reason})
            return
        client.send({**reply, "status": "pending"})   # before the worker can see it, so before its reply
        with self._lock:
            self._commands.append({"id": msg["id"], "name": name, "args": args, "client": client.number})

    async def _write_loop(self, client: Client) -> None:
        """Drain the client's queues; a write that stalls past stall_timeout_s disconnects it."""
        writer = client.writer
        try:
            while not client.gone:
                await client.wake.wait()
                client.wake.clear()
                while (client.urgent or client.live) and not client.gone:
                    batch = list(client.urgent)
                    client.urgent.clear()
                    if client.live and client.dropped:
                        batch.append(encode({"type": "dropped", "count": client.dropped}))
                        client.dropped = 0
                    batch.extend(client.live)
                    client.live.clear()
                    writer.write(b"".join(batch))
                    await asyncio.wait_for(writer.drain(), self.stall_timeout_s)
                if client.final is not None and not client.gone:
                    writer.write(client.final)
                    await asyncio.wait_for(writer.drain(), self.stall_timeout_s)
                    writer.close()
                    return
        except asyncio.TimeoutError:
            log.info("telemetry hub: client %d stalled for %g s; disconnected", client.number, self.stall_timeout_s)
        except OSError:
            pass
        writer.transport.abort()


async def read_line(reader: asyncio.StreamReader) -> bytes:
    """The next line (b"" at the end of the stream); TooLong past the client limit."""
    try:
        line = await reader.readline()
    except ValueError:   # readline's form of LimitOverrunError
        raise TooLong from None
    if len(line.rstrip(b"\r\n")) > MAX_CLIENT_LINE_BYTES:
        raise TooLong
    return line
