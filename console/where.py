"""Where a layer runs in a pipeline, in words, for the answer to a command on it: the console's events panel
and `trainyard ctl` say which stage a set-policy or set-placement changed, and that it changed every replica
of that stage (every rank applies a command at the same boundary; each replica of a stage holds its layers).

    grid_of(hello)                                   # layout.grid where the run has several replicas, else None
    stage_of("blocks.3", stages=step["stages"])      # 1: the stage holding it in the layout the step ended in
    applied_on("blocks.3", 1, grid)   # 'blocks.3 is on stage 1: applied on each of its 2 replicas (ranks 2, 3)'
    where_applied("set-policy", ["blocks.3", "swap"], hello, step)   # the same from a hello and a step, or None

Imports nothing: `trainyard ctl` reads it without loading the console's widgets.
"""

from __future__ import annotations

LAYER_COMMANDS = ("set-policy", "set-placement")   # commands whose first argument is a layer


def grid_of(hello: dict) -> dict | None:
    """The run's stages x replicas as it says them (hello's layout.grid); None without one or with one replica."""
    grid = (hello.get("layout") or {}).get("grid")
    ok = isinstance(grid, dict) and isinstance(grid.get("ranks"), list) and (grid.get("replicas") or 1) > 1
    return grid if ok else None


def stage_of(layer: str, stages: list | None = None, rows: list | None = None,
             layout: dict | None = None) -> int | None:
    """The stage holding `layer`: from a step's `stages` (the layout it ended in), else from the layer rows'
    `stage`, else from the layout the run started in (hello's layout.stages); None where none says."""
    for stage in stages or []:
        if isinstance(stage, dict) and layer in (stage.get("layers") or []):
            return stage.get("stage")
    for row in rows or []:
        if isinstance(row, dict) and row.get("name") == layer and isinstance(row.get("stage"), int):
            return row["stage"]
    for index, names in enumerate((layout or {}).get("stages") or []):
        if isinstance(names, list) and layer in names:
            return index
    return None


def applied_on(layer: str, stage: int, grid: dict | None, name: str = "set-policy") -> str:
    """'blocks.3 is on stage 1', and with replicas ': applied on each of its 2 replicas (ranks 2, 3)' (a
    set-placement where one replica owns each layer's update, `grid["owners"]`: on that one)."""
    ranks = grid["ranks"][stage] if grid and 0 <= stage < len(grid["ranks"]) else None
    if not ranks:
        return f"{layer} is on stage {stage}"
    listed = ", ".join(str(rank) for rank in ranks)
    if name == "set-placement" and grid.get("owners"):
        return f"{layer} is on stage {stage}: applied on the one of its {len(ranks)} replicas that owns its " \
               f"update (ranks {listed})"
    return f"{layer} is on stage {stage}: applied on each of its {len(ranks)} replicas (ranks {listed})"


def where_applied(name: str, args: list, hello: dict, step: dict | None, rows: list | None = None) -> str | None:
    """applied_on for a command on a layer of a pipeline (its stage from `step`'s stages, else `rows`, else the
    hello's layout); None for another command, or in a run without stages."""
    if name not in LAYER_COMMANDS or not args:
        return None
    layout = hello.get("layout") if isinstance(hello.get("layout"), dict) else None
    stage = stage_of(args[0], (step or {}).get("stages"), rows, layout)
    return None if stage is None else applied_on(args[0], stage, grid_of(hello), name)
