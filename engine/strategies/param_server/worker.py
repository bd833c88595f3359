"""A worker rank: trains on its shard of every global batch, pulling each layer's weights from its
server just before that layer's forward and pushing the layer's gradient the moment its backward
completes; and `supervise`, the process the elastic agent sees as the rank.

    supervise(job, build_rank)     # engine/run/worker.py, on ranks from parallel.param_server.servers up

`supervise` forks the worker: a worker that dies is reported and absorbed there, so the servers go on
with the others, where the agent would otherwise restart everything. Its first sync_profile_steps
iterations measure, per layer, the time it had between pushing a gradient and needing the layer again
(its slack); the servers set each layer's window from it. SlowMachine stretches the worker's own work
to emulate a slower machine (parallel.param_server.slow_workers).

Times: an iteration's `fwd_ms` and `bwd_ms` (the coordinator's `compute_ms`) are the worker's own work
on the device's clock (engine/training/timing.py: CUDA events on a GPU, perf_counter on the CPU), read after the
iteration's loss, which waits for that work: the iteration's own on a GPU as on the CPU. Waiting for
weights is left out of `fwd_ms`; it is `wait_ms`, host time (the host blocks on the receive), and
`step_ms` is the iteration's wall time on the host, waits included. SlowMachine stretches by host time
(the CPU's emulation). `PSWorker(setup, device_clock=...)`: the clock to read (tests: a scripted GPU's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback

import torch

from engine.models.compile import FIGURES, compile_figures
from engine.runtime.control import row_values
from engine.runtime.lifecycle import StopRequest
from engine.runtime.topology import Topology
from engine.training.data import micro_steps
from engine.training.loss import share_loss, step_value
from engine.strategies.param_server.links import (
    ALL_LAYERS, BYE, GRAD, PAUSED, PING, PROFILE, PULL, STOP, TAG_PING, TAG_WEIGHTS, flatten, reply_bytes,
    unpack_weights)
from engine.runtime.refusal import transport_failure
from engine.strategies.param_server.setup import Setup
from engine.training.precision import compute_in
from engine.training.timing import Clock, StepTimes

PAUSED_POLL_S = 0.25       # a paused worker asks the servers this often whether to go on


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


class PSWorker:
    """Trains on its shard of each global batch, pulling each layer just before its forward and
    pushing each layer's gradient the moment its backward completes."""

    def __init__(self, setup: "Setup", device_clock: Clock | None = None):
        self.setup = setup
        self.times = StepTimes(device_clock or Clock(setup.device.torch_device), ("fwd_ms", "bwd_ms"))
        cfg, topo = setup.cfg, setup.topo
        self.index = topo.rank - setup.servers
        self.factor = float(cfg.parallel.param_server.slow_workers.get(str(topo.rank), 1.0))
        self.params = setup.params
        self.layers = sorted(self.params)
        self.sizes = {j: sum(p.numel() for p in ps) for j, ps in self.params.items()}
        self.version = {j: 0 for j in self.layers}
        self._accumulating = False
        self.slow_machine = SlowMachine(setup.model, self.factor)
        self._left = {}
        for j, ps in self.params.items():
            for p in ps:
                p.register_post_accumulate_grad_hook(self._grad_hook(j))
        self.iteration = setup.first_step
        self.profile: list[list[float]] = []
        self._compiles = (0.0, 0.0)   # compile seconds at the ends of the last two iterations (_profile)
        self.pushed_at: dict[int, float] = {}   # layer -> when its last gradient left
        self.slack: dict[int, float] = {}       # layer -> ms from that push to needing the layer again
        self.stats: torch.Tensor | None = None  # the last iteration's figures, sent with the next pull

    def _grad_hook(self, j: int):
        def hook(p):
            if self._accumulating:   # a micro-step before the last (data.accumulate): the gradient stays
                return
            self._left[j] -= 1
            if self._left[j] == 0:
                self.slow_machine.segment_done()
                grad = flatten([q.grad for q in self.params[j]], dtype=self.params[j][0].dtype)   # bf16: half
                self.setup.links[self.setup.owner[j]].send(GRAD, j, self.version[j], self.iteration, payload=grad)
                for q in self.params[j]:
                    q.grad = None
                self.pushed_at[j] = time.perf_counter()
        return hook

    def run(self) -> None:
        s, cfg = self.setup, self.setup.cfg
        model, device = s.model, s.device
        flags, t_idle, times = 0, 0.0, self.times
        try:
            while not s.stop.requested:
                t_start = time.perf_counter()   # host: the iteration's wall time, idle and slack
                fwd_from = times.mark()         # the device: forward runs from here to each wait for weights
                idle_s = t_start - t_idle if flags & PAUSED or cfg.run.step_pause_ms else 0.0
                buffers = {j: torch.empty(reply_bytes(self.sizes[j], self.params[j][0].dtype), dtype=torch.uint8)
                           for j in self.layers}
                works = {j: s.links[s.owner[j]].expect(buffers[j], TAG_WEIGHTS + j) for j in self.layers}
                for server in range(s.servers):   # every server owns a layer; server 0 gets the figures
                    s.links[server].send(PULL, ALL_LAYERS, iteration=self.iteration, a=self.factor,
                                         payload=self.stats if server == 0 else None)
                x, y = s.batch(self.iteration, self.index)
                x, y = x.to(device.torch_device), y.to(device.torch_device)
                micro = micro_steps(x, y, cfg.data.accumulate)
                (x, y), losses = micro[0], []
                wait_ms, flags = 0.0, 0
                out = x
                with compute_in(cfg.precision, device.torch_device), device.ledger.saved_activations():
                    for j, layer in enumerate(model.layers):
                        if j in works:
                            times.add("fwd_ms", fwd_from, times.mark())   # waiting for weights is not forward
                            t0 = time.perf_counter()
                            if j in self.pushed_at:   # the time this worker had for layer j: no waiting
                                self.slack[j] = (t0 - self.pushed_at[j] - idle_s) * 1000 - wait_ms
                            works[j].wait()
                            wait_ms += (time.perf_counter() - t0) * 1000   # host time: the host blocks here
                            fwd_from = times.mark()
                            version, reply_flags = unpack_weights(buffers[j], self.params[j])
                            flags |= reply_flags
                            if flags & STOP:
                                break
                            self.version[j] = version
                        out = layer(out)
                    if flags & STOP:
                        break
                    # this worker's part of the global batch's mean, as bsp averages over the workers; each
                    # micro-step's gradients add up, and go to the servers in the last one's backward
                    total = s.global_counted(self.iteration)
                    for k, (xk, yk) in enumerate(micro):
                        if k:
                            fwd_from = times.mark()
                            out = model(xk)
                        loss = share_loss(s.loss_fn, out, yk, total, s.workers, len(micro))
                        self._accumulating = k < len(micro) - 1
                        self._left = {j: len(ps) for j, ps in self.params.items()}
                        bwd_from = times.mark()
                        times.add("fwd_ms", fwd_from, bwd_from)
                        self.slow_machine.backward_started()
                        loss.backward()
                        times.add("bwd_ms", bwd_from, times.mark())
                        losses.append(loss.detach())
                    self._accumulating = False
                t_end = time.perf_counter()
                device.ledger.refresh()
                step_ms = (t_end - t_start) * 1000
                self.iteration += 1
                value = step_value(losses)   # waits for the iteration's work: its marks are read without a synchronize
                row = {"loss": value, "step_ms": step_ms, **times.end_step(), "wait_ms": wait_ms, **device.stats(),
                       **compile_figures()}
                self.stats = torch.tensor(row_values(row), dtype=torch.float64)
                self._profile()
                self.slow_machine.stretch_rest((time.perf_counter() - t_start) * 1000 - wait_ms)
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
        steps = self.setup.cfg.parallel.param_server.sync_profile_steps
        done = self.iteration - self.setup.first_step
        if done > steps:
            return
        # `[model] compile`: a slack that holds a compile (in this iteration, or the last one's backward) is no
        # sample, unless every one did
        clean = FIGURES.seconds == self._compiles[0]
        self._compiles = (self._compiles[1], FIGURES.seconds)
        if done > 1 and (clean or (done == steps and not self.profile)):
            self.profile.append([self.slack.get(j, 0.0) for j in self.layers])
        if done == steps:
            mean = torch.tensor(self.profile, dtype=torch.float64).mean(dim=0)
            for server in range(self.setup.servers):
                self.setup.links[server].send(PROFILE, iteration=self.iteration, payload=mean)

    def _paused(self) -> int:
        """Ask the servers every PAUSED_POLL_S whether to go on (this also keeps the links alive)."""
        while True:
            time.sleep(PAUSED_POLL_S)
            flags = 0
            for server in range(self.setup.servers):
                answer = torch.zeros(1)
                work = self.setup.links[server].expect(answer, TAG_PING)
                self.setup.links[server].send(PING, iteration=self.iteration)
                work.wait()
                flags |= int(answer[0])
            if not flags & PAUSED or flags & STOP or self.setup.stop.requested:
                return flags



def run_worker(job, topo, stop, build) -> None:
    PSWorker(Setup(job, topo, stop, build)).run()


def supervise(job, build) -> None:
    """A worker rank as the elastic agent sees it: the worker trains in a child process, and its
    death is reported and absorbed here, so the servers go on with the others."""
    rank = int(os.environ["RANK"])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: never outlive the supervisor
            cfg = job.config
            stop = StopRequest()
            topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
            try:
                run_worker(job, topo, stop, build)
                code = 0
            finally:
                topo.shutdown()
        except BaseException as e:
            if isinstance(e, RuntimeError) and transport_failure(e):
                print(f"trainyard: worker rank {rank} lost a server ({transport_failure(e)})", file=sys.stderr,
                      flush=True)
            else:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pid_dir = job.config.run_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{rank}.supervisor.pid").write_text(str(os.getpid()))
    forwarded = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:   # it ended just now
            pass
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    # the child is gone: the agent's next signal ends this process (a handler left here would swallow it, and
    # the agent waited 30 s before its SIGKILL; one that met the child gone raised, and torch pickled that
    # error into the temp dir)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    if forwarded:   # the agent is stopping the group and reads no return value (it would wait for one)
        os._exit(0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        print(f"trainyard: parameter-server worker rank {rank} {how}; the servers go on without it",
              file=sys.stderr, flush=True)
    return None
