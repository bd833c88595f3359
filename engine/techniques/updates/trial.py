"""The trial and the plan of `update.placement = "auto"` (technique 3): the first steps alternate between the
host and the device (a device step holds only what fits beside the host steps' peak), each layer's times and
bytes are recorded, and the planner places each update from them. PlacementTrial owns what it measured, the
plan and its check; LayerUpdates (updater.py) owns the updates and moves them where the trial says.

Plans that never lose (docs/hybrid.md):
- the trial costs at most TRIAL_BUDGET_STEPS steps' time beyond its device steps: a host step that would take it
  past that is not run, and the plan is made from what was measured;
- the cost model is calibrated first: its device-side times are scaled so that the modelled step of the trial's
  device placement is the measured one (the host's times are the host's own clock's);
- a plan that moves updates off the trial's device placement is then timed for CHECK_STEPS steps, and goes back
  to that placement (a `plan_reverted` event) when its steps are slower than the trial's device steps.

Imports engine.techniques.updates.plan, engine.runtime.profiler and engine.training.timing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from engine.config import UpdateConfig
from engine.runtime.devices import LedgerDevice
from engine.runtime.profiler import LayerProfiler
from engine.techniques.updates.plan import UpdateCost, Profile, fixed, plan_global, plan_local, simulate
from engine.training.timing import Clock

TRIAL_BUDGET_STEPS = 2   # what the trial may cost beyond its device steps, in device steps
CHECK_STEPS = 3          # a new plan's steps timed against the steps it replaced (their median)


class PlacementTrial:
    """The trial steps of `update.placement = "auto"`, the plan made from them and its check. `updates` is
    LayerUpdates' own (index -> LayerUpdate), read here, never changed: each placement this decides is
    returned for LayerUpdates to make."""

    def __init__(self, model, device: LedgerDevice, cfg: UpdateConfig, updates: dict):
        self.model, self.device, self.cfg, self.updates = model, device, cfg, updates
        self.left = cfg.profile_steps if cfg.placement == "auto" else 0   # trial steps still to run
        self.steps: list[dict] = []   # each trial step's times, bytes and peaks
        self._grads_at_start = 0
        self._profiler: LayerProfiler | None = None   # made for the first trial step (none where auto settled first)
        self.now = time.perf_counter   # the step's wall clock: the trial's budget, a plan's check
        self._began: float | None = None   # this step's start, where it is timed
        self._timed: str | None = None     # what this step's time is for: "trial", "plan" (checked) or None
        self._steps_begun = 0
        self._plan_due = False        # the trial has ended: the plan is made once its last step is timed
        self.replaced: dict | None = None   # a new plan's check: the placement it replaced and its measured step
        self._checked: list[float] = []     # the new plan's timed steps
        self.reverted: dict | None = None   # a plan that went back (plan_reverted), until reported
        self.figures: dict = {}       # the last trial's cost and the model's calibration, for the plan event
        self.plan = None              # the planner's Timeline once made
        self.new_plan = False         # set when a plan was just made; the step loop reports it (report.py)
        self.profile: Profile | None = None

    # --- a step --------------------------------------------------------------------------------
    def begin_step(self, host_threads: int) -> dict[str, str] | None:
        """Before a step's placement: the last step's time counted (the trial's budget, a new plan's check)
        and the plan made once the trial is over. The placement this step runs, where it moves: a trial
        step's side, a plan just made, or the one a plan goes back to (at most one of them a step)."""
        moved = self._step_ended()
        if self._plan_due or (self.left and self._trial_over_budget()):
            moved = self._make_plan(host_threads)
        if self.left:
            if self._profiler is None:
                self._profiler = LayerProfiler(self.model, self.device.ledger, Clock(self.device.torch_device))
            side = self._trial_side()
            moved = ({u.name: "host" for u in self.updates.values()} if side == "host"
                     else self._fitting_device_placement())
        return moved

    def measure(self) -> None:
        """A trial step, once placed: each layer's times profiled, the ledger's peak counted from here."""
        if not self.left:
            return
        self._profiler.arm()
        self.device.ledger.refresh()
        self.device.ledger.reset_peak()
        self._grads_at_start = self.device.ledger.bytes["gradients"]

    def start_clock(self) -> None:
        """The step's wall time starts, where it is timed (after any move: a move is not the step's)."""
        self._steps_begun += 1
        self._timed = "trial" if self.left else "plan" if self.replaced is not None else None
        self._began = self.now() if self._timed else None

    def layer_rows(self) -> list[dict] | None:
        """After a trial step's backward: each layer's profiled times (None on other steps)."""
        return self._profiler.finish() if self.left else None

    def stop(self) -> None:
        """An operator's placement: the trial ends unplanned, and no plan made or checked goes over it."""
        if self.left:
            self.left = 0
            if self._profiler is not None:
                self._profiler.disarm()
        self._plan_due, self.replaced = False, None

    def _trial_side(self) -> str:
        """The trial starts on the host (no optimizer state on the device), then alternates."""
        return "host" if (self.cfg.profile_steps - self.left) % 2 == 0 else "device"

    def _fitting_device_placement(self) -> dict[str, str]:
        """A device trial step holds on the device only the updates whose state fits beside the peak the
        host steps measured (backward order, first come first placed); the rest stay on the host and their
        device times are modelled (`_make_plan`). So a trial never takes a real GPU out of memory."""
        room = self.device.ledger.capacity_bytes - max(t["steady_peak"] for t in self.steps if t["side"] == "host")
        placement = {}
        for index in sorted(self.updates, reverse=True):
            u = self.updates[index]
            need = u.device_bytes()   # measured by the host step (fp32 state and masters; the device keeps the same)
            fits = need <= room
            placement[u.name] = "device" if fits else "host"
            room -= need if fits else 0
        return placement

    def record(self, rows: list[dict]) -> None:
        """A trial step's end, every host update of it landed: its times, bytes and peaks."""
        layers = {row["name"]: row for row in rows}
        ledger = self.device.ledger
        ledger.refresh()
        # a step that made its gradients during backward (the first, or any whose updates free them) peaked
        # without them until then: its steady peak has the gradients it keeps (a host update's) from the start
        before = ledger.peak_before_grads if ledger.peak_before_grads is not None else ledger.peak_bytes
        steady = max(ledger.peak_bytes, before + max(0, ledger.bytes["gradients"] - self._grads_at_start))
        self.steps.append({"side": self._trial_side(), "layers": layers, "peak": ledger.peak_bytes,
                            "steady_peak": steady,
                            "updates": {u.name: (u.device_ms, u.host_ms, u.copy_ms, u.device_bytes(), u.side)
                                        for u in self.updates.values()}})
        self.steps[-1]["first"] = self._steps_begun == 1   # the run's first step: warm-up, whatever the side
        self.left -= 1
        if self.left == 0:
            self._plan_due = True   # made when this step's time is known (begin_step)

    # --- the step's time: the trial's budget, a new plan's check ------------------------------------
    def _step_ended(self) -> dict[str, str] | None:
        """At the next begin_step: the wall time of the step that ended, from after its placement moved; the
        placement a checked plan goes back to, if it does."""
        if self._began is None:
            return None
        ms, self._began = (self.now() - self._began) * 1000, None
        if self._timed == "trial" and self.steps:
            self.steps[-1]["step_ms"] = ms
        elif self._timed == "plan" and self.replaced is not None:
            self._checked.append(ms)
            if len(self._checked) >= CHECK_STEPS:
                return self._check_plan()
        return None

    def _device_step_ms(self) -> float | None:
        """The trial's device steps, timed (the run's first step left out where another was timed): their median."""
        timed = [t for t in self.steps if t["side"] == "device" and "step_ms" in t]
        later = [t["step_ms"] for t in timed if not t["first"]] or [t["step_ms"] for t in timed]
        return statistics.median(later) if later else None

    def _trial_cost(self) -> tuple[float, float | None]:
        """(ms the trial's timed steps took beyond as many device steps, the run's first step left out; the
        device step's ms)."""
        device_ms = self._device_step_ms()
        if device_ms is None:
            return 0.0, None
        return sum(max(0.0, t["step_ms"] - device_ms) for t in self.steps
                   if "step_ms" in t and not t["first"]), device_ms

    def _trial_over_budget(self) -> bool:
        """Before a host trial step: would it take the trial past TRIAL_BUDGET_STEPS device steps? (Its cost is
        the last host step's: the first, warm-up included, where no other was timed.)"""
        if self._trial_side() != "host":
            return False
        spent, device_ms = self._trial_cost()
        hosts = [t["step_ms"] for t in self.steps if t["side"] == "host" and "step_ms" in t]
        if device_ms is None or not hosts:
            return False
        return spent + max(0.0, hosts[-1] - device_ms) > TRIAL_BUDGET_STEPS * device_ms

    def _check_plan(self) -> dict[str, str] | None:
        """CHECK_STEPS steps of a new plan are timed: slower than the steps it replaced, it goes back to them
        (the placement returned)."""
        replaced, self.replaced = self.replaced, None
        plan_ms, self._checked = statistics.median(self._checked), []
        if plan_ms <= replaced["step_ms"]:
            return None
        self.plan = simulate(self.profile, [replaced["placement"][c.name] for c in self.profile.layers])
        self.reverted = {"reason": "measured slower than the placement it replaced",
                         "plan_ms": round(plan_ms, 3), "replaced_ms": round(replaced["step_ms"], 3),
                         "placement": dict(replaced["placement"])}
        return replaced["placement"]

    def _make_plan(self, host_threads: int) -> dict[str, str]:
        """The trial is over: the plan from what it measured (the placement returned)."""
        self._plan_due = False
        self.left = 0
        if self._profiler is not None:
            self._profiler.disarm()

        def median(values: list[float]) -> float:
            return statistics.median(values) if values else 0.0
        dev = [t for t in self.steps if t["side"] == "device"][1:] or [t for t in self.steps if t["side"] == "device"]
        host = [t for t in self.steps if t["side"] == "host"][1:] or [t for t in self.steps if t["side"] == "host"]
        device_ms = self._device_times(dev)
        # one cost per layer with an update, in backward order; the times of layers without parameters
        # go to the next layer with one in backward order (they delay its backward and precede it)
        costs, carry_fwd, carry_bwd = [], 0.0, 0.0
        updated = {u.name for u in self.updates.values()}
        for index in reversed(range(len(self.model.names))):
            name = self.model.names[index]
            # backward times from the host steps: no device update inside them, the host busy beside them
            rows = [t["layers"][name] for t in host if name in t["layers"]]
            fwd, bwd = median([r["fwd_ms"] for r in rows]), median([r["bwd_ms"] for r in rows])
            if name not in updated:
                carry_fwd, carry_bwd = carry_fwd + fwd, carry_bwd + bwd
                continue
            costs.append(UpdateCost(
                name=name, fwd_ms=fwd + carry_fwd, bwd_ms=bwd + carry_bwd,
                device_ms=device_ms[name],
                host_ms=median([t["updates"][name][1] for t in host]),
                copy_ms=median([t["updates"][name][2] for t in host]),
                state_bytes=max(t["updates"][name][3] for t in self.steps)))
            carry_fwd = carry_bwd = 0.0
        if costs and carry_bwd:   # layers before the first one with parameters: the end of backward
            last = costs[-1]
            costs[-1] = dataclasses.replace(last, fwd_ms=last.fwd_ms + carry_fwd, bwd_ms=last.bwd_ms + carry_bwd)
        # the host steps' peak with their gradients held: a trial cut short by its budget after its first host
        # step has only that one, whose measured peak came before its gradients existed (the plan then modelled
        # 36,176 bytes where the steps held 47,188: tests/test_hybrid.py, the tight trial)
        peak = min(t["steady_peak"] for t in host) if host else self.device.ledger.peak_bytes
        profile = Profile(tuple(costs), peak_bytes=peak, capacity_bytes=self.device.ledger.capacity_bytes,
                          host_threads=host_threads)
        # the placement the trial's device steps ran (every update that fitted), and their measured step
        tried = {name: dev[-1]["updates"][name][4] for name in profile.names} if dev else {}
        spent, measured = self._trial_cost()
        self.profile, scale = calibrated(profile, tried, measured)
        planner = plan_global if self.cfg.planner == "global" else plan_local
        self.plan = planner(self.profile)
        chosen = {name: side for name, side in zip(profile.names, self.plan.placement)}
        self.new_plan = True
        self.figures = {
            "trial_steps": len(self.steps), "trial_ms": round(sum(t.get("step_ms", 0.0) for t in self.steps), 3),
            "trial_extra_ms": round(spent, 3), "budget_ms": round(TRIAL_BUDGET_STEPS * (measured or 0.0), 3),
            "measured_device_ms": round(measured, 3) if measured is not None else None,
            "calibration": round(scale, 4)}
        if tried and measured is not None and chosen != tried:   # timed against the steps it replaces
            self.replaced, self._checked = {"placement": tried, "step_ms": measured}, []
        return chosen

    @staticmethod
    def _device_times(dev: list[dict]) -> dict[str, float]:
        """Each layer's device update time: measured where the trial held it on the device, else modelled
        from the measured ones at their time per byte of state (the update's work scales with it)."""
        names = list(dev[0]["updates"]) if dev else []
        measured = {n: statistics.median(t["updates"][n][0] for t in dev if t["updates"][n][4] == "device")
                    for n in names if any(t["updates"][n][4] == "device" for t in dev)}
        state = {n: max(t["updates"][n][3] for t in dev) for n in names}
        rates = [measured[n] / state[n] for n in measured if state[n]]
        rate = statistics.median(rates) if rates else 0.0
        return {n: measured[n] if n in measured else rate * state[n] for n in names}

    def predicted(self, placement: str | dict) -> object:
        """The cost model's timeline of another placement, from this run's profile (for reports)."""
        return fixed(self.profile, placement)


def calibrated(profile: Profile, placement: dict[str, str], measured_ms: float | None) -> tuple[Profile, float]:
    """`profile` with its device-side times (forward, backward, device updates) scaled so that the modelled step
    of `placement` (the forward, then the model's makespan) is `measured_ms`, and the scale; the host's times
    are left as its own clock measured them. Unchanged (scale 1) where nothing was measured."""
    if not placement or not measured_ms:
        return profile, 1.0
    timeline = simulate(profile, [placement[c.name] for c in profile.layers])
    # the device's side: the forward, then backward and device updates; host updates may outlast it (a tail)
    device_side = sum(c.fwd_ms for c in profile.layers) + timeline.device_end_ms
    host_tail = timeline.makespan_ms - timeline.device_end_ms
    if device_side <= 0:
        return profile, 1.0
    scale = max(1e-3, (measured_ms - host_tail) / device_side)
    layers = tuple(dataclasses.replace(c, fwd_ms=c.fwd_ms * scale, bwd_ms=c.bwd_ms * scale,
                                       device_ms=c.device_ms * scale) for c in profile.layers)
    return dataclasses.replace(profile, layers=layers), scale
