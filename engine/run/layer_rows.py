"""The console's layer table: one row per layer, with its measured times (engine/runtime/profiler.py),
its activation policy, its stage or owner, and where its optimizer update runs and how long it took.

    rows = LayerRows(strategy, memory, topo)
    rows.stale = True                              # a policy or placement command (every rank)
    layers = rows.gather(measured, table, due)     # every rank, at the step's boundary (collectives)
    layers = rows.report(layers)                   # rank 0: the rows for this step's record, or None

What each rank knows differs by strategy, so `gather` brings it to rank 0 on steps that are the same
on every rank (rows due, a memory plan on any rank, a command, a new pipeline layout):

- a pipeline stage holds only its own layers: each stage measures them, and rank 0 gathers every
  stage's rows. A layer that moved in since the stage last measured has no times yet: it is sent
  with its policy and placement, and rank 0 keeps the times it last had (a layer's own times do not
  change with the stage that runs it).
- sharded: every rank runs every layer (rank 0 measures them), but a layer's update runs on its
  owner: rank 0 gathers each layer's placement and update time from the rank that owns it.
- otherwise (data parallel, one worker) rank 0 knows everything.

Imports torch.distributed and engine.runtime.control's column names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.runtime.control import Table, column

TIMES = ("fwd_ms", "bwd_ms", "activation_bytes")


class LayerRows:
    def __init__(self, strategy, memory, topo):
        self.strategy, self.memory, self.topo = strategy, memory, topo
        self.by_stage = strategy.staged
        self.stage = strategy.rank if self.by_stage else None   # a pipeline: this rank's stage (grid.py)
        self.by_owner = strategy.owning and topo.world_size > 1
        self.stale = False                     # a command changed a policy or placement since the last rows
        self.own: list[dict] = []              # pipeline: this stage's last rows
        self.layout: list[list[str]] | None = None   # pipeline: the layout of the last gathered rows
        self.update_info: dict[str, tuple[str, float]] = {}   # sharded, rank 0: layer -> (placement, ms)
        self.last: list[dict] | None = None    # rank 0: the last rows reported
        self.last_measured: list[dict] | None = None   # rank 0, not a pipeline: the profiler's last rows
        self.refresh = False                   # rank 0: placements changed since the last rows

    def rows(self, measured: list[dict]) -> list[dict]:
        """The profiler's rows (a pipeline stage: of its own layers) with what this rank knows of each
        layer: its policy, owner or stage, update placement, and the update's measured time on that side."""
        strategy = self.strategy
        owners = strategy.layer_owners()
        stages = strategy.layer_stages() if self.by_stage else {}
        updates = strategy.updater.by_name
        rows = []
        for entry in measured:
            name, row = entry["name"], dict(entry)
            if stages and stages[name] != self.stage:
                continue   # a stage measures its own layers only
            row["policy"] = self.memory.policy[name]
            if name in stages:
                row["stage"] = stages[name]
            if name in owners:
                row["owner_rank"] = owners[name]
            if name in self.update_info:
                row["placement"], row["update_ms"] = self.update_info[name]
            elif name in updates:
                row["placement"], row["update_ms"] = update_figures(updates[name])
            rows.append(row)
        return rows

    def gather(self, measured: list[dict] | None, table: Table, due: bool) -> list[dict] | None:
        """Every rank, at the boundary: this step's rows as rank 0 reports them (None: nothing new)."""
        if self.by_stage:
            return self._gather_stages(measured, table)
        if self.by_owner:
            self._gather_updates(due, table)
        return measured

    def _gather_stages(self, measured: list[dict] | None, table: Table) -> list[dict] | None:
        layout = self.strategy.stage_layers
        changed = max(column(table, "plan_made")) > 0 or self.layout != layout or self.stale
        if measured is None and not changed:
            return None
        self.layout, self.stale = [list(s) for s in layout], False
        base = measured if measured is not None else self.own
        mine = [n for n, stage in self.strategy.layer_stages().items() if stage == self.stage]
        have = {row["name"] for row in base}
        self.own = self.rows([*base, *({"name": n} for n in mine if n not in have)])   # moved in: no times yet
        gathered = [None] * self.topo.world_size if self.topo.is_first else None
        dist.gather_object(self.own, gathered, dst=dist.get_global_rank(self.topo.side, 0), group=self.topo.side)
        if not self.topo.is_first:
            return None
        before = {row["name"]: row for row in self.last or []}
        # with replicas, each stage's rows come from each: the first replica's stand, with the update's placement
        # and time from the replica that runs it (sharded replicas: the layer's owner)
        seen: set[str] = set()
        rows = [row for part in gathered for row in part if not (row["name"] in seen or seen.add(row["name"]))]
        placed = {row["name"]: row for part in gathered for row in part if "placement" in row}
        for row in rows:
            if "placement" not in row and row["name"] in placed:
                row["placement"], row["update_ms"] = placed[row["name"]]["placement"], placed[row["name"]]["update_ms"]
        for row in rows:
            if "fwd_ms" not in row:   # a layer that moved: its times where it ran before, until measured here
                row.update({k: before.get(row["name"], {}).get(k, 0) for k in TIMES})
        return rows

    def _gather_updates(self, due: bool, table: Table) -> None:
        if not (due or self.stale or max(column(table, "plan_made")) > 0):
            return
        self.stale = False
        owners, rank = self.strategy.layer_owners(), self.topo.rank
        mine = {name: update_figures(u) for name, u in self.strategy.updater.by_name.items()
                if owners.get(name) == rank}
        gathered = [None] * self.topo.world_size if self.topo.is_first else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(self.topo.side, 0), group=self.topo.side)
        if self.topo.is_first:
            info = {name: figures for part in gathered for name, figures in part.items()}
            self.refresh = info != self.update_info
            self.update_info = info

    def report(self, layers: list[dict] | None) -> list[dict] | None:
        """Rank 0: the rows for this step's record; None when there is nothing new to show."""
        if layers is not None and not self.by_stage:
            self.last_measured = layers
            layers = self.rows(layers)
        elif not self.by_stage and self.last_measured is not None and (self.refresh or any(
                row.get("policy") != self.memory.policy[row["name"]] for row in self.last or [])):
            # a policy or placement changed (a command, a plan): the last measured rows, as things are now
            layers = self.rows(self.last_measured)
        self.refresh = False
        if layers is not None:
            self.last = layers
        return layers


def update_figures(u) -> tuple[str, float]:
    """A layer update's side and its last measured time on that side."""
    return u.side, round(u.device_ms_known() if u.side == "device" else u.host_ms + u.copy_ms, 4)
