"""`bench broadcast`'s figures (engine/bench/broadcast.py) from its rounds' results, one precision at a time:
the medians over the rounds, each variant's row (its ratio to DDP, optimizer state per rank, phases, overlap
efficiency and, over a cluster, its line-rate ideal) and the goals judged round by round.

Imports engine.bench.verdict and engine.bench.linerate (late: the ideal's bytes).
"""

from __future__ import annotations

import statistics

from engine.bench.verdict import judge_ratio


def figures(runs: dict[str, list[dict]], variants: list[str], world: int, goal: dict, with_bytes: bool,
            hosts: int = 0, link: dict | None = None) -> dict:
    """One precision's figures: the medians over the rounds, each variant's row (with its overlap efficiency and,
    over a cluster, its line-rate ideal), and the goals (`with_bytes`: each row with its bytes per step, parameter
    and master bytes per rank too)."""
    from engine.bench.linerate import ideal_bytes
    per_rank = ("state_per_rank", "master_per_rank", "owned_per_rank")
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0] if k not in per_rank}
           for v in variants}
    ddp_ms = med["ddp"]["step_ms"]
    ddp_state = max(runs["ddp"][0]["state_per_rank"])
    rate = (link or {}).get("bytes_per_s")
    rows = []
    for v in variants:
        state = max(runs[v][0]["state_per_rank"])
        m = med[v]
        row = {"variant": v, "step_ms": round(m["step_ms"], 2), "ratio_to_ddp": round(m["step_ms"] / ddp_ms, 3),
               "optimizer_state_bytes_per_rank": state, "state_fraction_of_ddp": round(state / ddp_state, 4),
               **{k: round(m[k], 2) for k in ("fwd_ms", "bwd_ms", "reduce_ms", "optim_ms", "broadcast_wait_ms",
                                              "gate_ms", "reduce_span_ms", "broadcast_span_ms")},
               "overlap_efficiency": efficiency(m)}
        if v.startswith("sharded"):   # torch's variants do not time their collectives apart from compute
            row["communication_ms"] = round(m["reduce_span_ms"] + m["broadcast_span_ms"], 2)
        if rate and hosts:
            ideal = ideal_bytes(v, runs[v][0]["owned_per_rank"], int(med["ddp"]["model_bytes"]), hosts,
                                working_bytes=int(m["parameter_bytes"]))
            ideal_ms = ideal["total"] / rate * 1000
            row.update({"ideal_bytes": ideal, "ideal_ms": round(ideal_ms, 2),
                        "step_over_ideal": round(m["step_ms"] / ideal_ms, 3)})
            if m["step_ms"] < ideal_ms:   # impossible: the probe under-measured the link
                row["under_ideal"] = True
            if "communication_ms" in row:
                row["communication_over_ideal"] = round(row["communication_ms"] / ideal_ms, 3)
        if with_bytes:   # rank 0's: every rank carries the same broadcast and holds the same working weights
            row.update({"bytes_per_step": int(m["bytes_per_step"]),
                        "parameter_bytes_per_rank": int(m["parameter_bytes"]),
                        "master_bytes_per_rank": max(runs[v][0]["master_per_rank"])})
        rows.append(row)
    best = min((r for r in rows if r["variant"].endswith("gated")), key=lambda r: r["step_ms"])
    fsdp = min((r for r in rows if r["variant"].startswith("fsdp2")), key=lambda r: r["step_ms"])

    def step_ms(v: str) -> list[float]:   # round by round
        return [r["step_ms"] for r in runs[v]]
    judged = {"step_ratio": judge_ratio(step_ms(best["variant"]), step_ms("ddp"),
                                        at_most=goal["ratio_to_ddp_at_most"]),
              "below_fsdp2": judge_ratio(step_ms(best["variant"]), step_ms(fsdp["variant"]), at_most=1.0)}
    met = {name: j["verdict"] == "met" for name, j in judged.items()}
    met["optimizer_state"] = best["state_fraction_of_ddp"] <= 1 / world + 0.02
    if "communication_over_ideal_at_most" in goal and "communication_over_ideal" in best:
        met["communication"] = best["communication_over_ideal"] <= goal["communication_over_ideal_at_most"]
    under = [r["variant"] for r in rows if r.get("under_ideal")]
    return {"parameters": int(med["ddp"]["parameters"]), "variants": rows, "best_gated": best["variant"],
            "best_fsdp2": fsdp["variant"], "link_probe": link or None, "judged": judged,
            **({"probe_failed": f"{', '.join(under)} stepped under the line-rate ideal: the probe under-measured "
                                f"the link, so every ideal here is too high"} if under else {}),
            "goals": {**goal, "state_fraction_at_most": round(1 / world, 4)}, "meets_goals": met}


def efficiency(row: dict) -> float | None:
    """The fraction of a sharded variant's broadcast span hidden behind compute: 1 - the step's time spent on it
    (launching its slices, then waiting for them at the gates or all at once) over its span; in [0, 1]. None:
    no broadcast (ddp)."""
    span = row.get("broadcast_span_ms", 0.0)
    if not span:
        return None
    exposed = row["broadcast_issue_ms"] + row["gate_ms"] + row["broadcast_wait_ms"]
    return round(min(1.0, max(0.0, 1.0 - exposed / span)), 3)
