"""Emulated trouble for demos and tests (`[emulate]`): a layer that turns slow mid-run, a slow rank, a rank
that dies in the middle of a technique.

    slow = SlowLayer.install(model, cfg.emulate)   # None when no layer is named
    slow.step = step                                # the worker's step loop, before each step
    straggler = SlowRank.install(model, cfg.emulate, rank)   # None unless this rank is `slow_rank`
    straggler.step = step
    fault = Fault.install(cfg.emulate, rank, restart)         # None unless this rank is `kill_rank`, first attempt
    fault.step = step
    emulated = Emulated.install(model, cfg.emulate, rank, restart)   # all of them: the step loop's
    emulated.at(step)
    reached("migration")                                       # in the technique, at its moment: maybe SIGKILL

The layer's forward sleeps `slow_layer_ms` from step `slow_from_step` on. Every rank builds the
whole model and the hook sits on the layer's module, so it stays slow wherever the layer runs,
after a pipeline migration too; the pipeline's layer clock counts the sleep as the layer's time.

A fault (`kill_rank`, `kill_at`, `kill_step`) kills a rank in the middle of a technique's own moment, where
a kill from outside cannot aim: each technique calls `reached(MOMENT)` there, which costs a healthy run
one global read and a comparison.
"""

from __future__ import annotations

import os
import signal
import sys
import time


class SlowLayer:
    def __init__(self, module, sleep_ms: float, from_step: int):
        self.sleep_s, self.from_step = sleep_ms / 1000, from_step
        self.step = 0
        module.register_forward_hook(self._after_forward)

    @classmethod
    def install(cls, model, emulate) -> "SlowLayer | None":
        if not emulate.slow_layer:
            return None
        if emulate.slow_layer not in model.names:
            raise ValueError(f"emulate.slow_layer = {emulate.slow_layer!r} is not a layer of this model; its layers "
                             f"are: {', '.join(model.names)}")
        module = model.layers[model.names.index(emulate.slow_layer)]
        return cls(module, emulate.slow_layer_ms, emulate.slow_from_step)

    def _after_forward(self, module, args, output):
        if self.step >= self.from_step:
            time.sleep(self.sleep_s)


class SlowRank:
    """`emulate.slow_rank`: that rank's first layer sleeps `slow_rank_ms` in its forward once a step, so its
    compute takes longer than its peers' and they wait for it at the boundary: a straggler. The sleep is on
    the host; on a GPU the device's clock sees it as idle time before the first layer's kernels."""

    def __init__(self, module, sleep_ms: float, from_step: int):
        self.sleep_s, self.from_step = sleep_ms / 1000, from_step
        self.step = 0
        self.slept_step = -1
        module.register_forward_pre_hook(self._before_forward)

    @classmethod
    def install(cls, model, emulate, rank: int) -> "SlowRank | None":
        if emulate.slow_rank != rank or emulate.slow_rank_ms <= 0:
            return None
        return cls(model.layers[0], emulate.slow_rank_ms, emulate.slow_from_step)

    def _before_forward(self, module, args):
        if self.step >= self.from_step and self.slept_step != self.step:   # once a step, not per micro-batch
            self.slept_step = self.step
            time.sleep(self.sleep_s)


class NonFinite:
    """`emulate.nonfinite_layer`: at step `nonfinite_step` (every micro-step of it) the first element of each of
    that layer's gradients, as this rank computes it, is inf: what an overflow looks like to the step guard."""

    def __init__(self, module, at_step: int):
        self.at_step, self.step = at_step, 0
        for p in module.parameters():
            p.register_hook(self._poison)

    @classmethod
    def install(cls, model, emulate, rank: int) -> "NonFinite | None":
        if not emulate.nonfinite_layer or emulate.nonfinite_rank not in (-1, rank):
            return None
        if emulate.nonfinite_layer not in model.names:
            raise ValueError(f"emulate.nonfinite_layer = {emulate.nonfinite_layer!r} is not a layer of this model; "
                             f"its layers are: {', '.join(model.names)}")
        return cls(model.layers[model.names.index(emulate.nonfinite_layer)], emulate.nonfinite_step)

    def _poison(self, grad):
        if self.step != self.at_step:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


class Fault:
    """`emulate.kill_rank` SIGKILLs itself the first time its technique reaches `kill_at` at or after step
    `kill_step`, in the first attempt of the run only (`restart` 0), so the restarted run goes on:

    - `migration` (pipeline): a source once it has sent the leaving layers' weights and optimizer state,
      a target once it has received them, before it takes them over;
    - `broadcast` (sharded): an owner once it has issued one of its slices, the others still to come;
    - `host_update` (hybrid update): once a layer's host update is handed to the executor, before it lands;
    - `window` (param_server, soft or bsp): a server once a layer's window holds a gradient, before it closes;
    - `step` (the step loop: ddp, sharded, pipeline): at the start of a step;
    - `checkpoint` (the step loop): once this rank's file of a checkpoint is written, before it is published.

    `kill_how = "error"` raises an IndexError there instead, in every attempt: an error that would recur;
    `kill_how = "launcher"` SIGKILLs the rank's launcher there (the lifeline's case: engine/processes/lifeline.py).

    The worker's step loop sets `step` (0-based, the step being trained); a parameter server passes its
    global step to `reached`."""

    def __init__(self, moment: str, from_step: int, how: str = "sigkill"):
        self.moment, self.from_step, self.how = moment, from_step, how
        self.step = 0

    @classmethod
    def install(cls, emulate, rank: int, restart: int) -> "Fault | None":
        """Arm this process's fault (or disarm it: None unless `rank` is `kill_rank` and, for a SIGKILL,
        `restart` is 0: an error recurs in every attempt, as a bug does)."""
        global FAULT
        armed = emulate.kill_rank == rank and (not restart or emulate.kill_how == "error")
        FAULT = cls(emulate.kill_at, emulate.kill_step, emulate.kill_how) if armed else None
        return FAULT


FAULT: Fault | None = None   # this process's, once installed
LAUNCHER_PID = "TRAINYARD_LAUNCHER_PID"   # set by the launcher's worker entry (engine/run/worker_entry.py run_worker)


def reached(moment: str, step: int | None = None) -> None:
    """A technique is at `moment`: the armed rank dies here, now (no cleanup, as a machine that fails)."""
    fault = FAULT
    if fault is None or fault.moment != moment:
        return
    step = fault.step if step is None else step
    if step < fault.from_step:
        return
    rank = os.environ.get("RANK", "?")
    if fault.how == "launcher":   # once: the rank itself goes on, until its lifeline stops it
        fault.from_step = float("inf")
        launcher = int(os.environ.get(LAUNCHER_PID, "0"))
        print(f"trainyard: emulate.kill_rank: rank {rank} kills its launcher (pid {launcher}) at {moment} "
              f"(step {step})", file=sys.stderr, flush=True)
        if launcher > 0:
            os.kill(launcher, signal.SIGKILL)
        return
    if fault.how == "error":
        raise IndexError(f"emulate.kill_how = \"error\": rank {rank} indexes past its table at {moment} (step {step})")
    print(f"trainyard: emulate.kill_rank: rank {rank} kills itself at {moment} (step {step})", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Emulated:
    """Every kind of emulated trouble configured for this rank, told the step before each one."""

    def __init__(self, parts: list):
        self.parts = parts

    @classmethod
    def install(cls, model, emulate, rank: int, restart: int) -> "Emulated":
        slow = SlowLayer.install(model, emulate)   # before any timing hook, so timed with it
        parts = [slow, SlowRank.install(model, emulate, rank), NonFinite.install(model, emulate, rank),
                 Fault.install(emulate, rank, restart)]   # emulate.kill_rank: first attempt only
        return cls([p for p in parts if p is not None])

    def at(self, step: int) -> None:
        for part in self.parts:
            part.step = step
        reached("step", step)   # emulate.kill_at = "step"
