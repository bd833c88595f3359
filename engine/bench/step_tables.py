"""`trainyard bench step`'s tables: each size's variants with their step times, throughput, memory and ratios to
each plain loop, the compiled plain loops' graphs, and the goals judged (engine/bench/step.py measures them).

Imports engine.config and engine.bench.verdict.
"""

from __future__ import annotations

from engine.bench.verdict import say


def print_reports(reports: list[dict], left_out: dict, bases: tuple[str, ...]) -> None:
    """Each report's table (a column of ratios to each of `bases` that ran), then its goals, failures and what was
    left out."""
    from rich.console import Console
    from rich.table import Table

    from engine.config import format_size
    console = Console()
    for report in reports:
        table = Table(title=f"step: {report['size']} size on {report['device']}, batch {report['batch']} x "
                            f"{report['seq_len']}, {report['precision']}, {report['rounds']} rounds of "
                            f"{report['steps']} steps (second half timed)")
        ran = [b for b in bases if any(row["variant"] == b for row in report["variants"])]   # the ratios' columns
        for col in ("variant", "step ms (rounds)", "tokens/s", "MFU", "peak memory", *(f"x {b}" for b in ran)):
            table.add_column(col)
        for row in report["variants"]:
            table.add_row(row["variant"], f"{row['step_ms']:.2f} ({', '.join(f'{x:.2f}' for x in row['rounds_ms'])})",
                          f"{row['tokens_per_s']:,.0f}", f"{row['mfu']:.1%}" if "mfu" in row else "—",
                          format_size(row["peak_bytes"]) if row["peak_bytes"] else "—",
                          *(_ratio(row, b) for b in ran))
        console.print(table)
        for row in (r for r in report["variants"] if "graphs" in r):
            console.print(f"{row['variant']}: dynamo compiled {row['graphs']} graph(s) for its {row['blocks']} blocks "
                          f"(recompile limit {row['recompile_limit']})")
        console.print(f"peak FLOP/s: {report['peak_source']}")
        for name, judged in report["judged"].items():
            console.print(say(name, judged))
        for v, why in report["failed"].items():
            console.print(f"{v} FAILED: {why}")
    for v, why in left_out.items():
        console.print(f"{v} left out: {why}")


def _ratio(row: dict, base: str) -> str:
    if f"x_{base}" not in row:
        return "—"
    lo, hi = row[f"x_{base}_spread"]
    return f"{row[f'x_{base}']:.3f} ({lo:.3f}-{hi:.3f})"
