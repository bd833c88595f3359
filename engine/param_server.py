"""Parameter server (technique 5): servers own layers, workers push gradients and pull weights.

    [parallel]
    strategy = "param_server"
    servers = 2          # ranks 0..1
    workers = 4          # ranks 2..5
    sync = "soft"        # or "bsp", "asp", "ssp" (engine/ps_sync.py says what each does)

Ranks below `servers` are servers; each owns whole layers, assigned so that every
server holds about the same parameter bytes, with their optimizer state. A worker,
every iteration, asks each layer's server for its weights before that layer's forward
and sends the layer's gradient to it as soon as that layer's backward completes.

Transport: torch.distributed point-to-point on one two-rank process group per
(server, worker) pair and per (server 0, server) pair. A worker that dies closes only
its own links: the servers see it at once, say so, and go on with the others. Nothing
in this mode uses a collective over every rank after the start, because any worker may
be gone. Server 0 is the coordinator: it holds the hub, counts the global step,
applies commands, logs the telemetry and decides when the run ends.

A worker process runs under a small supervisor (`supervise`) that the elastic agent
sees as the rank: a worker that dies is reported and the rest of the run goes on,
where the agent would otherwise restart everything. A server that dies ends the
worker group; the agent restarts it from the last checkpoint (`parallel.max_restarts`).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from rich.markup import escape

from engine import checkpoint as ckpt
from engine.control import FIELDS, Peaks, rank_rows, row_values
from engine.ddp import cross_entropy
from engine.optim import make_optimizer
from engine.ps_sync import MODES, Arrival, LayerSync

# message kinds (a header's first number)
GRAD, PULL, PROFILE, PING, BYE, CONTROL, SERVER_STATS, CKPT, ACK, GATHER, WEIGHTS, FINISH, LOST = range(1, 14)
ALL_LAYERS = -1            # a pull for every layer the server owns
HEADER = 8                 # kind, layer, version, iteration, a, b, dtype (0: float32, 1: float64), numel
TAG_HEADER, TAG_PAYLOAD, TAG_PING = 0, 1, 2
TAG_WEIGHTS = 100          # + layer index: a pull's reply
STOP, PAUSED = 1, 2        # flags in every reply to a worker
PAUSED_POLL_S = 0.25       # a paused worker asks the servers this often whether to go on
CONTROL_EVERY_S = 0.25     # the coordinator tells the servers the state at least this often
KEEP_SENDS = 16           # sends of one link not yet waited on, at most
LAYER_STATS = 5            # per owned layer in a server's stats: index, version, window workers, staleness, ms


class ParamServerError(RuntimeError):
    """The parameter-server run cannot go on (every worker lost; a model it cannot serve)."""


def assign_layers(sizes: dict[int, int], servers: int) -> dict[int, int]:
    """Layer index -> server rank, balancing parameter bytes: the largest layer first, each to the
    server holding the fewest bytes so far (ties to the lower rank, then the earlier layer)."""
    if len(sizes) < servers:
        raise ParamServerError(
            f"parallel.servers = {servers} but the model has only {len(sizes)} layers with parameters: "
            f"every server needs at least one layer (use at most {len(sizes)} servers)")
    load = [0] * servers
    owner = {}
    for layer in sorted(sizes, key=lambda j: (-sizes[j], j)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[layer] = server
        load[server] += sizes[layer]
    return dict(sorted(owner.items()))


def layer_params(model) -> dict[int, list[torch.nn.Parameter]]:
    """Each layer's parameters; refused if layers share one (its gradient would have two owners)."""
    seen, out = {}, {}
    for j, layer in enumerate(model.layers):
        params = list(layer.parameters())
        for p in params:
            if id(p) in seen:
                raise ParamServerError(
                    f"layers {model.names[seen[id(p)]]!r} and {model.names[j]!r} share a parameter; "
                    f"parallel.strategy = \"param_server\" needs every parameter in one layer")
            seen[id(p)] = j
        if params:
            out[j] = params
    return out


def flatten(tensors, extra: int = 0) -> torch.Tensor:
    flat = torch.empty(sum(t.numel() for t in tensors) + extra, dtype=torch.float32)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return flat


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# --- links ----------------------------------------------------------------------------

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
        dtype = 1 if payload is not None and payload.dtype == torch.float64 else 0
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
                        payload = torch.empty(int(numel), dtype=torch.float64 if dtype else torch.float32)
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


def transport_failure(e: Exception) -> str | None:
    """A gloo transport failure in a few words (its own text carries a source path and advice), or
    None when `e` is not one."""
    text = str(e)
    if "Connection closed by peer" in text:
        return "connection closed by peer"
    if "Application timeout" in text or "Timed out" in text:
        return "timed out (parallel.collective_timeout_s)"
    return None


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


# --- the slow-worker emulation and the layer profile -----------------------------------------

class SlowMachine:
    """Stretches a worker's own work by `factor` to emulate a slower machine: after each layer's forward
    and each backward segment (each layer with parameters ends one: its gradients are complete) the
    worker sleeps (factor - 1) times what it took, and at the iteration's end as much again for the
    rest of its own work (all but waiting for weights), so gradients leave at a slow machine's pace.
    At factor 1 it does nothing."""

    def __init__(self, model, factor: float):
        self.factor = factor
        self._t0 = 0.0
        self.mark = 0.0
        self.slept_ms = 0.0
        if factor > 1.0:
            for layer in model.layers:
                layer.register_forward_pre_hook(self._before)
                layer.register_forward_hook(self._after)

    def _before(self, module, args):
        self._t0 = time.perf_counter()

    def _after(self, module, args, output):
        self._stretch((time.perf_counter() - self._t0) * 1000)

    def backward_started(self) -> None:
        self.mark = time.perf_counter()

    def segment_done(self) -> None:
        """A layer's gradients are complete: the segment since the last mark was its backward."""
        self._stretch((time.perf_counter() - self.mark) * 1000)
        self.mark = time.perf_counter()

    def stretch_rest(self, own_ms: float) -> None:
        """The iteration's end: stretch the rest of its own work (data, messages, bookkeeping) too, so
        all of it, not only the layers, takes `factor` times as long. `own_ms`: the iteration's time
        without waiting for weights, sleeps included."""
        if self.factor > 1.0:
            raw = own_ms - self.slept_ms
            time.sleep(max((self.factor - 1.0) * raw - self.slept_ms, 0.0) / 1000)
        self.slept_ms = 0.0

    def _stretch(self, ms: float) -> None:
        if self.factor > 1.0:
            extra = (self.factor - 1.0) * ms
            time.sleep(extra / 1000)
            self.slept_ms += extra


# --- a worker ----------------------------------------------------------------------------

class PSWorker:
    """Trains on its shard of each global batch, pulling each layer just before its forward and
    pushing each layer's gradient the moment its backward completes."""

    def __init__(self, setup: "Setup"):
        self.s = setup
        cfg, topo = setup.cfg, setup.topo
        self.index = topo.rank - setup.servers
        self.factor = float(cfg.parallel.slow_workers.get(str(topo.rank), 1.0))
        self.params = setup.params
        self.layers = sorted(self.params)
        self.sizes = {j: sum(p.numel() for p in ps) for j, ps in self.params.items()}
        self.version = {j: 0 for j in self.layers}
        self.clock = SlowMachine(setup.model, self.factor)
        self._left = {}
        for j, ps in self.params.items():
            for p in ps:
                p.register_post_accumulate_grad_hook(self._grad_hook(j))
        self.iteration = setup.first_step
        self.profile: list[list[float]] = []
        self.pushed_at: dict[int, float] = {}   # layer -> when its last gradient left
        self.slack: dict[int, float] = {}       # layer -> ms from that push to needing the layer again
        self.stats: torch.Tensor | None = None  # the last iteration's figures, sent with the next pull

    def _grad_hook(self, j: int):
        def hook(p):
            self._left[j] -= 1
            if self._left[j] == 0:
                self.clock.segment_done()
                grad = flatten([q.grad for q in self.params[j]])
                self.s.links[self.s.owner[j]].send(GRAD, j, self.version[j], self.iteration, payload=grad)
                for q in self.params[j]:
                    q.grad = None
                self.pushed_at[j] = time.perf_counter()
        return hook

    def run(self) -> None:
        s, cfg = self.s, self.s.cfg
        model, device = s.model, s.device
        flags, t_idle = 0, 0.0
        try:
            while not s.stop.requested:
                t_start = time.perf_counter()
                idle_s = t_start - t_idle if flags & PAUSED or cfg.run.step_pause_ms else 0.0
                buffers = {j: torch.empty(self.sizes[j] + 2) for j in self.layers}
                works = {j: s.links[s.owner[j]].expect(buffers[j], TAG_WEIGHTS + j) for j in self.layers}
                for server in range(s.servers):   # every server owns a layer; server 0 gets the figures
                    s.links[server].send(PULL, ALL_LAYERS, iteration=self.iteration, a=self.factor,
                                         payload=self.stats if server == 0 else None)
                x, y = s.batch(self.iteration, self.index)
                x, y = x.to(device.torch_device), y.to(device.torch_device)
                wait_ms, flags = 0.0, 0
                out = x
                with device.ledger.saved_activations():
                    for j, layer in enumerate(model.layers):
                        if j in works:
                            t0 = time.perf_counter()
                            if j in self.pushed_at:   # the time this worker had for layer j: no waiting
                                self.slack[j] = (t0 - self.pushed_at[j] - idle_s) * 1000 - wait_ms
                            works[j].wait()
                            wait_ms += (time.perf_counter() - t0) * 1000
                            reply = buffers[j]
                            flags |= int(reply[-1])
                            if flags & STOP:
                                break
                            unflatten_into(reply[:-2], self.params[j])
                            self.version[j] = int(reply[-2])
                        out = layer(out)
                    if flags & STOP:
                        break
                    loss = cross_entropy(out, y)
                    self._left = {j: len(ps) for j, ps in self.params.items()}
                    t_fwd = time.perf_counter()
                    self.clock.backward_started()
                    loss.backward()
                t_end = time.perf_counter()
                device.ledger.refresh()
                step_ms = (t_end - t_start) * 1000
                self.iteration += 1
                row = {"loss": loss.item(), "step_ms": step_ms, "fwd_ms": (t_fwd - t_start) * 1000 - wait_ms,
                       "bwd_ms": (t_end - t_fwd) * 1000, "wait_ms": wait_ms, **device.stats()}
                self.stats = torch.tensor(row_values(row), dtype=torch.float64)
                self._profile()
                self.clock.stretch_rest((time.perf_counter() - t_start) * 1000 - wait_ms)
                t_idle = time.perf_counter()
                if cfg.run.step_pause_ms:
                    time.sleep(cfg.run.step_pause_ms / 1000)
                if flags & PAUSED:
                    flags = self._paused()
                    if flags & STOP:
                        break
        finally:
            for server, link in s.links.items():
                try:
                    link.send(BYE, iteration=self.iteration, a=self.factor,
                              payload=self.stats if server == 0 else None)
                except RuntimeError:
                    pass
            for link in s.links.values():
                link.flush()

    def _profile(self) -> None:
        """After `sync_profile_steps` iterations, every server gets this worker's slack per layer
        (the mean over those iterations but the first)."""
        steps = self.s.cfg.parallel.sync_profile_steps
        done = self.iteration - self.s.first_step
        if done > steps:
            return
        if done > 1:
            self.profile.append([self.slack.get(j, 0.0) for j in self.layers])
        if done == steps:
            mean = torch.tensor(self.profile, dtype=torch.float64).mean(dim=0)
            for server in range(self.s.servers):
                self.s.links[server].send(PROFILE, iteration=self.iteration, payload=mean)

    def _paused(self) -> int:
        """Ask the servers every PAUSED_POLL_S whether to go on (this also keeps the links alive)."""
        while True:
            time.sleep(PAUSED_POLL_S)
            flags = 0
            for server in range(self.s.servers):
                answer = torch.zeros(1)
                work = self.s.links[server].expect(answer, TAG_PING)
                self.s.links[server].send(PING, iteration=self.iteration)
                work.wait()
                flags |= int(answer[0])
            if not flags & PAUSED or flags & STOP or self.s.stop.requested:
                return flags


# --- a server (and server 0, the coordinator) -------------------------------------------------

class PSServer:
    def __init__(self, setup: "Setup"):
        self.s = s = setup
        cfg, topo = s.cfg, s.topo
        p = cfg.parallel
        self.rank, self.is_coordinator = topo.rank, topo.rank == 0
        self.workers = list(range(s.servers, topo.world_size))
        self.mine = [j for j, server in s.owner.items() if server == self.rank]
        self.names = s.model.names
        self.opt = {j: make_optimizer(cfg.optim, s.params[j]) for j in self.mine}
        self.live, self.done, self.lost = set(self.workers), set(), {}
        self.target = p.sync                     # the mode once every worker's profile is in
        self.profiling = True                    # until then: bsp, while the workers measure
        self.sync = {j: LayerSync("bsp", set(self.workers), p.staleness_scaling, p.staleness_bound,
                                  wait_limit_s=p.collective_timeout_s / 2) for j in self.mine}
        self.count = {j: s.first_step * len(self.workers) for j in self.mine}
        self.last = {}                           # layer -> its last Update
        self.held = {j: [] for j in self.mine}   # layer -> [(worker, iteration)] waiting for weights
        self.flags = 0
        self.profiles: dict[int, list[float]] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.finished = False
        s.restore(self)
        for link in s.links.values():
            link.receive_into(self.inbox)

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        while not self.finished:
            deadlines = [d for d in (sync.next_deadline() for sync in self.sync.values()) if d is not None]
            wait = min(deadlines) - time.monotonic() if deadlines else 0.05
            try:
                message = self.inbox.get(timeout=min(max(wait, 0.0), 0.05))
            except queue.Empty:
                message = None
            if message is not None:
                self.handle(message)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        for j, sync in self.sync.items():
            if sync.mode == "bsp" and sync.window is not None and now > sync.window.deadline:
                for worker in sorted(sync.missing()):
                    self.lose(worker, f"sent no gradient for layer {self.names[j]!r} within "
                                      f"{sync.wait_limit_s:.0f} s", now)
            self.apply(j, sync.due(now))

    def global_step(self) -> int:
        return min(self.count.values()) // len(self.workers)

    def handle(self, m: Message) -> None:
        if m.kind == GRAD:
            if m.peer in self.live:   # sent before the worker heard of a stop: still applied
                self.count[m.layer] += 1
                self.apply(m.layer, self.sync[m.layer].offer(Arrival(m.peer, m.version, m.t, m.payload)))
        elif m.kind == PULL:
            if m.payload is not None:
                self.worker_stats(m)
            for j in (self.mine if m.layer == ALL_LAYERS else [m.layer]):
                self.held[j].append((m.peer, m.iteration))
                self.serve(j)
        elif m.kind == PROFILE:
            self.profiles[m.peer] = m.payload.tolist()
            order = sorted(self.s.params)
            for j in self.mine:
                self.sync[j].window_s[m.peer] = m.payload[order.index(j)].item() / 1000
            self._end_profile(m.t)
        elif m.kind == PING:
            self._reply_flags(m.peer)
        elif m.kind == BYE:
            if m.payload is not None:
                self.worker_stats(m)
            if m.peer in self.workers:
                self.done.add(m.peer)
                self.lose(m.peer, "", m.t)
        elif m.kind == LOST:
            if m.peer not in self.workers:
                raise ParamServerError(f"server rank {m.peer} was lost ({m.error}); the run cannot go on "
                                       f"without its layers")
            if m.peer not in self.done:
                self.lose(m.peer, f"its process ended ({m.error})", m.t)
        elif m.kind == CONTROL:
            self.control(MODES[int(m.a)], int(m.b), m.t)
            self.s.links[0].send(SERVER_STATS, payload=self.stats())
        elif m.kind == CKPT:
            self.save(m.iteration)
            self.s.links[0].send(ACK, iteration=m.iteration)
        elif m.kind == GATHER:
            self.send_weights()
        elif m.kind == FINISH:
            if m.a:
                self.save(m.iteration)
            self.send_weights()
            self.s.links[0].send(ACK, iteration=m.iteration)
            self.s.links[0].send(BYE)
            self.s.links[0].flush()
            self.finished = True
        else:
            self.coordinate(m)

    def coordinate(self, m: Message) -> None:
        """Messages only server 0 gets; a plain server has none."""

    def worker_stats(self, m: Message) -> None:
        """A worker's figures of its last iteration (server 0 keeps them)."""

    # --- updates and pulls -------------------------------------------------------------------
    def apply(self, j: int, updates) -> None:
        if not updates:
            return
        params = self.s.params[j]
        for update in updates:
            if update.grad is not None:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                unflatten_into(update.grad, [p.grad for p in params])
                self.opt[j].step()
            self.last[j] = update
        self.serve(j)

    def serve(self, j: int) -> None:
        """Answer every held pull of layer j that may be answered now."""
        sync, still = self.sync[j], []
        done = self.flags & STOP or self.global_step() >= self.s.cfg.run.steps
        for worker, iteration in self.held[j]:
            if worker not in self.live:
                continue
            if done or sync.pull_ready(worker, iteration):
                self.send_layer(worker, j, STOP if done else self.flags)
            else:
                still.append((worker, iteration))
        self.held[j] = still

    def send_layer(self, worker: int, j: int, flags: int) -> None:
        reply = flatten(self.s.params[j], extra=2)
        reply[-2], reply[-1] = self.sync[j].version, flags
        try:
            self.s.links[worker].send_tensor(reply, TAG_WEIGHTS + j)
        except RuntimeError as e:
            self.lose(worker, f"its link failed ({link_error(e)})", time.monotonic())

    def _reply_flags(self, worker: int) -> None:
        flags = self.flags | (STOP if self.global_step() >= self.s.cfg.run.steps else 0)
        try:
            self.s.links[worker].send_tensor(torch.tensor([float(flags)]), TAG_PING)
        except RuntimeError:
            pass

    def lose(self, worker: int, reason: str, now: float) -> None:
        """A worker left: cleanly after a BYE (no reason), or died or went silent (a reason)."""
        if worker not in self.live:
            return
        self.live.discard(worker)
        if reason:
            self.lost[worker] = reason
            self.worker_lost(worker, reason)
        for j, sync in self.sync.items():
            self.apply(j, sync.lose(worker, now))
            self.serve(j)
        self._end_profile(now)

    def worker_lost(self, worker: int, reason: str) -> None:
        print(f"trainyard: parameter server rank {self.rank}: worker rank {worker} lost: {reason}",
              file=sys.stderr, flush=True)

    def _end_profile(self, now: float) -> None:
        """Every live worker's profile is in: leave the measuring bsp for the configured mode."""
        if self.profiling and self.live and all(w in self.profiles for w in self.live):
            self.profiling = False
            self.control(self.target, self.flags, now)
            self.profile_done()

    def profile_done(self) -> None: ...

    def control(self, mode: str, flags: int, now: float) -> None:
        """The coordinator's word: the sync mode and the flags (paused, stopping)."""
        self.flags = flags
        if self.profiling:
            self.target = mode
        else:
            for j, sync in self.sync.items():
                if sync.mode != mode:
                    self.apply(j, sync.set_mode(mode, now))
            self.target = mode
        for j in self.mine:
            self.serve(j)

    # --- stats, checkpoints, weights -----------------------------------------------------------
    def stats(self) -> torch.Tensor:
        """This server's figures: one row of control.FIELDS, then LAYER_STATS numbers per owned layer."""
        self.s.device.ledger.refresh()
        ledger = self.s.device.stats()
        row = row_values(ledger)
        for j in self.mine:
            u = self.last.get(j)
            row += [j, self.sync[j].version, len(u.workers) if u else 0, u.mean_staleness if u else 0.0,
                    u.window_s * 1000 if u else 0.0]
        return torch.tensor(row, dtype=torch.float64)

    def save(self, step: int) -> None:
        model = self.s.model
        params, buffers = {}, {}
        for j in self.mine:
            for key, value in model.layers[j].state_dict().items():
                (params if key in dict(model.layers[j].named_parameters()) else buffers)[f"layers.{j}.{key}"] = value
        ckpt.write_file(ckpt.staging_dir(self.s.cfg.run_dir, step), f"server{self.rank}.pt", {
            "params": params, "buffers": buffers,
            "optimizer": {self.names[j]: self.opt[j].state_dict() for j in self.mine},
            "version": {self.names[j]: self.sync[j].version for j in self.mine},
            "count": {self.names[j]: self.count[j] for j in self.mine}})

    def load(self, state: dict) -> None:
        model = self.s.model
        model.load_state_dict({**state["params"], **state["buffers"]}, strict=False)
        for j in self.mine:
            name = self.names[j]
            if name not in state["optimizer"]:
                raise ckpt.CheckpointError(f"layer {name!r} is not in this server's checkpoint file "
                                           f"(the layers were assigned differently when it was written)")
            self.opt[j].load_state_dict(state["optimizer"][name])
            self.sync[j].version = state["version"][name]

    def send_weights(self) -> None:
        for j in self.mine:
            self.s.links[0].send(WEIGHTS, j, self.sync[j].version, payload=flatten(self.s.params[j]))


class Coordinator(PSServer):
    """Server 0: also counts the global step, applies commands, logs telemetry and ends the run."""

    def __init__(self, setup: "Setup", tel):
        super().__init__(setup)
        self.tel = tel
        cfg = setup.cfg
        self.mode = cfg.parallel.sync
        self.paused = False
        self.reported = setup.first_step
        self.rows: dict[int, list[float]] = {}
        self.info = {w: {"rank": w, "iterations": setup.first_step, "steps_per_s": 0.0, "wait_ms": 0.0,
                         "compute_ms": 0.0, "slow_factor": float(cfg.parallel.slow_workers.get(str(w), 1.0)),
                         "alive": True, "_t": None} for w in self.workers}
        self.server_rows: dict[int, torch.Tensor] = {}
        self.losses: list[float] = []
        self.last_loss: float | None = None
        self.acks: set[tuple[int, int]] = set()
        self.gathered: set[int] = set()
        self.stop_reason: str | None = None
        self.stop_command = None
        self.stop_deadline = 0.0
        self.last_control = 0.0
        self.t_report = time.perf_counter()
        self.summary: dict | None = None
        self.peaks = Peaks(setup.topo.world_size)

    # --- messages ------------------------------------------------------------------------------
    def worker_stats(self, m: Message) -> None:
        row = m.payload.tolist()
        self.rows[m.peer] = row
        self.losses.append(row[FIELDS.index("loss")])
        info, now = self.info[m.peer], time.monotonic()
        if info["_t"] is not None and m.iteration > info["iterations"]:
            rate = (m.iteration - info["iterations"]) / max(now - info["_t"], 1e-6)
            info["steps_per_s"] = rate if not info["steps_per_s"] else 0.8 * info["steps_per_s"] + 0.2 * rate
        info.update(iterations=m.iteration, _t=now, wait_ms=row[FIELDS.index("wait_ms")],
                    compute_ms=row[FIELDS.index("fwd_ms")] + row[FIELDS.index("bwd_ms")])

    def coordinate(self, m: Message) -> None:
        if m.kind == SERVER_STATS:
            self.server_rows[m.peer] = m.payload
        elif m.kind == ACK:
            self.acks.add((m.peer, m.iteration))
        elif m.kind == WEIGHTS:
            unflatten_into(m.payload, self.s.params[m.layer])
            self.gathered.add(m.layer)

    def worker_lost(self, worker: int, reason: str) -> None:
        super().worker_lost(worker, reason)
        self.info[worker]["alive"] = False
        step = self.global_step()
        self.tel.event("worker_lost", step, rank=worker, reason=reason)
        self.tel.note(f"[yellow]worker rank {worker} lost[/] at step {step}: {escape(reason)}; the servers go on "
                      f"with {len(self.live)} worker(s)")

    def profile_done(self) -> None:
        order = sorted(self.s.params)
        layers = []
        for j in order:
            entry = {"name": self.names[j], "server": self.s.owner[j],
                     "window_ms": {str(w): round(self.profiles[w][order.index(j)], 4)
                                   for w in sorted(self.profiles)}}
            if j in self.last:   # the arrival spread of the last measuring (bsp) window
                entry["arrival_spread_ms"] = round(self.last[j].window_s * 1000, 4)
            layers.append(entry)
        self.tel.event("ps_profile", self.global_step(), layers=layers, mode=self.target)
        self.tel.note(f"sync profile measured; mode {self.target}")

    # --- the loop ------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        super().tick(now)
        if self.finished:
            return
        for command in self.tel.take_commands():
            self.command(command)
        if self.s.stop.requested and self.stop_reason is None:
            self.begin_stop(f"signal {signal.Signals(self.s.stop.signal).name}")
        step = self.global_step()
        if step > self.reported:
            self.report(step)
        if step >= self.s.cfg.run.steps and self.stop_reason is None:
            self.begin_stop("finished")
        if now - self.last_control >= CONTROL_EVERY_S:
            self.tell_servers()
        if self.stop_reason is not None:
            if self.live and now > self.stop_deadline:
                for worker in sorted(self.live):
                    self.lose(worker, "did not leave within parallel.collective_timeout_s of the stop", now)
            if not self.live:
                self.finish()
        elif not self.live:
            raise ParamServerError("every worker was lost: " + "; ".join(
                f"rank {w}: {why}" for w, why in sorted(self.lost.items())))

    def tell_servers(self) -> None:
        self.last_control = time.monotonic()
        for server in range(1, self.s.servers):
            self.s.links[server].send(CONTROL, iteration=self.global_step(), a=mode_code(self.mode), b=self.flags)

    def command(self, command: dict) -> None:
        name, step = command["name"], self.global_step()
        if name in ("pause", "resume"):
            self.paused = name == "pause"
            self.control(self.mode, (self.flags & ~PAUSED) | (PAUSED if self.paused else 0), time.monotonic())
            self.tel.update_state(paused=self.paused)
        elif name == "checkpoint":
            self.checkpoint(step)
        elif name == "stop":
            self.stop_command = command
            self.begin_stop("command")
            return
        elif name == "set-sync":
            previous, self.mode = self.mode, command["args"][0]
            self.control(self.mode, self.flags, time.monotonic())
            self.tel.event("sync_mode", step, mode=self.mode, previous=previous, source="command")
            self.tel.update_state(sync=self.mode)
        else:   # the hub rejects these in this mode; a command from elsewhere gets the same answer
            self.tel.reply(command, "rejected", reason=f"{name} is not available in mode param_server")
            return
        self.tell_servers()
        self.tel.reply(command, "applied", step=step)

    def begin_stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_deadline = time.monotonic() + self.s.cfg.parallel.collective_timeout_s
        self.control(self.mode, self.flags | STOP, time.monotonic())
        self.tell_servers()

    # --- telemetry -----------------------------------------------------------------------------
    def report(self, step: int) -> None:
        cfg = self.s.cfg
        if self.last_loss is None and not self.losses:
            return   # no worker's loss has arrived yet: the record waits for one
        now = time.perf_counter()
        steps = step - self.reported
        dt = max(now - self.t_report, 1e-9)
        self.t_report = now
        if self.losses:
            self.last_loss = sum(self.losses) / len(self.losses)
            self.losses = []
        table = self._table()
        ranks = rank_rows(table)
        for entry in ranks:
            r = entry["rank"]
            entry["role"] = "server" if r < self.s.servers else "worker"
            if r >= self.s.servers:
                entry["alive"] = self.info[r]["alive"]
        self.peaks.note(ranks)
        workers = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items() if k != "_t"}
                   for info in self.info.values()]
        alive = [w for w in workers if w["alive"]]
        mean = (lambda key: sum(w[key] for w in alive) / len(alive)) if alive else (lambda key: 0.0)
        record = {"loss": self.last_loss,
                  "samples_per_s": cfg.data.batch_size * steps / dt, "step_ms": dt * 1000 / steps, "ranks": ranks,
                  "time_split": {"compute_ms": round(mean("compute_ms"), 4), "comm_ms": 0.0,
                                 "wait_ms": round(mean("wait_ms"), 4)},
                  "streams": [], "ps": {"mode": self.mode, "profiling": self.profiling,
                                        "staleness_bound": cfg.parallel.staleness_bound,
                                        "workers_live": len(self.live), "workers_lost": sorted(self.lost),
                                        "workers": workers, "layers": self._layer_rows()}}
        for st in range(self.reported + 1, step + 1):
            self.tel.step({"step": st, **record})
        self.reported = step
        self.tel.update_state(step=step)
        if time.monotonic() - self.last_control >= 0.05:
            self.tell_servers()   # and their figures come back for the next record
        every, evals = cfg.checkpoint.every, cfg.run.eval_every
        if every and step // every > (step - steps) // every and step < cfg.run.steps:
            self.checkpoint(step)
        if evals and step // evals > (step - steps) // evals and step < cfg.run.steps:
            self.tel.event("eval", step, test_accuracy=self.evaluate(), wall_s=round(
                time.time() - (self.s.job.launched_at or time.time()), 3))

    def _table(self) -> torch.Tensor:
        rows = []
        for r in range(self.s.topo.world_size):
            if r == self.rank:
                row = self.stats()[:len(FIELDS)].tolist()
            elif r < self.s.servers:
                row = self.server_rows[r][:len(FIELDS)].tolist() if r in self.server_rows else row_values({})
            else:
                row = self.rows.get(r) or row_values({})
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float64)

    def _layer_rows(self) -> list[dict]:
        stats = {}
        for r, row in [(self.rank, self.stats())] + sorted(self.server_rows.items()):
            per_layer = row[len(FIELDS):].view(-1, LAYER_STATS).tolist() if row.numel() > len(FIELDS) else []
            for j, version, n, staleness, ms in per_layer:
                stats[int(j)] = {"name": self.names[int(j)], "server": r, "version": int(version),
                                 "window_workers": int(n), "mean_staleness": round(staleness, 4),
                                 "window_ms": round(ms, 4)}
        return [stats[j] for j in sorted(stats)]

    # --- checkpoints, evaluation, the end -------------------------------------------------------
    def _await(self, done, what: str) -> None:
        deadline = time.monotonic() + self.s.cfg.parallel.collective_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise ParamServerError(f"timed out waiting for {what}")
            try:
                message = self.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            self.handle(message)
            PSServer.tick(self, time.monotonic())

    def checkpoint(self, step: int) -> None:
        for server in range(1, self.s.servers):
            self.s.links[server].send(CKPT, iteration=step)
        self.save(step)
        self._await(lambda: all((s, step) in self.acks for s in range(1, self.s.servers)),
                    f"the servers' checkpoint files for step {step}")
        path = ckpt.finalize(self.s.cfg.run_dir, step, self.s.manifest(step), keep=self.s.cfg.checkpoint.keep)
        self.tel.event("checkpoint", step, path=str(path))

    def gather(self) -> None:
        """Every layer's weights, from the servers that own them, into this rank's model."""
        self.gathered = set(self.mine)
        for server in range(1, self.s.servers):
            self.s.links[server].send(GATHER)
        self._await(lambda: self.gathered >= set(self.s.params), "the servers' weights")

    @torch.no_grad()
    def evaluate(self) -> float | None:
        ds = self.s.data
        if ds.x_test is None or len(ds.x_test) == 0:
            return None
        if len(self.gathered) < len(self.s.params):
            self.gather()
        self.gathered = set()
        model, device = self.s.model, self.s.device
        model.eval()
        correct = total = 0
        for i in range(0, len(ds.x_test), 1024):
            x, y = ds.x_test[i:i + 1024].to(device.torch_device), ds.y_test[i:i + 1024].to(device.torch_device)
            correct += int((model(x).argmax(dim=-1) == y).sum())
            total += y.numel()
        model.train()
        return correct / total

    def finish(self) -> None:
        cfg, step = self.s.cfg, self.global_step()
        step = min(step, cfg.run.steps) if self.stop_reason == "finished" else step
        stopped_early = step < cfg.run.steps
        save = step > self.s.first_step or stopped_early
        self.gathered = set(self.mine)
        for server in range(1, self.s.servers):
            self.s.links[server].send(FINISH, iteration=step, a=float(save))
        if save:
            self.save(step)
        self._await(lambda: all((s, step) in self.acks for s in range(1, self.s.servers))
                    and self.gathered >= set(self.s.params), "the servers' final checkpoint files and weights")
        for link in self.s.links.values():
            link.flush()
        if save:
            path = ckpt.finalize(cfg.run_dir, step, self.s.manifest(step), keep=cfg.checkpoint.keep)
            self.tel.event("checkpoint", step, path=str(path))
        if stopped_early:
            self.tel.event("stop", step, reason=self.stop_reason if self.stop_reason != "finished" else "workers left")
        if self.stop_command:
            self.tel.reply(self.stop_command, "applied", step=step)
        self.summary = {"name": cfg.run.name, "final_loss": self.last_loss, "test_accuracy": self.evaluate(),
                        "steps": step, "wall_s": time.time() - (self.s.job.launched_at or time.time()),
                        **self.peaks.summary(), "capacity_bytes": self.s.device.ledger.capacity_bytes,
                        "simulated": self.s.device.simulated, "restarts": self.s.restart,
                        "stopped_early": stopped_early, "sync": self.mode,
                        "workers_lost": sorted(self.lost)}
        self.tel.summary(self.summary)
        self.tel.close("run stopped" if stopped_early else "run finished")
        self.finished = True


# --- setting up a rank, and the entry points ------------------------------------------------

class Setup:
    """What every rank of a parameter-server run builds the same way: device, data, model, the
    layers' owners, the links, and where it resumes."""

    def __init__(self, job, topo, stop):
        from engine.data import batch_for
        from engine.worker import build_rank
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.servers, self.workers = cfg.parallel.servers, topo.world_size - cfg.parallel.servers
        self.restart, self.device, self.data, self.model = build_rank(job, topo)
        self._batch_for = batch_for
        self.params = layer_params(self.model)
        self.owner = assign_layers({j: sum(p.numel() * p.element_size() for p in ps)
                                    for j, ps in self.params.items()}, self.servers)
        if topo.rank < self.servers:   # a server counts the layers it owns; a worker the whole model
            self.device.ledger.track_module(torch.nn.ModuleList(
                [self.model.layers[j] for j, s in self.owner.items() if s == topo.rank]))
        else:
            self.device.ledger.track_module(self.model)
        self.links = make_links(topo, self.servers, cfg.parallel.collective_timeout_s)
        self.source = ckpt.resume_source(cfg.run_dir, job.resume, self.restart)
        self.resumed = ckpt.verify(self.source) if self.source else None   # its manifest
        self.first_step = int(self.resumed["step"]) if self.resumed else 0

    def batch(self, iteration: int, index: int):
        return self._batch_for(self.data, iteration, self.cfg.data.batch_size, self.cfg.run.seed, index, self.workers)

    def restore(self, server: PSServer) -> None:
        if self.source is None:
            return
        manifest = self.resumed
        ckpt.check_world_size(self.source, manifest, self.topo.world_size)
        ckpt.check_strategy(self.source, manifest, "param_server")
        saved = manifest["layout"].get("server_layers")
        if saved != self.layout()["server_layers"]:
            raise ckpt.CheckpointError(f"{self.source}: its layers were served as {saved}; this run serves "
                                       f"them as {self.layout()['server_layers']} (parallel.servers must match)")
        server.load(ckpt.load_file(self.source, f"server{self.topo.rank}.pt"))
        for j in server.mine:
            server.count[j] = self.first_step * self.workers

    def layout(self) -> dict:
        p = self.cfg.parallel
        return {"strategy": "param_server", "servers": self.servers, "workers": self.workers, "sync": p.sync,
                "staleness_bound": p.staleness_bound, "staleness_scaling": p.staleness_scaling,
                "server_layers": {str(s): [self.model.names[j] for j, o in self.owner.items() if o == s]
                                  for s in range(self.servers)},
                "roles": ["server" if r < self.servers else "worker" for r in range(self.topo.world_size)],
                "slow_workers": dict(p.slow_workers)}

    def manifest(self, step: int) -> dict:
        cfg = self.cfg
        return {"name": cfg.run.name, "world_size": self.topo.world_size,
                "data_position": {"step": step, "samples_seen": step * cfg.data.batch_size},
                "layout": self.layout(), "config": cfg.to_dict()}

    def hello(self) -> dict:
        from engine.worker import device_fields
        cfg = self.cfg
        return {"run": cfg.run.name, "mode": "param_server", "world_size": self.topo.world_size,
                "backend": self.topo.backend, **device_fields(self.device),
                "layers": list(self.model.names), "layout": self.layout(),
                "updated_layers": [self.model.names[j] for j in sorted(self.params)],
                "capabilities": ["pause", "resume", "stop", "checkpoint", "set-sync"], "steps": cfg.run.steps,
                "config": cfg.to_dict()}


def run_server(job, topo, stop) -> dict | None:
    """A server rank (rank 0: the coordinator too). Returns rank 0's summary."""
    from engine.telemetry import Telemetry
    from engine.worker import announce
    try:
        setup = Setup(job, topo, stop)
        if topo.rank != 0:
            PSServer(setup).run()
            return None
    except Exception as e:
        print(f"trainyard: parameter server rank {topo.rank} failed: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise
    tel = Telemetry.open(job, setup.hello(), True, setup.first_step)
    try:
        tel.update_state(step=setup.first_step, steps=job.config.run.steps, paused=False, sync=job.config.parallel.sync)
        announce(tel, job.config, topo, setup.device, setup.model.names, setup.first_step, setup.restart,
                 setup.source, setup.layout())
        coordinator = Coordinator(setup, tel)
        coordinator.run()
    except BaseException as e:
        print(f"trainyard: parameter server rank 0 failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        tel.close(f"run failed ({type(e).__name__}: {e})")
        raise
    return {"type": "summary", **coordinator.summary}


def run_worker(job, topo, stop) -> None:
    PSWorker(Setup(job, topo, stop)).run()


def supervise(job) -> None:
    """A worker rank as the elastic agent sees it: the worker trains in a child process, and its
    death is reported and absorbed here, so the servers go on with the others."""
    rank = int(os.environ["RANK"])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: never outlive the supervisor
            from engine.topology import Topology
            from engine.worker import StopRequest
            cfg = job.config
            stop = StopRequest()
            topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
            try:
                run_worker(job, topo, stop)
                code = 0
            finally:
                topo.shutdown()
        except BaseException as e:
            if isinstance(e, RuntimeError) and transport_failure(e):
                print(f"trainyard: worker rank {rank} lost a server ({transport_failure(e)})", file=sys.stderr,
                      flush=True)
            else:
                import traceback
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pid_dir = job.config.run_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{rank}.supervisor.pid").write_text(str(os.getpid()))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        print(f"trainyard: parameter-server worker rank {rank} {how}; the servers go on without it",
              file=sys.stderr, flush=True)
    return None
