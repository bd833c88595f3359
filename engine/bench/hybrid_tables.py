"""`bench hybrid`'s tables and their rows: each placement case with its measured and modelled times, and
fp32 against bf16.

Imports nothing of the engine.
"""

from __future__ import annotations

import statistics


def case_rows(cases: dict, times: dict, links: dict | None) -> dict:
    """Each capacity's placements with their measured times (`links`: with host link bytes per step too)."""
    out = {}
    for label, case in cases.items():
        rows = {}
        for name, plan in case["plans"].items():
            ms = statistics.median(times[plan.placement]) if plan.fits else None
            rows[name] = {"fits": plan.fits, "host_layers": plan.host_layers, "modelled_ms": round(plan.makespan_ms, 2),
                          "measured_ms": None if ms is None else round(ms, 2),
                          "device_bytes": plan.device_bytes}
            if links is not None:
                rows[name]["host_link_bytes_per_step"] = (int(statistics.median(links[plan.placement]))
                                                          if plan.fits else None)
        host, best = rows["all-host"]["measured_ms"], rows["brute-force"]["measured_ms"]
        for row in rows.values():
            if row["measured_ms"] is not None:
                row["ratio_to_all_host"] = round(row["measured_ms"] / host, 3)
                row["ratio_to_brute_force"] = round(row["measured_ms"] / best, 3)
        auto = rows["auto-global"]
        out[label] = {
            "capacity_bytes": case["capacity_bytes"], "placements": rows,
            "meets_goals": {"auto_at_most_0.85x_all_host": auto["ratio_to_all_host"] <= 0.85,
                            "auto_within_5pct_of_brute_force": auto["ratio_to_brute_force"] <= 1.05}}
    return out



def compare_row(fp32: dict, bf16: dict) -> dict:
    """One placement in both precisions (each planned from its own profile: an auto plan may differ)."""
    from engine.bench.broadcast import ratio
    return {"host_layers_fp32": fp32["host_layers"], "host_layers_bf16": bf16["host_layers"],
            "host_link_bytes_fp32": fp32["host_link_bytes_per_step"],
            "host_link_bytes_bf16": bf16["host_link_bytes_per_step"],
            "bytes_ratio": ratio(bf16["host_link_bytes_per_step"], fp32["host_link_bytes_per_step"], 4),
            "measured_ms_fp32": fp32["measured_ms"], "measured_ms_bf16": bf16["measured_ms"],
            "step_ratio": ratio(bf16["measured_ms"], fp32["measured_ms"])}


def print_cases(console, Table, report: dict, figures: dict, kind: str, precision: str | None) -> None:
    """One precision's table per capacity (`precision` None: the fp32-only run, printed as it always was)."""
    from engine.config import format_size
    for label, case in figures["cases"].items():
        title = (f"hybrid update, {label} capacity {case['capacity_bytes'] / 2**20:.1f} MiB: "
                 f"{figures['layers_with_updates']} layers, AdamW, 1 worker on {kind} (ms per step, median of "
                 f"{report['rounds']} rounds)")
        table = Table(title=title if precision is None else f"{precision} {title}")
        columns = ["placement", "host layers", "modelled", "measured", "x all-host", "x brute-force"]
        if precision is not None:
            columns.append("host link/step")
        for col in columns:
            table.add_column(col, justify="left" if col == "placement" else "right")
        for name, row in case["placements"].items():
            link = [] if precision is None else ["—" if row["host_link_bytes_per_step"] is None
                                                 else format_size(row["host_link_bytes_per_step"])]
            if not row["fits"]:
                table.add_row(name, str(row["host_layers"]), f"{row['modelled_ms']:.1f}",
                              "[red]infeasible[/]", "—", "—", *link)
                continue
            table.add_row(name, str(row["host_layers"]), f"{row['modelled_ms']:.1f}", f"{row['measured_ms']:.1f}",
                          f"{row['ratio_to_all_host']:.3f}", f"{row['ratio_to_brute_force']:.3f}", *link)
        console.print(table)
        prefix = "" if precision is None else f"{precision}: "
        console.print(prefix + "goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}"
                                                     for k, v in case["meets_goals"].items()))



def print_comparison(console, Table, report: dict) -> None:
    from engine.config import format_size

    def size(n):
        return "—" if n is None else format_size(n)

    def num(x, fmt):
        return "—" if x is None else format(x, fmt)
    for label, rows in report["bf16_vs_fp32"].items():
        table = Table(title=f"hybrid update, {label} capacity: bf16 against fp32 (host link bytes per step of the "
                            f"host-placed layers, both ways; ms per step)", caption=f"note: {report['note']}")
        for col in ("placement", "host layers fp32/bf16", "link fp32", "link bf16", "link bf16/fp32", "step fp32",
                    "step bf16", "step bf16/fp32"):
            table.add_column(col, justify="left" if col == "placement" else "right")
        for name, r in rows.items():
            table.add_row(name, f"{r['host_layers_fp32']}/{r['host_layers_bf16']}", size(r["host_link_bytes_fp32"]),
                          size(r["host_link_bytes_bf16"]), num(r["bytes_ratio"], ".3f"),
                          num(r["measured_ms_fp32"], ".1f"), num(r["measured_ms_bf16"], ".1f"),
                          num(r["step_ratio"], ".3f"))
        console.print(table)
    console.print("each precision plans from its own profile: an auto placement may differ between them (its host "
                  "layers say); the same placement moves half the link bytes in bf16")
