"""What a headless run shows on the terminal: a progress bar, then a summary table.

Rank 0 draws it; the other ranks print nothing. Without a terminal (CI, pipes)
rich prints plain lines instead of redrawing.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn
from rich.table import Table

from engine.config import format_size


REFRESH_S = 0.5   # how often the bar is drawn, from the step loop's own update (no drawing thread beside it)


class HeadlessProgress:
    """The bar is drawn by `update`, at most every REFRESH_S: rich's own refresh thread woke five times a
    second beside the steps, and a step paid for formatting its figures each time."""

    def __init__(self, run_name: str, total_steps: int, first_step: int):
        self.console = Console(stderr=False)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[sps]} samples/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, transient=False, auto_refresh=False)
        self.task = self.progress.add_task(run_name, total=total_steps, completed=first_step,
                                           loss="-", sps="-")
        self.progress.start()
        self._drawn = 0.0
        self._last = None   # the newest step's figures, drawn when due and at the end

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        self._last = (step, loss, samples_per_s)
        now = time.monotonic()
        if now - self._drawn >= REFRESH_S:
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        if self._last is not None:
            step, loss, samples_per_s = self._last
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", sps=f"{samples_per_s:,.0f}",
                                 refresh=True)

    def note(self, text: str) -> None:
        self.progress.console.print(text)

    def finish(self, summary: dict) -> None:
        self._draw()
        self.progress.stop()
        table = Table(title=f"run {summary['name']}: summary", show_header=False)
        table.add_row("steps", str(summary["steps"]))
        table.add_row("final loss", f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "-")
        acc = summary.get("test_accuracy")
        table.add_row("test accuracy", f"{acc:.4f}" if acc is not None else "n/a")
        if summary.get("val_loss") is not None:   # engine/training/evaluation.py
            ppl = f" (perplexity {summary['perplexity']:,.2f})" if summary.get("perplexity") is not None else ""
            table.add_row("validation loss", f"{summary['val_loss']:.4f}{ppl}")
        table.add_row("wall time", f"{summary['wall_s']:.1f} s")
        if "compile_s" in summary:   # `[model] compile`: part of the wall time, none of the step times
            again = f", {summary['recompiles']} recompile(s)" if summary.get("recompiles") else ""
            table.add_row("compile time", f"{summary['compile_s']:.1f} s (slowest rank){again}")
        if summary.get("tokens_per_s"):   # the steps' median, the first left out
            mfu = f" (MFU {summary['mfu']:.1%})" if summary.get("mfu") else ""
            table.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}{mfu}")
        device = "simulated: CPU ledger" if summary.get("simulated") else "ledger"
        allocator = summary.get("allocator_peak_bytes_per_rank")
        for rank, peak in enumerate(summary["peak_bytes_per_rank"]):
            gpu = f"; GPU allocator peak {format_size(allocator[rank])}" if allocator and allocator[rank] else ""
            table.add_row(f"peak memory rank {rank}",
                          f"{format_size(peak)} of {format_size(summary['capacity_bytes'])} ({device}{gpu})")
        if summary.get("restarts"):
            table.add_row("restarts", str(summary["restarts"]))
        if summary.get("stopped_early"):
            table.add_row("stopped", f"at step {summary['steps']} (final checkpoint written)")
        self.console.print(table)
