"""The trial and the plan of `update.placement = "auto"` (technique 3): the first steps alternate between the
host and the device (a device step holds only what fits beside the host steps' peak), each layer's times and
bytes are recorded, and the planner places each update from them. Part of LayerUpdates (updater.py).

Imports engine.techniques.updates.plan.
"""

from __future__ import annotations

import dataclasses
import statistics

from engine.techniques.updates.plan import UpdateCost, Profile, fixed, plan_global, plan_local


class PlacementTrial:
    """LayerUpdates' trial steps and the plan made from them (a mixin: the updates, the ledger and the
    planner's settings are LayerUpdates')."""

    def _trial_side(self) -> str:
        """The trial starts on the host (no optimizer state on the device), then alternates."""
        return "host" if (self.cfg.profile_steps - self.trial_left) % 2 == 0 else "device"

    def _fitting_device_placement(self) -> dict[str, str]:
        """A device trial step holds on the device only the updates whose state fits beside the peak the
        host steps measured (backward order, first come first placed); the rest stay on the host and their
        device times are modelled (`_make_plan`). So a trial never takes a real GPU out of memory."""
        room = self.device.ledger.capacity_bytes - max(t["steady_peak"] for t in self._trial if t["side"] == "host")
        placement = {}
        for index in sorted(self.updates, reverse=True):
            u = self.updates[index]
            need = u.device_bytes()   # measured by the host step (fp32 state and masters; the device keeps the same)
            fits = need <= room
            placement[u.name] = "device" if fits else "host"
            room -= need if fits else 0
        return placement

    def _record_trial(self, rows: list[dict]) -> None:
        self.wait_host()
        layers = {row["name"]: row for row in rows}
        ledger = self.device.ledger
        ledger.refresh()
        # a step that made its gradients during backward (the first) peaked without them: its steady peak has them
        steady = ledger.peak_bytes + max(0, ledger.bytes["gradients"] - self._grads_at_start)
        self._trial.append({"side": self._trial_side(), "layers": layers, "peak": ledger.peak_bytes,
                            "steady_peak": steady,
                            "updates": {u.name: (u.device_ms, u.host_ms, u.copy_ms, u.device_bytes(), u.side)
                                        for u in self.updates.values()}})
        self.trial_left -= 1
        if self.trial_left == 0:
            self._make_plan()

    def _make_plan(self) -> None:
        def median(values: list[float]) -> float:
            return statistics.median(values) if values else 0.0
        dev = [t for t in self._trial if t["side"] == "device"][1:] or [t for t in self._trial if t["side"] == "device"]
        host = [t for t in self._trial if t["side"] == "host"][1:] or [t for t in self._trial if t["side"] == "host"]
        device_ms = self._device_times(dev)
        # one cost per layer with an update, in backward order; the times of layers without parameters
        # go to the next layer with one in backward order (they delay its backward and precede it)
        costs, carry_fwd, carry_bwd = [], 0.0, 0.0
        for index in reversed(range(len(self.model.names))):
            name = self.model.names[index]
            # backward times from the host steps: no device update inside them, the host busy beside them
            rows = [t["layers"][name] for t in host if name in t["layers"]]
            fwd, bwd = median([r["fwd_ms"] for r in rows]), median([r["bwd_ms"] for r in rows])
            if name not in self.by_name:
                carry_fwd, carry_bwd = carry_fwd + fwd, carry_bwd + bwd
                continue
            costs.append(UpdateCost(
                name=name, fwd_ms=fwd + carry_fwd, bwd_ms=bwd + carry_bwd,
                device_ms=device_ms[name],
                host_ms=median([t["updates"][name][1] for t in host]),
                copy_ms=median([t["updates"][name][2] for t in host]),
                state_bytes=max(t["updates"][name][3] for t in self._trial)))
            carry_fwd = carry_bwd = 0.0
        if costs and carry_bwd:   # layers before the first one with parameters: the end of backward
            last = costs[-1]
            costs[-1] = dataclasses.replace(last, fwd_ms=last.fwd_ms + carry_fwd, bwd_ms=last.bwd_ms + carry_bwd)
        peak = min(t["peak"] for t in host) if host else self.device.ledger.peak_bytes
        threads = self.executor.threads if self.executor is not None else 1   # the host's servers
        self.profile = Profile(tuple(costs), peak_bytes=peak, capacity_bytes=self.device.ledger.capacity_bytes,
                               host_threads=threads)
        planner = plan_global if self.cfg.planner == "global" else plan_local
        self.plan = planner(self.profile)
        self.place({name: side for name, side in zip((c.name for c in costs), self.plan.placement)})
        self.new_plan = True

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
