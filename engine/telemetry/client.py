"""One console's connection to the hub, its outgoing side (hub.py): answers and replies, never dropped, go
before live messages, which drop the oldest when the console reads slower than the run sends.

Imports engine.telemetry.protocol.
"""

from __future__ import annotations

import asyncio
import collections

from engine.telemetry.protocol import encode


class TooLong(Exception):
    """A console's line longer than MAX_CLIENT_LINE_BYTES."""


class Client:
    """One connection's outgoing side: answers and replies (never dropped) go before live messages."""

    def __init__(self, number: int, writer: asyncio.StreamWriter, read_only: bool, queue_len: int):
        self.number, self.writer, self.read_only = number, writer, read_only
        self.urgent: collections.deque[bytes] = collections.deque()
        self.live: collections.deque[bytes] = collections.deque(maxlen=queue_len)
        self.dropped = 0
        self.final: bytes | None = None     # written after the queues, then the connection closes
        self.gone = False                   # the reader has ended: the writer stops too
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def push(self, data: bytes) -> None:
        self.dropped += len(self.live) == self.live.maxlen   # the deque drops the oldest itself
        self.live.append(data)
        self.wake.set()

    def send(self, msg: dict) -> None:
        self.urgent.append(encode(msg))
        self.wake.set()

    def finish(self, msg: dict) -> None:
        self.final = self.final or encode(msg)
        self.wake.set()
