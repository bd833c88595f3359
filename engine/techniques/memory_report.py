"""What technique 4's activation policy says after each step's exchange, on every rank alike: the refusal of a
run whose plan cannot fit a stage's capacity (every rank sees it in the same step), and the plans made in the
step (the `memory_plan` event, the policies in the hub's state, a note).

    fields = step_fields(memory, plan, swapped_out, link_wait_s)   # this rank's figures for the exchange
    refusal, events = plans_made(memory, table, rank, cfg, step)       # after the exchange

Imports engine.runtime.control (the exchange's columns) and engine.runtime.events; the policy is handed in
(engine/techniques/memory/, which imports nothing of the runtime).
"""

from __future__ import annotations

from engine.runtime.control import COLUMN, Table, column, table_rows
from engine.runtime.events import Event


def step_fields(memory, plan, swapped_out: int, link_wait_s: float) -> dict:
    """This rank's policy figures for the step's exchange."""
    policies = memory.policies()
    error = memory.last_error
    return {"swap_layers": sum(p == "swap" for p in policies.values()),
            "recompute_layers": sum(p == "recompute" for p in policies.values()),
            "plan_made": float(plan is not None), "plan_estimate_bytes": plan.estimate_bytes if plan else 0,
            "min_capacity_bytes": error.min_capacity_bytes if error else 0, "swapped_out_bytes": swapped_out,
            "link_wait_ms": link_wait_s * 1000}


def plans_made(memory, table: Table, rank: int, cfg, step: int) -> tuple[str | None, list[Event]]:
    """(the reason to refuse the run, or None; the events of the plans made in this step)."""
    need = column(table, "min_capacity_bytes")   # every step: read as numbers, not tensor ops
    most = max(need)
    if most > 0:
        worst = need.index(most)
        error = memory.last_error if worst == rank else None
        return (f"memory.policy = \"auto\": rank {worst} cannot fit its device capacity "
                f"(device.memory = \"{cfg.device.memory}\"): "
                + (str(error) if error else f"the smallest capacity that fits is {int(most) // 2**20}MiB "
                   f"(device.memory = \"{int(most) // 2**20}MiB\")")), []
    made = column(table, "plan_made")
    if max(made) == 0:
        return None, []
    ranks = [{"rank": r, "swap_layers": int(row[COLUMN["swap_layers"]]),
              "recompute_layers": int(row[COLUMN["recompute_layers"]]),
              "estimate_bytes": int(row[COLUMN["plan_estimate_bytes"]])}
             for r, row in enumerate(table_rows(table)) if made[r] > 0]
    plan = memory.plan
    summary = ", ".join(f"rank {e['rank']}: {e['swap_layers']} swap, {e['recompute_layers']} recompute"
                        for e in ranks)
    return None, [Event("memory_plan", dict(planner=cfg.memory.planner, ranks=ranks, policies=memory.policies(),
                                            capacity_bytes=memory.ledger.capacity_bytes,
                                            host_link_gbps=round(memory.link_gbps, 3), note=plan.note if plan else ""),
                        state={"policies": memory.policies()},
                        note=f"memory plan ({cfg.memory.planner}) at step {step}: {summary}")]
