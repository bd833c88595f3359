"""The wire between a parameter server's ranks: one two-rank gloo group per (server, worker) pair and
per (server 0, server) pair, the messages sent over them, and the flat tensors they carry.

    links = make_links(topo, servers, timeout_s)     # every rank, at the same point: {peer rank: Link}
    links[server].send(PULL, ALL_LAYERS, iteration=i, payload=stats)
    links[server].receive_into(inbox)                # a thread: Messages (or one LOST) onto the queue
    reply = pack_weights(params, torch.bfloat16, version, flags)   # a pull's reply: version, flags, weights
    version, flags = unpack_weights(reply, params)  # into the worker's weights

A message is a float64 header of HEADER numbers (kind, layer, version, iteration, a, b, dtype, numel)
on TAG_HEADER, then its payload, if any, on TAG_PAYLOAD. Weights a worker pulled come back as one bare
tensor on TAG_WEIGHTS + layer, the answer to a paused worker's PING on TAG_PING. A link whose peer has
gone ends in a LOST message with what the transport said (link_error, transport_failure).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.runtime.refusal import transport_failure
from engine.techniques.ps_sync import MODES

# message kinds (a header's first number)
GRAD, PULL, PROFILE, PING, BYE, CONTROL, SERVER_STATS, CKPT, ACK, GATHER, WEIGHTS, FINISH, LOST = range(1, 14)
ALL_LAYERS = -1            # a pull for every layer the server owns
HEADER = 8                 # kind, layer, version, iteration, a, b, dtype (CODES), numel
TAG_HEADER, TAG_PAYLOAD, TAG_PING = 0, 1, 2
TAG_WEIGHTS = 100          # + layer index: a pull's reply
STOP, PAUSED = 1, 2        # flags in every reply to a worker
KEEP_SENDS = 16            # sends of one link not yet waited on, at most


CODES = (torch.float32, torch.float64, torch.bfloat16)   # a payload's dtype, by the header's code
TRAILER = 16               # a pull's reply starts with its version and flags, two float64s


def flatten(tensors, extra: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensors one after the other in one flat tensor of `dtype` (gradients pushed in the working dtype:
    bf16 under precision.params = "bf16", half the bytes)."""
    flat = torch.empty(sum(t.numel() for t in tensors) + extra, dtype=dtype)
    _fill(flat, tensors)
    return flat


def _fill(flat: torch.Tensor, tensors) -> None:
    """The tensors into `flat`, one after the other, cast to its dtype."""
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reply_bytes(numel: int, dtype: torch.dtype) -> int:
    """The size of a pull's reply for a layer of `numel` weights sent as `dtype`."""
    return TRAILER + numel * dtype.itemsize


def pack_weights(tensors, dtype: torch.dtype, version: int, flags: int) -> torch.Tensor:
    """A pull's reply as bytes: the layer's version and the flags (float64, exact at any version), then its
    weights in `dtype`, the link's (the working dtype: bf16 under precision.params = "bf16")."""
    numel = sum(t.numel() for t in tensors)
    out = torch.empty(reply_bytes(numel, dtype), dtype=torch.uint8)
    out[:TRAILER].view(torch.float64).copy_(torch.tensor([version, flags], dtype=torch.float64))
    _fill(out[TRAILER:].view(dtype), tensors)
    return out


def unpack_weights(reply: torch.Tensor, tensors) -> tuple[int, int]:
    """(version, flags) of a pull's reply; its weights into `tensors` unless the flags say stop."""
    version, flags = reply[:TRAILER].view(torch.float64).tolist()
    if not int(flags) & STOP:
        unflatten_into(reply[TRAILER:].view(tensors[0].dtype), tensors)
    return int(version), int(flags)


@dataclass
class Message:
    kind: int
    peer: int
    layer: int = 0
    version: int = 0
    iteration: int = 0
    a: float = 0.0
    b: float = 0.0
    payload: torch.Tensor | None = None
    t: float = 0.0            # time.monotonic() when it arrived
    error: str = ""


class Link:
    """One peer over a process group of two ranks. Sends are asynchronous; their buffers are kept
    until they complete. A receiver thread turns what the peer sends into Messages on a queue."""

    def __init__(self, peer: int, group):
        self.peer, self.group = peer, group
        self._works: list = []
        self._lock = threading.Lock()
        self.closed = False          # said BYE, or we gave up on it

    def send(self, kind: int, layer: int = 0, version: int = 0, iteration: int = 0, a: float = 0.0,
             b: float = 0.0, payload: torch.Tensor | None = None) -> None:
        dtype = CODES.index(payload.dtype) if payload is not None else 0
        numel = payload.numel() if payload is not None else 0
        header = torch.tensor([kind, layer, version, iteration, a, b, dtype, numel], dtype=torch.float64)
        self._post(header, TAG_HEADER)
        if payload is not None:
            self._post(payload, TAG_PAYLOAD)

    def send_tensor(self, tensor: torch.Tensor, tag: int) -> None:
        self._post(tensor, tag)

    def _post(self, tensor: torch.Tensor, tag: int) -> None:
        work = dist.isend(tensor, dst=self.peer, group=self.group, tag=tag)
        with self._lock:
            self._works.append((work, tensor))
            # a gloo send counts as completed only once waited on; the oldest are long delivered
            old, self._works = self._works[:-KEEP_SENDS], self._works[-KEEP_SENDS:]
        for done, _ in old:
            try:
                done.wait()
            except RuntimeError:
                pass   # the peer has gone; its receiver thread reports it

    def expect(self, tensor: torch.Tensor, tag: int):
        return dist.irecv(tensor, src=self.peer, group=self.group, tag=tag)

    def flush(self) -> None:
        """Wait for every send to land (an error from a peer that has gone is ignored)."""
        with self._lock:
            works, self._works = self._works, []
        for work, _ in works:
            try:
                work.wait()
            except RuntimeError:
                pass

    def receive_into(self, inbox: queue.Queue, stop_kinds=(BYE, FINISH)) -> threading.Thread:
        def loop():
            try:
                while True:
                    header = torch.empty(HEADER, dtype=torch.float64)
                    dist.irecv(header, src=self.peer, group=self.group, tag=TAG_HEADER).wait()
                    kind, layer, version, iteration, a, b, dtype, numel = header.tolist()
                    payload = None
                    if numel:
                        payload = torch.empty(int(numel), dtype=CODES[int(dtype)])
                        dist.irecv(payload, src=self.peer, group=self.group, tag=TAG_PAYLOAD).wait()
                    inbox.put(Message(int(kind), self.peer, int(layer), int(version), int(iteration), a, b,
                                      payload, time.monotonic()))
                    if int(kind) in stop_kinds:
                        return
            except (RuntimeError, ValueError) as e:   # the peer's process ended, or this one is ending
                inbox.put(Message(LOST, self.peer, t=time.monotonic(), error=link_error(e)))
        thread = threading.Thread(target=loop, name=f"ps-link-{self.peer}", daemon=True)
        thread.start()
        return thread


def link_error(e: Exception) -> str:
    """What to say about a link's error: the transport failure, or the error's first line."""
    text = str(e)
    return transport_failure(e) or (text.splitlines()[0][:160] if text else type(e).__name__)


def make_links(topo, servers: int, timeout_s: float) -> dict[int, Link]:
    """Every rank calls this at the same point: one group per (server, worker) pair and per (0, server)
    pair. Returns this rank's links by peer rank."""
    links = {}
    timeout = timedelta(seconds=timeout_s)
    pairs = [(0, s) for s in range(1, servers)]
    pairs += [(s, w) for s in range(servers) for w in range(servers, topo.world_size)]
    for a, b in pairs:
        group = dist.new_group([a, b], backend="gloo", timeout=timeout)
        if topo.rank in (a, b):
            links[b if topo.rank == a else a] = Link(b if topo.rank == a else a, group)
    return links


def mode_code(mode: str) -> int:
    return MODES.index(mode)
