"""`bench broadcast`'s goal in a setting (goal_of) and its tables: a precision's variants with their times,
bytes and ratios, and fp32 against bf16 side by side.

Imports engine.processes.cluster (late: a link's rate).
"""

from __future__ import annotations


def goal_of(hosts: int, world: int, link: str) -> dict:
    """Issue 33's goal for the best gated variant's step against DDP's in this setting (and where it has one,
    its communication against the line-rate ideal)."""
    if not hosts:   # one machine: no slower than DDP, as before
        return {"ratio_to_ddp_at_most": 1.0}
    from engine.processes.cluster import rate_bits
    if world > hosts:   # several ranks a host: the two-level exchange crosses once where DDP's ring crosses more
        return {"ratio_to_ddp_at_most": 0.75}
    if rate_bits(link) <= 10**9:   # network-bound: at the line rate both ways
        return {"ratio_to_ddp_at_most": 1.0, "communication_over_ideal_at_most": 1.15}
    return {"ratio_to_ddp_at_most": 0.9}   # compute and communication comparable: hidden behind both passes


def print_precision(console, Table, args, parameters: int, where: str, figures: dict, label: str | None) -> None:
    """One precision's table and lines (`label` None: the fp32-only run, printed as it always was)."""
    from engine.config import format_size
    title = (f"broadcast: {parameters / 1e6:.1f}M parameters, world {args.world}{where}, "
             f"{args.streams} streams x {args.slices} slices, median of {args.rounds} rounds (ms per step)")
    table = Table(title=title if label is None else f"{label} {title}")
    over_cluster = any("ideal_ms" in r for r in figures["variants"])
    columns = ["variant", "step", "x DDP", "opt. state/rank", "fwd", "bwd", "reduce", "update", "bcast wait",
               "gate wait", "reduce span", "bcast span", "hidden"]
    if over_cluster:
        columns += ["ideal", "comm/ideal"]
    if label is not None:   # beside the state: the fp32 masters (bf16) and the bytes per step
        columns[4:4] = ["masters/rank", "bytes/step"]
    for col in columns:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in figures["variants"]:
        eff = r["overlap_efficiency"]
        cells = [r["variant"], f"{r['step_ms']:.1f}", f"{r['ratio_to_ddp']:.3f}",
                 f"{r['optimizer_state_bytes_per_rank'] / 2**20:.1f} MiB ({r['state_fraction_of_ddp']:.2f})",
                 *(f"{r[k]:.1f}" for k in ("fwd_ms", "bwd_ms", "reduce_ms", "optim_ms", "broadcast_wait_ms",
                                           "gate_ms", "reduce_span_ms", "broadcast_span_ms")),
                 "—" if eff is None else f"{eff:.2f}"]
        if over_cluster:
            cells += [f"{r['ideal_ms']:.1f}" + (" UNDER" if r.get("under_ideal") else ""),
                      f"{r['communication_over_ideal']:.2f}" if "communication_over_ideal" in r
                      else f"step {r['step_over_ideal']:.2f}"]
        if label is not None:
            cells[4:4] = [format_size(r["master_bytes_per_rank"]), format_size(r["bytes_per_step"])]
        table.add_row(*cells)
    console.print(table)
    prefix = "" if label is None else f"{label}: "
    if figures.get("link_probe"):
        link = figures["link_probe"]
        rounds = ", ".join(f"{r * 8 / 1e9:.3f}" for r in link["rounds_bytes_per_s"])
        print(f"{prefix}link probe: {link['bytes_per_s'] * 8 / 1e9:.3f} Gbit/s each way, both ways at once, the best "
              f"of every round's ({rounds} Gbit/s; {link['probe_bytes'] >> 20} MiB, the fastest of five a round)"
              + (f", capped at the shaped {link['shaped_bytes_per_s'] * 8 / 1e9:.3f}" if link["capped"] else "")
              + "; ideal: each phase's bytes over the busiest link at that rate (engine/bench/linerate.py)")
    if figures.get("probe_failed"):
        print(f"{prefix}PROBE FAILED: {figures['probe_failed']}")
    print(f"{prefix}hidden: the fraction of the broadcast span behind compute (1 - (launch + waits) / span); spans from the "
          f"first gradient sent to the last sum (reduce) and from launch to the last slice landed (broadcast)")
    from engine.bench.verdict import say
    goals, judged = figures["goals"], figures["judged"]
    print(f"{prefix}goals for the best gated variant ({figures['best_gated']}), each ratio the median of the rounds' "
          f"(met: every round; missed: none; undecided: the spread covers the goal):")
    print(f"{prefix}  " + say("step / DDP's", judged["step_ratio"]))
    print(f"{prefix}  " + say(f"step / {figures['best_fsdp2']}'s", judged["below_fsdp2"]))
    rest = {k: v for k, v in figures["meets_goals"].items() if k not in judged}
    if "communication_over_ideal_at_most" in goals:
        rest = {f"communication <= {goals['communication_over_ideal_at_most']} x ideal": rest.pop("communication"),
                **rest}
    print(f"{prefix}  " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in rest.items()))



def print_comparison(console, Table, report: dict) -> None:
    from engine.config import format_size
    table = Table(title="broadcast: bf16 against fp32, each variant (bytes per step: sharded's broadcast, "
                        "ddp's all-reduce; ms per step)", caption=f"note: {report['note']}")
    for col in ("variant", "bytes fp32", "bytes bf16", "bytes bf16/fp32", "step fp32", "step bf16",
                "step bf16/fp32"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in report["bf16_vs_fp32"]:
        table.add_row(r["variant"], format_size(r["bytes_per_step_fp32"]), format_size(r["bytes_per_step_bf16"]),
                      f"{r['bytes_ratio']:.3f}",
                      f"{r['step_ms_fp32']:.1f}", f"{r['step_ms_bf16']:.1f}", f"{r['step_ratio']:.3f}")
    console.print(table)
    print("ddp is torch's own mixed precision (fp32 weights and all-reduce under bf16 autocast); the sharded "
          "variants hold bf16 working weights, so their broadcast slices are bf16")
