"""`bench memory`'s tables (engine/bench/memory.py): a precision's variants with their peaks, swapped bytes
and plans, and bf16 against fp32 side by side (what keep holds, and each variant).

Imports engine.config (late: format_size).
"""

from __future__ import annotations


def _size(n) -> str:
    from engine.config import format_size
    return "—" if n is None else format_size(n)


def print_variants(console, Table, out: dict, figures: dict, kind: str, precision: str | None) -> None:
    """One precision's table and plans (`precision` None: the fp32-only run, printed as it always was)."""
    from engine.config import format_size
    where = "GPU (fits: the allocator's peak)" if kind == "cuda" else "CPU ledger (simulated device)"
    title = (f"bench memory: transformer stage ({out['layers']} layers), capacity "
             f"{format_size(figures['capacity_bytes'])} = 50% of keep's peak; {where}, "
             f"host link {out['host_link_gbps']} GB/s ({out['link']})")
    table = Table(title=title if precision is None else f"{precision} {title}")
    columns = ["variant", "samples/s", "x full recompute", "ledger peak", "allocator peak", "fits", "swapped/step",
               "swap", "recompute"]
    if precision is not None:
        columns.insert(4, "activations")
    for col in columns:
        table.add_column(col, justify="left" if col == "variant" else "right")
    size = _size
    for v, row in figures["variants"].items():
        fits = "—" if row["fits"] is None else "yes" if row["fits"] else "[red]no[/]"
        cells = [v, f"{row['samples_per_s']:.1f}", f"{row['vs_recompute']:.2f}", size(row["peak_bytes"]),
                 size(row["allocator_peak_bytes"]), fits, format_size(row["swapped_per_step_bytes"]),
                 str(row["swap_layers"]), str(row["recompute_layers"])]
        if precision is not None:
            cells.insert(4, size(row["activation_bytes"]))
        table.add_row(*cells)
    console.print(table)
    prefix = "" if precision is None else f"{precision} "
    for v, row in figures["variants"].items():
        if row["plan"]:
            chosen = ", ".join(f"{n}={p}" for n, p in row["plan"].items() if p != "keep") or "all keep"
            console.print(f"{prefix}{v}: {chosen}" + (f" ({row['note']})" if row["note"] else ""))


def print_comparison(console, Table, out: dict) -> None:
    def num(x, fmt):
        return "—" if x is None else format(x, fmt)
    held, ratios = out["bytes"], out["bf16_vs_fp32"]
    table = Table(title="bench memory: what keep holds, bf16 against fp32 (the ledger's bytes; activations: saved "
                        "by the end of the forward)")
    for col in ("bytes", "fp32", "bf16", "bf16/fp32"):
        table.add_column(col, justify="left" if col == "bytes" else "right")
    for k in held["fp32"]:
        table.add_row(k.replace("_", " "), _size(held["fp32"][k]), _size(held["bf16"][k]),
                      num(ratios["bytes"][k], ".3f"))
    console.print(table)
    table = Table(title="bench memory: each variant, bf16 against fp32 (each at 50% of its own keep's peak)",
                  caption=f"note: {out['note']}")
    for col in ("variant", "peak fp32", "peak bf16", "peak bf16/fp32", "activations bf16/fp32", "swapped bf16/fp32",
                "step fp32", "step bf16", "step bf16/fp32"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, r in ratios["variants"].items():
        a, b = out["variants"][v], out["bf16"]["variants"][v]
        table.add_row(v, _size(a["peak_bytes"]), _size(b["peak_bytes"]), num(r["peak_ratio"], ".3f"),
                      num(r["activation_ratio"], ".3f"), num(r["swapped_ratio"], ".3f"),
                      f"{a['median_step_ms']:.1f} ms", f"{b['median_step_ms']:.1f} ms", num(r["step_ratio"], ".3f"))
    console.print(table)
    console.print("optimizer state and masters stay fp32 (a bf16 weight's update steps its fp32 master), so a peak "
                  "halves only as far as parameters, gradients and activations make it up")
