"""Stages x replicas: which rank holds which stage of which replica of the pipeline.

    grid = Grid.of(stages=2, world_size=4, order="stage")   # 2 stages x 2 replicas
    grid.rank(stage=1, replica=0)      # 2: rank = stage x R + replica
    grid.stage_of(3), grid.replica_of(3)   # 1, 1
    grid.pipeline(replica=1)           # [1, 3]: that replica's stages, in order (its point-to-point messages)
    grid.group_of(stage=0)             # [0, 1]: that stage's replicas (their gradients' all-reduce)

One replica (stages == world size) is today's pipeline: rank r holds stage r. With R replicas every replica
runs the whole pipeline on its share of each global batch, and a stage's R replicas combine their gradients
before the update, so every replica's weights stay the same. `order` says which ranks neighbour: `stage` puts
a stage's replicas on neighbouring ranks, and so on one host (an agent gives each host consecutive ranks), so
that between hosts only a boundary's activations travel, not a stage's whole gradients; `replica` puts a
replica's stages on neighbouring ranks. `auto` is `stage` (docs/pipeline.md, Replicas). A replica's ranks rise
with its stages in either order, so a process group made of them numbers its members in stage order.

Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

ORDERS = ("auto", "stage", "replica")


@dataclass(frozen=True)
class Grid:
    stages: int
    replicas: int
    order: str = "stage"

    @classmethod
    def of(cls, stages: int, world_size: int, order: str = "auto") -> "Grid":
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        if stages < 1 or world_size % stages:
            raise ValueError(f"{stages} stages do not divide {world_size} workers into whole replicas")
        return cls(stages, world_size // stages, "stage" if order == "auto" else order)

    def rank(self, stage: int, replica: int) -> int:
        if self.order == "stage":
            return stage * self.replicas + replica
        return replica * self.stages + stage

    def stage_of(self, rank: int) -> int:
        return rank // self.replicas if self.order == "stage" else rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank % self.replicas if self.order == "stage" else rank // self.stages

    def pipeline(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, stage 0 first."""
        return [self.rank(s, replica) for s in range(self.stages)]

    def group_of(self, stage: int) -> list[int]:
        """The ranks holding one stage, replica 0 first."""
        return [self.rank(stage, p) for p in range(self.replicas)]

    def said(self) -> dict:
        """What the layout and run_start say of it: the stage and replica counts, the order, and each stage's
        ranks (replica 0 first)."""
        return {"stages": self.stages, "replicas": self.replicas, "order": self.order,
                "ranks": [self.group_of(s) for s in range(self.stages)]}
