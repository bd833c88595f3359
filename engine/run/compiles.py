"""`[model] compile` as the step loop reports it: a `compile` event at each step in which a rank compiled, with
what each rank's compiles took, apart from the step times (docs/telemetry.md); the summary's `compile_s` comes
from the same columns (engine/runtime/control.py Peaks).

    report = CompileReport(world_size)
    forward(tel, step, report.events(step, table))   # every rank, after the step's exchange

Each rank puts its process's compile milliseconds and recompiles so far (engine/models/compile.py
compile_figures) into the exchange: `compile_ms`, `recompiles`. Imports engine.runtime.control and
engine.runtime.events.
"""

from __future__ import annotations

from engine.runtime.control import Table, column
from engine.runtime.events import Event


class CompileReport:
    def __init__(self, world_size: int):
        self.ms = [0.0] * world_size
        self.recompiles = 0

    def events(self, step: int, table: Table) -> list[Event]:
        ms = column(table, "compile_ms")
        if all(now <= seen for now, seen in zip(ms, self.ms)):
            return []
        step_s = [round(max(now - seen, 0.0) / 1000, 3) for now, seen in zip(ms, self.ms)]
        self.ms = [max(now, seen) for now, seen in zip(ms, self.ms)]
        recompiles = int(sum(column(table, "recompiles")))
        new, self.recompiles = recompiles - self.recompiles, max(recompiles, self.recompiles)
        total_s = round(max(self.ms) / 1000, 3)
        note = (f"compiled in step {step}: {max(step_s):.1f} s on the slowest rank ({total_s:.1f} s so far), "
                f"apart from the step times")
        if new > 0:
            note += f"; [yellow]{new} recompile(s)[/]: a layer's graph was compiled again (see the rank's stderr)"
        return [Event("compile", dict(compile_s=max(step_s), compile_s_per_rank=step_s, total_s=total_s,
                                      recompiles=recompiles), note=note)]
