"""Server 0, the coordinator: a server that also counts the global step, applies the hub's commands,
tells the other servers the sync mode and the flags, logs the telemetry, writes the checkpoints and
ends the run; and `run_server`, where every server rank starts.

    summary = run_server(job, topo, stop, build_rank)   # engine/run/worker.py, on ranks below parallel.param_server.servers

The global step is the least gradient count of its own layers, over the number of workers. A checkpoint is every
server's file of its own layers (CKPT, then an ACK each), finalized here with the run's manifest; an
evaluation first gathers every layer's weights (GATHER) into this rank's model.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import time

import torch
from rich.markup import escape

from engine.runtime import checkpoint as ckpt
import engine.training.evaluation as evaluation
from engine.runtime.control import FIELDS, rank_rows, row_values
from engine.runtime.lifecycle import step_record
from engine.runtime.run_core import RunCore
from engine.strategies.param_server.links import (
    ACK, CKPT, CONTROL, FINISH, GATHER, PAUSED, SERVER_STATS, STOP, WEIGHTS, Message, mode_code, unflatten_into)
from engine.training.optim import lr_at
from engine.strategies.param_server.losses import StepLosses
from engine.strategies.param_server.server import LAYER_STATS, TALLY, PSServer
from engine.strategies.param_server.setup import PeerLost, Setup
from engine.telemetry.outlets import Telemetry

CONTROL_EVERY_S = 0.25     # the coordinator tells the servers the state at least this often
STALE_AFTER_S = 2.0        # a worker silent this long (and for 5 of its iterations) has a stale row


class Coordinator(PSServer):
    """Server 0: also counts the global step, applies commands (set-sync; those every run takes, the run core's)
    and drives the run core (engine/runtime/run_core.py), which logs, publishes checkpoints and ends the run."""

    def __init__(self, setup: "Setup", tel):
        super().__init__(setup)
        self.tel, self.cfg, self.job = tel, setup.cfg, setup.job
        self.core = RunCore(setup.job, setup.topo, tel, driver=self)   # what every run does
        cfg = setup.cfg
        self.sync_mode = cfg.parallel.param_server.sync
        self.reported = setup.first_step         # the last step whose record is written
        self.counted = setup.first_step          # the last global step seen (checkpoints, evaluations)
        self.rows: dict[int, list[float]] = {}
        self.info = {w: {"rank": w, "iterations": setup.first_step, "steps_per_s": 0.0, "wait_ms": 0.0,
                         "compute_ms": 0.0, "slow_factor": float(cfg.parallel.param_server.slow_workers.get(str(w), 1.0)),
                         "alive": True, "_t": None, "_step": setup.first_step} for w in self.workers}
        self.server_rows: dict[int, torch.Tensor] = {}
        self.losses = StepLosses()
        self.last_loss: float | None = None
        self.loss_workers = 0                    # how many workers' losses the last record's loss averages
        self.acks: dict[tuple[int, int], int] = {}   # (server, step) -> 0, or the errno of its failed write
        self.gathered: set[int] = set()
        self.stop_deadline = 0.0
        self.last_control = 0.0
        self.t_report = time.perf_counter()
        self.summary: dict | None = None

    # --- messages ------------------------------------------------------------------------------
    def worker_stats(self, m: Message) -> None:
        row = m.payload.tolist()
        self.rows[m.peer] = row
        self.losses.add(m.iteration - 1, m.peer, row[FIELDS.index("loss")])   # sent with the next iteration's pull
        info, now = self.info[m.peer], time.monotonic()
        if info["_t"] is not None and m.iteration > info["iterations"]:
            rate = (m.iteration - info["iterations"]) / max(now - info["_t"], 1e-6)
            info["steps_per_s"] = rate if not info["steps_per_s"] else 0.8 * info["steps_per_s"] + 0.2 * rate
        info.update(iterations=m.iteration, _t=now, _step=self.global_step(), wait_ms=row[FIELDS.index("wait_ms")],
                    compute_ms=row[FIELDS.index("fwd_ms")] + row[FIELDS.index("bwd_ms")])

    def coordinate(self, m: Message) -> None:
        if m.kind == SERVER_STATS:
            self.server_rows[m.peer] = m.payload
        elif m.kind == ACK:
            self.acks[(m.peer, m.iteration)] = int(m.a)
        elif m.kind == WEIGHTS:
            unflatten_into(m.payload, self.setup.params[m.layer])
            self.gathered.add(m.layer)

    def worker_lost(self, worker: int, reason: str) -> None:
        super().worker_lost(worker, reason)
        self.info[worker]["alive"] = False
        step = self.global_step()
        self.tel.event("worker_lost", step, rank=worker, reason=reason)
        self.tel.note(f"[yellow]worker rank {worker} lost[/] at step {step}: {escape(reason)}; the servers go on "
                      f"with {len(self.live)} worker(s)")

    def profile_done(self) -> None:
        order = sorted(self.setup.params)
        layers = []
        for j in order:
            entry = {"name": self.names[j], "server": self.setup.owner[j],
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
            self.core.take(command, self.global_step())
        if self.setup.stop.requested and self.core.stop_reason is None:
            self.core.begin_stop(f"signal {signal.Signals(self.setup.stop.signal).name}")
        step = self.global_step()
        self.report(min(step, self.setup.cfg.run.steps))   # the records whose losses are in
        if step > self.counted:
            self.boundary(step)
        if step >= self.setup.cfg.run.steps and self.core.stop_reason is None:
            self.core.begin_stop("finished")
        if now - self.last_control >= CONTROL_EVERY_S:
            self.tell_servers()
        if self.core.stop_reason is not None:
            if self.live and now > self.stop_deadline:
                for worker in sorted(self.live):
                    self.lose(worker, "did not leave within parallel.collective_timeout_s of the stop", now)
            if not self.live:
                self.finish()
        elif not self.live:
            raise PeerLost("every worker was lost: " + "; ".join(
                f"rank {w}: {why}" for w, why in sorted(self.lost.items())))

    def tell_servers(self) -> None:
        self.last_control = time.monotonic()
        for server in range(1, self.setup.servers):
            self.setup.links[server].send(CONTROL, iteration=self.global_step(), a=mode_code(self.sync_mode),
                                          b=self.flags)

    def own_command(self, command: dict, step: int) -> bool:
        if command["name"] != "set-sync":
            return False
        previous, self.sync_mode = self.sync_mode, command["args"][0]
        self.control(self.sync_mode, self.flags, time.monotonic())
        self.tel.event("sync_mode", step, mode=self.sync_mode, previous=previous, source="command")
        self.tel.update_state(sync=self.sync_mode)
        self.tell_servers()
        return True

    def paused_changed(self) -> None:
        self.control(self.sync_mode, (self.flags & ~PAUSED) | (PAUSED if self.core.paused else 0), time.monotonic())
        self.tell_servers()

    def stopping(self) -> None:
        """The run core begins the stop: the servers are told, the workers given collective_timeout_s to leave."""
        self.stop_deadline = time.monotonic() + self.setup.cfg.parallel.collective_timeout_s
        self.control(self.sync_mode, self.flags | STOP, time.monotonic())
        self.tell_servers()

    # --- telemetry -----------------------------------------------------------------------------
    def report(self, step: int, final: bool = False) -> None:
        """Step records up to global step `step`, each once its loss is known (StepLosses); `final`: the run
        ends, and a step whose losses never came (its workers died) repeats the previous loss."""
        cfg = self.setup.cfg
        losses = []
        for record_step in range(self.reported + 1, step + 1):
            mean = self.losses.of_step(record_step, self.live, step, final)
            if mean is None:
                if not final or self.last_loss is None:
                    break
                mean = (self.last_loss, self.loss_workers)
            losses.append(mean)
            self.last_loss, self.loss_workers = mean
        if not losses:
            return
        now = time.perf_counter()
        dt = max(now - self.t_report, 1e-9)
        self.t_report = now
        figures = self._figures(cfg.data.batch_size * len(losses) / dt, dt * 1000 / len(losses))
        ps = figures.pop("ps")
        for record_step, (loss, n) in enumerate(losses, self.reported + 1):
            lr = lr_at(cfg.optim, record_step - 1, cfg.run.steps)
            self.core.record(step_record(record_step, loss, lr, **figures, ps={**ps, "loss_workers": n}))
        self.reported += len(losses)
        self.losses.forget_before(self.reported)

    def _figures(self, samples_per_s: float, step_ms: float) -> dict:
        """What a step record says besides its step, loss and lr (step_record's arguments): every rank's row,
        the workers and the layers now."""
        cfg = self.setup.cfg
        table = self._table()
        ranks = rank_rows(table)
        for entry in ranks:
            r = entry["rank"]
            entry["role"] = "server" if r < self.setup.servers else "worker"
            if r >= self.setup.servers:
                entry["alive"] = self.info[r]["alive"]
                entry["stale_steps"] = self._stale_steps(self.info[r])
        workers = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items() if not k.startswith("_")}
                   for info in self.info.values()]
        alive = [w for w in workers if w["alive"]]
        mean = (lambda key: sum(w[key] for w in alive) / len(alive)) if alive else (lambda key: 0.0)
        return {"samples_per_s": samples_per_s, "step_ms": step_ms, "ranks": ranks,
                "compute_ms": round(mean("compute_ms"), 4), "comm_ms": 0.0, "wait_ms": round(mean("wait_ms"), 4),
                "streams": [], "ps": {"mode": self.sync_mode, "profiling": self.profiling,
                                      "staleness_bound": cfg.parallel.param_server.staleness_bound,
                                      "workers_live": len(self.live), "workers_lost": sorted(self.lost),
                                      "workers": workers, "layers": self._layer_rows()}}

    def _stale_steps(self, info: dict) -> int:
        """Global steps since a worker's figures came, once they are overdue: it is lost, or has sent nothing for
        5 of its own iterations (and at least STALE_AFTER_S). 0 while it reports at its own pace, however slow."""
        if info["_t"] is None:
            return 0
        overdue = max(STALE_AFTER_S, 5 / info["steps_per_s"] if info["steps_per_s"] else STALE_AFTER_S)
        if info["alive"] and time.monotonic() - info["_t"] < overdue:
            return 0
        return max(self.global_step() - info["_step"], 0)

    def boundary(self, step: int) -> None:
        """The global step moved on to `step` (from self.counted): the checkpoints and evaluations due."""
        cfg = self.setup.cfg
        steps = step - self.counted
        self.counted = step
        self.tel.update_state(step=step)
        if time.monotonic() - self.last_control >= 0.05:
            self.tell_servers()   # and their figures come back for the next record
        every, evals = cfg.checkpoint.every, cfg.run.eval_every
        if every and step // every > (step - steps) // every and step < cfg.run.steps:
            self.checkpoint(step)
        if evals and step // evals > (step - steps) // evals and step < cfg.run.steps:
            self.tel.event("eval", step, **self.evaluate(), wall_s=round(
                time.time() - (self.setup.job.launched_at or time.time()), 3))

    def _table(self) -> torch.Tensor:
        rows = []
        for r in range(self.setup.topo.world_size):
            if r == self.rank:
                row = self.stats()[:len(FIELDS)].tolist()
            elif r < self.setup.servers:
                row = self.server_rows[r][:len(FIELDS)].tolist() if r in self.server_rows else row_values({})
            else:
                row = self.rows.get(r) or row_values({})
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float64)

    def _layer_rows(self) -> list[dict]:
        stats = {}
        for r, row in [(self.rank, self.stats())] + sorted(self.server_rows.items()):
            per_layer = row[len(FIELDS):].view(-1, LAYER_STATS).tolist() if row.numel() > len(FIELDS) else []
            for j, version, n, staleness, ms, *tally in per_layer:
                stats[int(j)] = {"name": self.names[int(j)], "server": r, "version": int(version),
                                 "window_workers": int(n), "mean_staleness": round(staleness, 4),
                                 "window_ms": round(ms, 4),
                                 **{key: (int(v) if key in ("windows", "gradients", "skipped") else round(v, 6))
                                    for key, v in zip(TALLY, tally)}}
        return [stats[j] for j in sorted(stats)]

    # --- checkpoints, evaluation, the end -------------------------------------------------------
    def _await(self, done, what: str) -> None:
        deadline = time.monotonic() + self.setup.cfg.parallel.collective_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise PeerLost(f"timed out waiting for {what}")
            try:
                message = self.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            self.handle(message)
            PSServer.tick(self, time.monotonic())

    def checkpoint(self, step: int) -> None:
        """Every server's file of its own layers, then the run's manifest (the run core's checkpoint command too).
        Synchronous: the coordinator serves no worker while it writes its own file (stall_ms is write_ms)."""
        t0 = time.perf_counter()
        for server in range(1, self.setup.servers):
            self.setup.links[server].send(CKPT, iteration=step)
        failed = self.try_save(step)
        self._await(lambda: all((s, step) in self.acks for s in range(1, self.setup.servers)),
                    f"the servers' checkpoint files for step {step}")
        self.publish(step, failed, t0)

    def publish(self, step: int, failed: int, t0: float) -> None:
        """Checkpoint `step` once every server has answered: published, or, when a server's write failed
        (`failed`: this one's errno, the others' in their ACKs), the staged files removed and the run
        stopped with CheckpointWriteError naming the previous checkpoint (exit status 2, no restart)."""
        run_dir = self.setup.cfg.run_dir
        errors = {0: failed, **{s: self.acks[(s, step)] for s in range(1, self.setup.servers)}}
        path = None
        if not any(errors.values()):
            try:
                path = ckpt.finalize(run_dir, step, self.setup.manifest(step), keep=self.setup.cfg.checkpoint.keep)
            except OSError as e:
                errors[0] = e.errno or -1
        if path is None:
            shutil.rmtree(ckpt.staging_dir(run_dir, step), ignore_errors=True)
            server, errno = next((s, e) for s, e in sorted(errors.items()) if e)
            why = os.strerror(errno) if errno > 0 else "the write failed"
            raise ckpt.write_failed(run_dir, step, f"{why} (server rank {server})")
        write_ms = (time.perf_counter() - t0) * 1000   # synchronous: the stall is the write and its publication
        self.core.checkpointed(step, path, write_ms, write_ms, write_ms)

    def gather(self) -> None:
        """Every layer's weights, from the servers that own them, into this rank's model."""
        self.gathered = set(self.mine)
        for server in range(1, self.setup.servers):
            self.setup.links[server].send(GATHER)
        self._await(lambda: self.gathered >= set(self.setup.params), "the servers' weights")

    def evaluate(self) -> dict:
        """The evaluation's figures (engine/training/evaluation.py), on this rank's copy of every server's weights."""
        setup = self.setup
        n = evaluation.samples(setup.data, setup.cfg.data.eval_samples)
        if not n:
            return dict(evaluation.NONE)
        if len(self.gathered) < len(setup.params):
            self.gather()
        self.gathered = set()
        counts = evaluation.share_counts(setup.model, setup.data, setup.device.torch_device, setup.cfg.precision,
                                         setup.loss_fn, 0, n, setup.cfg.data.batch_size)
        return evaluation.figures(counts, setup.loss_fn)

    def finish(self) -> None:
        cfg, step = self.setup.cfg, self.global_step()
        step = min(step, cfg.run.steps) if self.core.stop_reason == "finished" else step
        stopped_early = step < cfg.run.steps
        save = step > self.setup.first_step or stopped_early
        self.report(step, final=True)   # every worker has left: every loss that will come is in
        self.gathered = set(self.mine)
        for server in range(1, self.setup.servers):
            self.setup.links[server].send(FINISH, iteration=step, a=float(save))
        t0 = time.perf_counter()
        failed = self.try_save(step) if save else 0
        self._await(lambda: all((s, step) in self.acks for s in range(1, self.setup.servers))
                    and self.gathered >= set(self.setup.params), "the servers' final checkpoint files and weights")
        for link in self.setup.links.values():
            link.flush()
        if save:
            self.publish(step, failed, t0)
        if self.core.stop_reason == "finished":
            self.core.stop_reason = "workers left"   # "finished" short of the steps: its workers left
        self.summary = self.core.end(step, stopped_early, self.last_loss, self.evaluate(), {
            "capacity_bytes": self.setup.device.ledger.capacity_bytes,
            "simulated": self.setup.device.simulated, "restarts": self.setup.restart, "sync": self.sync_mode,
            "workers_lost": sorted(self.lost)})
        self.finished = True


def run_server(job, topo, stop, build) -> dict | None:
    """A server rank (rank 0: the coordinator too). Returns rank 0's summary."""
    try:
        setup = Setup(job, topo, stop, build)
        if topo.rank != 0:
            PSServer(setup).run()
            return None
    except Exception as e:
        print(f"trainyard: parameter server rank {topo.rank} failed: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise
    tel = Telemetry.open(job, setup.hello(), True, setup.first_step)
    try:
        coordinator = Coordinator(setup, tel)
        coordinator.core.start(setup.device, setup.model.names, setup.first_step, setup.restart, setup.resume,
                               setup.layout(), sync=job.config.parallel.param_server.sync)
        coordinator.run()
    except BaseException as e:
        print(f"trainyard: parameter server rank 0 failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        tel.close(f"run failed ({type(e).__name__}: {e})")
        raise
    return {"type": "summary", **coordinator.summary}
