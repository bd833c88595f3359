"""What technique 3 says when it has made a placement plan (after the trial of `update.placement = "auto"`):
the `update_plan` event, its note, and the profile it planned from (update_profile.json in the run folder).

    events = plan_events(strategy.updater, step, run_dir)   # [] unless a plan was just made

Imports engine.runtime.events.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.runtime.events import Event


def plan_events(updater, step: int, run_dir: Path) -> list[Event]:
    if not updater.new_plan:
        return []
    planner = updater.cfg.planner
    updater.new_plan = False
    plan, profile = updater.plan, updater.profile
    others = {side: round(updater.predicted(side).makespan_ms, 3) for side in ("device", "host")}
    saved = run_dir / "update_profile.json"
    text = json.dumps({
        "step": step, "planner": planner, "capacity_bytes": profile.capacity_bytes,
        "peak_bytes_without_state": profile.peak_bytes, "host_threads": profile.host_threads,
        "plan_optimal": plan.optimal, "layers_backward_order": [dataclasses.asdict(c) for c in profile.layers],
        "placement": updater.placement(), "predicted_makespan_ms": round(plan.makespan_ms, 3),
        "predicted_all_device_ms": others["device"], "predicted_all_host_ms": others["host"]}, indent=2)
    on_host = sorted(n for n, side in updater.placement().items() if side == "host")
    return [Event("update_plan", dict(planner=planner, placement=updater.placement(),
                                      predicted_ms=round(plan.makespan_ms, 3), all_device_ms=others["device"],
                                      all_host_ms=others["host"], host_threads=profile.host_threads,
                                      optimal=plan.optimal, profile=str(saved)),
                  note=f"update plan ({planner}): {len(on_host)} of {len(updater.by_name)} layers on the host; "
                       f"modelled step {plan.makespan_ms:.1f} ms (all device {others['device']:.1f}, "
                       f"all host {others['host']:.1f}); profile in {saved}",
                  file=(saved, text))]
