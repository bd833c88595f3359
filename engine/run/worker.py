"""One training worker's step loop: resume, the steps, checkpoints, telemetry, the end.

The launcher (engine/run/launch.py) starts `world_size` worker processes through torch's
elastic agent (engine/run/worker_entry.py worker_main makes each one's Worker);
`torchrun --nproc-per-node N -m engine.worker CONFIG.toml` starts them the same way on any number of hosts.

Every step ends at a boundary where the ranks exchange one small vector on the
side group: loss, timings, ledger figures and a stop flag. So every rank agrees on
when to stop, and rank 0 has what it logs and draws. The loop asks the strategy only what its contract
names (engine/strategies/base.py), and forwards the events each technique makes (engine/runtime/events.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.training.data import batch_for, global_count
from engine.training.loss import cross_entropy
from engine.training.optim import lr_at
from engine.training.precision import compute_in
from engine.runtime import checkpoint as ckpt
from engine.runtime.control import column, encode_commands, exchange, share_commands
from engine.runtime.emulate import Emulated
from engine.processes.lifeline import launcher_gone
from engine.runtime.events import forward
from engine.runtime.lifecycle import StopRequest, hello
from engine.runtime.run_core import RunCore, resume_point
from engine.runtime.profiler import LayerProfiler
from engine.runtime.topology import Topology
from engine.runtime.trace import StepTrace
from engine.run.checkpointer import Checkpointer
from engine.models.compile import compile_figures, eager_layers
from engine.run.compiles import CompileReport
from engine.run.fit import settle_auto
from engine.run.layer_rows import LayerRows
from engine.run.rank import Job, build_rank, restart_marked
from engine.run.report import StepReport, Throughput
from engine.strategies.interface import make_strategy
from engine.telemetry.outlets import Telemetry
from engine.techniques.memory import ActivationPolicy
from engine.techniques.memory_report import plans_made, step_fields
from engine.training.throughput import counted_flops, device_peak_flops, tokens_per_sample
from engine.training.timing import Clock

PAUSED_POLL_S = 0.1   # how often paused ranks meet at the boundary to hear "resume" or "stop"
# a range of hosts, a stop by a signal: how long a rank whose peers stopped waits for its own agent's signal (the
# agents see a joining host within their 0.1 s monitor interval of each other)
RESTART_WAIT_S = 10.0
# a stop's final checkpoint before any was timed in this process: its fixed cost, and a write rate well below a
# disk's (a GPU machine's checkpoints were measured at 0.5 GB/s)
FIRST_CHECKPOINT_S = 0.5
FIRST_CHECKPOINT_BPS = 250e6


@dataclass
class Trained:
    """What this rank's part of a step leaves for the boundary."""
    loss: float
    step_ms: float
    fields: dict          # the activation policy's figures for the exchange
    layers: list | None   # this rank's measured layer rows, when due
    rows_due: bool


class Worker:
    """The step loop: a driver of the run core (engine/runtime/run_core.py), which owns what every run does."""

    def __init__(self, job: Job, topo: Topology, stop: StopRequest):
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.mode, self.run_dir = cfg.parallel.strategy, cfg.run_dir
        self.restart, self.device, self.data, self.model = build_rank(job, topo)
        self.emulated = Emulated.install(self.model, cfg.emulate, topo.rank, self.restart)   # before any timing hook
        self.loss_fn = job.loss_fn or cross_entropy
        self.strategy = make_strategy(cfg, self.model, topo, self.device, self.loss_fn)
        self.device.ledger.track_module(self.strategy.tracked_module(), self.strategy.optimizer)
        # which share of every global batch this rank takes: its index in the strategy's data-parallel group
        self.share = self.strategy.parallel_groups(topo.rank, topo.world_size).share(topo.rank)
        # every layer's saved activations: keep, swap or recompute (a pipeline stage plans for its own layers)
        self.memory = ActivationPolicy(self.model, self.device, cfg.memory, owned=self.strategy.owned_layers,
                                       in_flight=self.strategy.in_flight)
        self.resume, self.resumed = None, None
        self.first_step = self._resume()
        # `auto` where keep and all-device fit: decided before step 1, no trial (engine/run/fit.py)
        self.fit_events = settle_auto(cfg, self.model, self.data, self.device, self.memory, self.strategy,
                                      self.loss_fn, self.first_step)
        if self.first_step == 0:   # dropout streams differ per rank, reproducible from the seed
            torch.manual_seed(cfg.run.seed + 1000 * topo.rank)
        self.profiler = LayerProfiler(self.model, self.device.ledger, Clock(self.device.torch_device)) \
            if cfg.telemetry.layer_every else None
        self.tel = Telemetry.open(job, self._hello(), topo.is_first, self.first_step)
        self.core = RunCore(job, topo, self.tel, driver=self)   # what every run does (engine/runtime/run_core.py)
        self.checkpoints = Checkpointer(cfg, topo, self.strategy, self.model, self.device, self.core)
        self.wait_ms = 0.0
        self.step_now = None        # the step being trained, 1-based as the records count (where())
        self.checkpoint_s = None    # the last checkpoint's time: whether a final one fits a stop's grace
        self.lr = cfg.optim.lr   # the last step's learning rate (engine/training/optim.py lr_at)
        self.layer_rows = LayerRows(self.strategy, self.memory, self.topo)   # the console's layer table
        self.report = StepReport(self.core, cfg, self.strategy, self.layer_rows, topo)
        self.compiles = CompileReport(topo.world_size)   # `[model] compile`: its time, apart from the steps'
        # what a step achieves: tokens_per_s from the first batch's shape, mfu where the device's peak is known
        # (its FLOPs counted once, on the first step where no layer recomputes)
        self.peak_flops, self.peak_source = device_peak_flops(self.device.name, cfg.precision.compute,
                                                              cfg.device.peak_tflops)
        self.flops = 0
        self.trace = StepTrace.from_config(cfg.telemetry.trace_steps, self.run_dir, topo.rank,
                                           self.device.torch_device)   # None where off

    def _hello(self) -> dict:
        updated = [n for n, layer in zip(self.model.names, self.model.layers) if any(True for _ in layer.parameters())]
        return hello(self.cfg, self.topo, self.device, self.model.names, self.strategy.layout(), updated,
                     ["set-policy"])   # the loop's own, after the strategy's (its spec's)

    def _resume(self) -> int:
        """Load the checkpoint this run resumes from (any strategy's, any world size's: by name); returns its
        step. A rank's RNG carries over where the job's shape is the one that wrote it; elsewhere it starts
        from the seed and the step, and rank 0 says so."""
        resume = self.resume = resume_point(self.cfg, self.job, self.restart)
        if resume is None:
            return 0
        t0 = time.perf_counter()
        step, manifest = resume.step, resume.manifest
        same_shape = resume.same_shape(self.topo.world_size, self.mode)
        with resume.reader() as reader:
            self.strategy.load(reader)
            rng = reader.rng(self.topo.rank) if same_shape else None
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if self.device.kind == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"])
        else:
            torch.manual_seed(self.cfg.run.seed + 1000 * self.topo.rank + 7919 * step)
            if self.topo.is_first:
                print(f"trainyard: resuming from a {manifest['world_size']}-worker "
                      f"{manifest['layout'].get('strategy')!r} checkpoint as {self.topo.world_size} "
                      f"{self.mode!r} workers: the weights, optimizer state and data position (step {step}) carry "
                      f"over; each rank's random stream (dropout) starts afresh from run.seed", file=sys.stderr,
                      flush=True)
        self.device.ledger.refresh()
        load_ms = torch.tensor([(time.perf_counter() - t0) * 1000])   # the slowest rank's: when all could go on
        dist.all_reduce(load_ms, op=dist.ReduceOp.MAX, group=self.topo.side)
        self.resumed = {"load_ms": round(float(load_ms), 1), "from_world_size": manifest["world_size"],
                        "from_strategy": manifest["layout"].get("strategy")}
        return step

    # --- the loop: batch, train step, exchange, report, commands, boundary -----------------------------
    def run(self) -> dict | None:
        core = self.core
        core.start(self.device, self.model.names, self.first_step, self.restart, self.resume, self.strategy.layout(),
                   resumed=self.resumed)
        forward(self.tel, self.first_step, self.fit_events)
        step, loss, last = self.first_step, None, time.perf_counter()
        while True:
            self.step_now = step + 1
            if self.trace:
                self.trace.before(step)
            trained = self._train(step) if not core.paused and step < self.cfg.run.steps else None
            step += trained is not None
            table, commands = self._exchange(trained)
            self.checkpoints.boundary(table)   # publishes what every rank has written; a failed write stops all
            if trained:
                refusal, events = plans_made(self.memory, table, self.topo.rank, self.cfg, step)
                if refusal:
                    return self._refuse(step, refusal)
                forward(self.tel, step, events)
                loss = self.strategy.step_loss(column(table, "loss"))
                layers = self.layer_rows.gather(trained.layers, table, trained.rows_due)
                now = time.perf_counter()
                self.report.step(step, loss, table, now - last, layers, self.lr)
                last = now
                if self.trace:
                    self.trace.after(step)
                self._due(step)
                forward(self.tel, step, self.strategy.events(step, table, self.run_dir))
                if self.cfg.model.compile:
                    forward(self.tel, step, self.compiles.events(step, table))
            for command in commands:
                core.take(command, step)
            forward(self.tel, step, self.strategy.boundary(step, trained is not None, self.memory))
            if max(column(table, "stop")) > 0 and core.stop_reason is None:
                gone = " (the launcher is gone)" if launcher_gone() else ""
                core.begin_stop(f"signal {self.stop.signal or 'on another rank'}{gone}")
            if core.stop_reason or step >= self.cfg.run.steps:
                return self._finish(step, loss)
            if core.paused:
                time.sleep(PAUSED_POLL_S)
                last = time.perf_counter()
            elif self.cfg.run.step_pause_ms:
                time.sleep(self.cfg.run.step_pause_ms / 1000)

    def _train(self, step: int) -> Trained:
        """This rank's part of step `step` (0-based): its share of the batch, through the strategy."""
        cfg, strategy = self.cfg, self.strategy
        x, y = batch_for(self.data, step, cfg.data.batch_size, cfg.run.seed, *self.share)
        self.lr = lr_at(cfg.optim, step, cfg.run.steps)
        strategy.begin_step(self.lr, global_count(self.data, step, cfg.data.batch_size, cfg.run.seed, self.loss_fn))
        rows_due = bool(self.profiler) and (step == self.first_step or (step + 1) % cfg.telemetry.layer_every == 0)
        profile = rows_due and (self.topo.is_first or self.layer_rows.by_stage)
        if profile:
            self.profiler.arm()
        self.memory.before_step(step)
        self.emulated.at(step)
        out_before, wait_before = self.memory.swapped_out_bytes(), self.memory.link_wait_s()
        if step == self.first_step:
            tokens = tokens_per_sample(x)
            self.report.throughput = Throughput(tokens * cfg.data.batch_size if tokens else 0, self.peak_flops,
                                                self.topo.world_size)
        count = self.peak_flops is not None and not self.flops and not self.memory.recomputes()
        t0 = time.perf_counter()
        with compute_in(cfg.precision, self.device.torch_device):   # bf16: under autocast
            if count:   # compiled layers run eager here: dynamo would skip their code for good under the counter
                with eager_layers(self.model.layers) if cfg.model.compile else contextlib.nullcontext():
                    loss, flops, why = counted_flops(lambda: strategy.train_step(x, y))
                self.flops = flops or 0
                if why:   # no MFU where the FLOPs are unknown: a count without some operator's would be low
                    self.peak_flops = self.report.throughput.peak_flops = None
                    if self.topo.is_first:
                        print(f"trainyard: {why}", file=sys.stderr, flush=True)
            else:
                loss = strategy.train_step(x, y)
            loss = loss or 0.0   # None: a pipeline stage before the last
        step_ms = (time.perf_counter() - t0) * 1000
        plan = self.memory.after_step(step)
        fields = step_fields(self.memory, plan, self.memory.swapped_out_bytes() - out_before,
                             self.memory.link_wait_s() - wait_before)
        return Trained(loss, step_ms, fields, self.profiler.finish() if profile else None, rows_due)

    def _exchange(self, trained: Trained | None) -> tuple[torch.Tensor, list[dict]]:
        """Every rank's figures and the operator's commands, the same on every rank (engine/runtime/control.py)."""
        payload = encode_commands(self.tel.take_commands())
        t_wait = time.perf_counter()
        fields = trained.fields if trained else step_fields(self.memory, None, 0, 0.0)   # idle: no plan, no swap
        table = exchange(self.topo, {"stop": float(self.stop.requested), "command_bytes": len(payload),
                                     "loss": trained.loss if trained else 0.0,
                                     "step_ms": trained.step_ms if trained else 0.0, "wait_ms": self.wait_ms,
                                     "flops": self.flops,
                                     **self.strategy.timings, **fields, **compile_figures(),
                                     **self.device.stats(), **self.checkpoints.columns()})
        commands = share_commands(self.topo, payload, table)
        self.wait_ms = (time.perf_counter() - t_wait) * 1000
        return table, commands

    def _due(self, step: int) -> None:
        """The checkpoint and evaluation due after step `step`."""
        cfg = self.cfg
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.run.steps:
            self.checkpoint(step)
        if cfg.run.eval_every and step % cfg.run.eval_every == 0:
            figures = self.evaluate()   # every rank (a pipeline evaluates through its stages)
            if self.topo.is_first:
                self.tel.event("eval", step, **figures)

    # --- the operator's commands (engine/runtime/run_core.py takes those every run takes) ----------------
    def paused_changed(self) -> None:
        """Every rank reads the core's `paused` at the boundary."""

    def stopping(self) -> None:
        """Every rank reads the core's `stop_reason` at the boundary."""

    def own_command(self, command: dict, step: int) -> bool | None:
        """Every rank runs this for the same commands at the same boundary."""
        name, args = command["name"], command.get("args", [])
        events = self.strategy.command(command, step)
        if events is not None:   # the strategy's own (a pipeline's rebalance): answered in its events or later
            forward(self.tel, step, events)
            return None
        if name == "set-policy":
            self.memory.set(*args)
            self.layer_rows.stale = True
            self.tel.event("policy", step, layer=args[0], policy=args[1], source="command")
        elif name == "set-placement":
            self.strategy.sync()
            self.strategy.updater.set_placement(*args)
            self.layer_rows.stale = True
            self.tel.event("placement", step, layer=args[0], placement=args[1], source="command")
        else:
            return False
        return True

    def _refuse(self, step: int, reason: str) -> dict | None:
        """End a run whose memory plan cannot fit: no checkpoint, no restart (it would fail the same way)."""
        self.memory.close()
        if not self.topo.is_first:
            return None
        self.tel.event("stop", step, reason=f"refused: {reason}")
        self.tel.close(f"run refused ({reason})")
        return {"type": "refused", "error": reason}

    # --- checkpoints, evaluation, the end ----------------------------------------
    def checkpoint(self, step: int) -> None:
        """Every rank: the step waits for a snapshot of what it writes in host memory, and its writer thread
        writes it; rank 0 publishes it once every rank's column of the exchange says its file is written
        (engine/run/checkpointer.py). A write that fails on any rank (a full disk) stops the run on every rank
        at the next boundary with CheckpointWriteError, the staged files removed and the previous checkpoint
        untouched."""
        self.checkpoints.take(step)

    def where(self) -> str:
        """Where this rank is, for an error's line: the step it trains, or its start."""
        return f"step {self.step_now}" if self.step_now is not None else "while starting"

    def _final_checkpoint_fits(self, step: int) -> bool:
        """A stop by a signal: whether the final checkpoint fits the time left before the process is killed
        (parallel.shutdown_timeout_s from the signal), on every rank; where it does not, it is skipped and said.
        Its time: the last checkpoint's, or before any, the bytes this rank holds at FIRST_CHECKPOINT_BPS."""
        if not (self.core.stop_reason or "").startswith("signal"):   # agreed by every rank at the boundary
            return True
        if self.checkpoint_s is not None:
            needs_s = self.checkpoint_s
        else:
            held = sum(p.numel() * p.element_size() for p in self.model.parameters())
            needs_s = FIRST_CHECKPOINT_S + 3 * held / FIRST_CHECKPOINT_BPS   # weights and two optimizer moments
        margin = torch.tensor([min(self.stop.seconds_left() - needs_s, 1e9)])
        dist.all_reduce(margin, op=dist.ReduceOp.MIN, group=self.topo.side)
        if margin.item() > 0:
            return True
        why = (f"the final checkpoint of step {step} was skipped: it needs about {needs_s:.1f} s, more than is "
               f"left of parallel.shutdown_timeout_s = {self.cfg.parallel.shutdown_timeout_s:g}; "
               f"{ckpt.latest_said(self.run_dir)}")
        if self.topo.is_first:
            self.tel.event("checkpoint_skipped", step, needs_s=round(needs_s, 2),
                           shutdown_timeout_s=self.cfg.parallel.shutdown_timeout_s)
            self.tel.note(f"[yellow]{why}")
            print(f"trainyard: {why}", file=sys.stderr, flush=True)
        return False

    def restarting(self) -> bool:
        """A range of hosts stopped by a signal, the final checkpoint written: whether this host's agent is
        restarting the group to take in a host that joins (its launcher marks it before the agent signals the
        workers; rank.restart_marker), so the run goes on and this is no end: no evaluation, no summary. A
        rank whose stop came from its peers waits up to RESTART_WAIT_S for its own agent's signal: leaving at
        once, exit 0, an agent that has not yet seen the host waiting would take the run for finished."""
        c = self.cfg.cluster
        if self.job.placement is None or len(c.host_counts) == 1 \
                or not (self.core.stop_reason or "").startswith("signal"):
            return False
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            signalled = self.stop.requested   # read before the marker, which is written before the signal
            if restart_marked(self.run_dir, c.node_rank) > self.job.generation:
                return True
            if signalled or time.monotonic() > deadline:   # a shutdown (Ctrl-C, a kill) or a peer's
                return False
            time.sleep(0.05)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Every rank: the strategy's evaluation (engine/strategies/base.py), a rank's training share at a time."""
        chunk = max(1, self.cfg.data.batch_size // self.topo.world_size)
        return self.strategy.evaluate(self.data, self.cfg.precision, self.cfg.data.eval_samples, chunk)

    def _finish(self, step: int, loss: float | None) -> dict | None:
        self.memory.close()
        if self.trace:
            self.trace.close()
        stopped_early = step < self.cfg.run.steps
        drained = self.checkpoints.drain()   # a stop, a restart, a resize and the end wait for the write in flight
        self.checkpoint_s = self.checkpoints.write_s() or self.checkpoint_s
        wanted = stopped_early or (step > self.first_step and self.cfg.checkpoint.at_end)
        if wanted and drained != step and self._final_checkpoint_fits(step):
            self.checkpoints.take(step, background=False)
        figures = self.evaluate()
        if stopped_early and self.restarting():
            if self.topo.is_first:
                self.tel.event("stop", step, reason="restart: a host joins")
                self.tel.close("the worker group restarts to take in a host that joins; it resumes from step "
                               f"{step}")
            return None
        if not self.topo.is_first:
            return None
        summary = self.core.end(step, stopped_early, loss, figures, {
            **self.report.throughput.summary(),
            "capacity_bytes": self.device.ledger.capacity_bytes,
            "simulated": self.device.simulated, "restarts": self.restart})
        return {"type": "summary", **summary}
