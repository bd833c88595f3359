"""`[telemetry] trace_steps`: chosen steps recorded by torch.profiler, so a user sees what a step spends its time
on, operator by operator, on the host and (on a GPU) on the device.

    trace = StepTrace.from_config(cfg.telemetry.trace_steps, run_dir, rank, device)   # None where off
    trace.before(step)    # step (0-based) is about to train: starts at FIRST
    trace.after(step)     # its record is out: stops after LAST, and writes
    trace.close()         # a run that ends inside the span writes what it recorded

Each rank writes `<run dir>/trace/rank<R>.json` (a Chrome trace: chrome://tracing or https://ui.perfetto.dev)
and `rank<R>.txt` (torch's table of operators, by their own time on the device where there is one, else on the
host). The span covers the steps' whole loop: the strategy's step, the boundary's exchange and the report, so
what trainyard adds beside the model is in it. Recording costs time: the traced steps are slower than the
others, and their records say so only by their times.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config.rules import step_span


def last_steps_but_one(steps: int) -> tuple[int, int]:
    """The steps a bench's traced turn of `steps` records: the last three before its last (its end is not a step's
    work), from step 2 at the least (1-based)."""
    first = max(2, steps - 3)
    return first, max(first, steps - 1)


class StepTrace:
    def __init__(self, first: int, last: int, folder: Path, stem: str, device: torch.device):
        self.first, self.last, self.folder, self.stem = first, last, folder, stem
        self.cuda = device.type == "cuda"
        self.prof = None

    @classmethod
    def from_config(cls, text: str, run_dir, rank: int, device: torch.device) -> StepTrace | None:
        steps = step_span(text)
        return cls(*steps, Path(run_dir) / "trace", f"rank{rank}", device) if steps else None

    def before(self, step: int) -> None:
        if step + 1 == self.first and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        """`step`: 1-based, the record just made."""
        if self.prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.folder / f"{self.stem}.json"))
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70)
        (self.folder / f"{self.stem}.txt").write_text(table + "\n")
