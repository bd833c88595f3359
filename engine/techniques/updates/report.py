"""What technique 3 says when it has made a placement plan (after the trial of `update.placement = "auto"`):
the `update_plan` event, its note, and the profile it planned from (update_profile.json in the run folder);
and when a plan measured slower than the placement it replaced went back to it (`plan_reverted`).

    events = plan_events(strategy.updater, step, run_dir)   # [] unless a plan was just made or went back

Imports engine.runtime.events.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.runtime.events import Event


def plan_events(updater, step: int, run_dir: Path) -> list[Event]:
    trial = updater.trial
    events = _made(updater, step, run_dir) if trial.new_plan else []
    if trial.reverted is not None:
        back, trial.reverted = trial.reverted, None
        on_host = sum(side == "host" for side in back["placement"].values())
        events.append(Event("plan_reverted", back, note=(
            f"update plan went back: its steps took {back['plan_ms']:.1f} ms, the placement it replaced "
            f"{back['replaced_ms']:.1f} ms ({on_host} of {len(back['placement'])} layers on the host)")))
    return events


def _made(updater, step: int, run_dir: Path) -> list[Event]:
    planner, trial = updater.cfg.planner, updater.trial
    trial.new_plan = False
    plan, profile = trial.plan, trial.profile
    others = {side: round(trial.predicted(side).makespan_ms, 3) for side in ("device", "host")}
    saved = run_dir / "update_profile.json"
    text = json.dumps({
        "step": step, "planner": planner, "capacity_bytes": profile.capacity_bytes,
        "peak_bytes_without_state": profile.peak_bytes, "host_threads": profile.host_threads,
        "plan_optimal": plan.optimal, "layers_backward_order": [dataclasses.asdict(c) for c in profile.layers],
        "placement": updater.placement(), "predicted_makespan_ms": round(plan.makespan_ms, 3),
        "predicted_all_device_ms": others["device"], "predicted_all_host_ms": others["host"],
        **trial.figures}, indent=2)
    on_host = sorted(n for n, side in updater.placement().items() if side == "host")
    return [Event("update_plan", dict(planner=planner, placement=updater.placement(),
                                      predicted_ms=round(plan.makespan_ms, 3), all_device_ms=others["device"],
                                      all_host_ms=others["host"], host_threads=profile.host_threads,
                                      optimal=plan.optimal, profile=str(saved), **trial.figures),
                  note=f"update plan ({planner}): {len(on_host)} of {len(updater.by_name)} layers on the host; "
                       f"modelled step {plan.makespan_ms:.1f} ms (all device {others['device']:.1f}, "
                       f"all host {others['host']:.1f}){_trial_said(trial.figures)}; profile in {saved}",
                  file=(saved, text))]


def _trial_said(figures: dict) -> str:
    """The trial's cost against its budget, and the model's calibration, for the plan's note."""
    if not figures.get("measured_device_ms"):
        return ""
    return (f"; trial {figures['trial_steps']} steps, {figures['trial_extra_ms']:.1f} ms beyond the device step "
            f"(at most {figures['budget_ms']:.1f}: two steps); device times x{figures['calibration']:.2f} to the "
            f"measured {figures['measured_device_ms']:.1f} ms step")
