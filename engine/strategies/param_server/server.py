"""A server rank: owns whole layers and their optimizer state, applies the workers' gradients as the
layer's sync mode says (engine/techniques/ps_sync.py), and answers pulls for the layers' weights.

    PSServer(Setup(job, topo, stop, build_rank)).run()     # a server rank but 0, until server 0 says FINISH

Its loop takes one message at a time from every link's receiver thread: a gradient (GRAD), a pull
(PULL), a worker's sync profile (PROFILE), a paused worker's question (PING), a worker leaving (BYE,
LOST), and server 0's word (CONTROL, CKPT, GATHER, FINISH). Until every live worker's profile is in,
every layer runs bsp while the workers measure; then the configured mode. Server 0 is a PSServer too,
with more to do (engine/strategies/param_server/coordinator.py).
"""

from __future__ import annotations

import queue
import sys
import time

import torch

from engine.training.optim import lr_at, make_optimizer, set_lr
from engine.training.precision import reduce_dtype
from engine.runtime import checkpoint as ckpt, emulate
from engine.runtime.control import row_values
from engine.strategies.param_server.links import (
    ACK, ALL_LAYERS, BYE, CKPT, CONTROL, FINISH, GATHER, GRAD, LOST, PING, PROFILE, PULL, SERVER_STATS,
    STOP, TAG_PING, TAG_WEIGHTS, WEIGHTS, Message, flatten, link_error, pack_weights, unflatten_into)
from engine.strategies.param_server.setup import PeerLost, Setup
from engine.strategies.base import parameter_names
from engine.techniques.ps_sync import MODES, Arrival, LayerSync
from engine.techniques.updates.state import load_named_state, named_state

# per owned layer in a server's stats: index, version; the last update's workers, mean staleness and window ms;
# then since the server (re)started: updates applied, gradients in them, their staleness summed and at most, and
# their scales summed, and windows skipped for a non-finite gradient (TALLY)
LAYER_STATS = 11
TALLY = ("windows", "gradients", "staleness_sum", "staleness_max", "applied", "skipped")


class PSServer:
    def __init__(self, setup: "Setup"):
        self.setup = s = setup
        cfg, topo = s.cfg, s.topo
        p, timeout_s = cfg.parallel.param_server, cfg.parallel.collective_timeout_s
        self.rank, self.is_coordinator = topo.rank, topo.rank == 0
        self.workers = list(range(s.servers, topo.world_size))
        self.mine = [j for j, server in s.owner.items() if server == self.rank]
        self.names = s.model.names
        self.opt = {j: make_optimizer(cfg.optim, s.params[j]) for j in self.mine}
        for opt in self.opt.values():   # the server's optimizer state is on its device
            s.device.ledger.track_optimizer(opt)
        # gradients arrive in the working dtype and are summed in precision.reduce's (fp32: widened first)
        self.reduce_dtype = reduce_dtype(cfg.precision) if s.masters else torch.float32
        self.live, self.done, self.lost = set(self.workers), set(), {}
        self.target = p.sync                     # the mode once every worker's profile is in
        self.profiling = True                    # until then: bsp, while the workers measure
        self.sync = {j: LayerSync("bsp", set(self.workers), p.staleness_scaling, p.staleness_bound,
                                  wait_limit_s=timeout_s / 2, unit=p.staleness_unit) for j in self.mine}
        self.count = {j: s.first_step * len(self.workers) for j in self.mine}
        self.last = {}                           # layer -> its last Update
        self.tally = {j: [0, 0, 0.0, 0.0, 0.0, 0] for j in self.mine}   # layer -> TALLY's figures, since this start
        self.held = {j: [] for j in self.mine}   # layer -> [(worker, iteration)] waiting for weights
        self.flags = 0
        self.profiles: dict[int, list[float]] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.finished = False
        self.fault = emulate.Fault.install(cfg.emulate, self.rank, s.restart)   # emulate.kill_rank: first attempt
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
                grad = m.payload if m.payload is None else m.payload.to(self.reduce_dtype)
                self.apply(m.layer, self.sync[m.layer].offer(Arrival(m.peer, m.version, m.t, grad)))
                if self.fault and self.sync[m.layer].window is not None:   # emulate.kill_at: a window holds it
                    emulate.reached("window", self.global_step())
        elif m.kind == PULL:
            if m.payload is not None:
                self.worker_stats(m)
            for j in (self.mine if m.layer == ALL_LAYERS else [m.layer]):
                self.held[j].append((m.peer, m.iteration))
                self.serve(j)
        elif m.kind == PROFILE:
            self.profiles[m.peer] = m.payload.tolist()
            order = sorted(self.setup.params)
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
                raise PeerLost(f"server rank {m.peer} was lost ({m.error}); the run cannot go on "
                                       f"without its layers")
            if m.peer not in self.done:
                self.lose(m.peer, f"its process ended ({m.error})", m.t)
        elif m.kind == CONTROL:
            self.control(MODES[int(m.a)], int(m.b), m.t)
            self.setup.links[0].send(SERVER_STATS, payload=self.stats())
        elif m.kind == CKPT:
            self.setup.links[0].send(ACK, iteration=m.iteration, a=self.try_save(m.iteration))
        elif m.kind == GATHER:
            self.send_weights()
        elif m.kind == FINISH:
            failed = self.try_save(m.iteration) if m.a else 0
            self.send_weights()
            self.setup.links[0].send(ACK, iteration=m.iteration, a=failed)
            self.setup.links[0].send(BYE)
            self.setup.links[0].flush()
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
        params, optim = self.setup.params[j], self.setup.cfg.optim
        for update in updates:
            if update.grad is not None and optim.skip_nonfinite and not bool(torch.isfinite(update.grad).all()):
                self.tally[j][5] += 1   # this window's gradients hold inf or NaN: the layer's update is skipped
            elif update.grad is not None:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                unflatten_into(update.grad, [p.grad for p in params])
                # the schedule's step: the rounds of this layer's gradients in (bsp: exactly the step trained)
                rounds = max(0, self.count[j] // len(self.workers) - 1)
                set_lr(self.opt[j], lr_at(optim, rounds, self.setup.cfg.run.steps))
                self.opt[j].step()
            self.last[j] = update
            tally = self.tally[j]
            tally[0] += 1
            tally[1] += len(update.workers)
            tally[2] += sum(update.staleness)
            tally[3] = max(tally[3], max(update.staleness, default=0))
            tally[4] += sum(update.scales)
        self.serve(j)

    def serve(self, j: int) -> None:
        """Answer every held pull of layer j that may be answered now."""
        sync, still = self.sync[j], []
        done = self.flags & STOP or self.global_step() >= self.setup.cfg.run.steps
        for worker, iteration in self.held[j]:
            if worker not in self.live:
                continue
            if done or sync.pull_ready(worker, iteration):
                self.send_layer(worker, j, STOP if done else self.flags)
            else:
                still.append((worker, iteration))
        self.held[j] = still

    def send_layer(self, worker: int, j: int, flags: int) -> None:
        reply = pack_weights(self.setup.params[j], self.setup.link_dtype, self.sync[j].version, flags)
        try:
            self.setup.links[worker].send_tensor(reply, TAG_WEIGHTS + j)
        except RuntimeError as e:
            self.lose(worker, f"its link failed ({link_error(e)})", time.monotonic())

    def _reply_flags(self, worker: int) -> None:
        flags = self.flags | (STOP if self.global_step() >= self.setup.cfg.run.steps else 0)
        try:
            self.setup.links[worker].send_tensor(torch.tensor([float(flags)]), TAG_PING)
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
        self.setup.device.ledger.refresh()
        ledger = self.setup.device.stats()
        row = row_values(ledger)
        for j in self.mine:
            u = self.last.get(j)
            row += [j, self.sync[j].version, len(u.workers) if u else 0, u.mean_staleness if u else 0.0,
                    u.window_s * 1000 if u else 0.0, *self.tally[j]]
        return torch.tensor(row, dtype=torch.float64)

    def try_save(self, step: int) -> int:
        """This server's file of checkpoint `step`: 0 when written, else the write's errno (a full disk): what
        the ACK says, so that server 0 stops the run naming the previous checkpoint (a server that died of it
        would be restarted into the same full disk)."""
        try:
            self.save(step)
        except OSError as e:
            return e.errno or -1
        return 0

    def save(self, step: int) -> None:
        """This server's part of checkpoint `step`: its layers' weights (fp32 where it keeps masters; a tied
        weight by its first holder's server) and buffers, their optimizer state by global name, and each
        layer's version (what staleness counts from)."""
        model, names = self.setup.model, parameter_names(self.setup.model)
        weights, optimizer = {}, {}
        for j in self.mine:
            weights.update({names[id(p)]: p.detach() for p in self.setup.params[j]})
            kept = model.layers[j].state_dict().keys()   # a non-persistent buffer is not a checkpoint's
            weights.update({f"layers.{j}.{k}": b.detach() for k, b in model.layers[j].named_buffers() if k in kept})
            optimizer.update(named_state(self.opt[j], self.setup.params[j], names, copy=False))
        ckpt.write_rank_file(ckpt.staging_dir(self.setup.cfg.run_dir, step), self.rank, weights, optimizer, {},
                             {"param_server_version": {self.names[j]: self.sync[j].version for j in self.mine}})

    @torch.no_grad()
    def load(self, reader) -> None:
        """This server's layers from a checkpoint of any strategy and world size, by name. A layer's version
        is the parameter server's that wrote it, or else the step (one update per step, as in bsp)."""
        model, names = self.setup.model, parameter_names(self.setup.model)
        versions = reader.extras().get("param_server_version", {})
        step = int(reader.manifest["step"])
        for j in self.mine:
            for key, value in model.layers[j].state_dict(keep_vars=True).items():
                value.copy_(reader.weight(f"layers.{j}.{key}", tuple(value.shape)))
            load_named_state(self.opt[j], self.setup.params[j], names, reader.optimizer)
            self.sync[j].restore(int(versions.get(self.names[j], step)))

    def send_weights(self) -> None:
        for j in self.mine:
            self.setup.links[0].send(WEIGHTS, j, self.sync[j].version, payload=flatten(self.setup.params[j]))
