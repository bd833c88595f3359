"""The rank grid and its process groups. Nothing else computes ranks or makes groups.

    topo = Topology.from_env(backend="auto", timeout_s=60)   # inside a worker
    topo.rank, topo.world_size, topo.is_first
    topo.compute   # gradients, activations, parameters (gloo on CPU, nccl on GPU)
    topo.side      # telemetry gather and command broadcast (always gloo, never the training groups)
    topo.stream_groups(n, include_compute=False)   # n communicators for the sliced broadcast
    topo.host_stream_groups(n)   # several hosts: per stream, this host's group and its peers' across hosts
    topo.hosts()   # the host of every rank (an agent places local_world_size consecutive ranks per host)
    Groups.data_parallel(rank, world).share(rank)   # who splits the batch, who holds one copy of the model

Workers read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT from the environment that torch's elastic agent (ours or torchrun's)
sets, so the same code runs on one host or many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from engine.runtime.devices import cuda_usable


@dataclass(frozen=True)
class Groups:
    """Who shares what, seen from one rank: `data`, the ranks that split every global batch between them, each
    taking the share at its index (data parallel: every rank; a pipeline: its stage alone, which takes the
    whole batch); `model`, the ranks that hold one copy of the model between them (data parallel: the rank
    alone; a pipeline: its stages, in order). A strategy says its own (engine/strategies/base.py parallel_groups)."""

    data: tuple[int, ...]
    model: tuple[int, ...]

    def share(self, rank: int) -> tuple[int, int]:
        """(index, shares): which equal share of every global batch `rank` takes (engine/training/data.py)."""
        return self.data.index(rank), len(self.data)

    @classmethod
    def data_parallel(cls, rank: int, world_size: int) -> "Groups":
        return cls(tuple(range(world_size)), (rank,))

    @classmethod
    def model_parallel(cls, rank: int, world_size: int) -> "Groups":
        return cls((rank,), tuple(range(world_size)))


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    timeout_s: float
    compute: object = None
    side: object = None
    host_ids: list[int] | None = None   # every rank's host number, where the hosts say it (engine/run/rank.py meet)

    @classmethod
    def from_env(cls, backend: str, device_kind: str, timeout_s: float) -> "Topology":
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if backend == "auto":
            gpu = device_kind == "cuda" or (device_kind == "auto" and cuda_usable(local_world))
            backend = "nccl" if gpu else "gloo"
        topo = cls(rank, world, local_rank, local_world, backend, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout)
        topo.compute = dist.group.WORLD
        # The side group carries small CPU tensors (telemetry, commands) beside training.
        topo.side = dist.new_group(backend="gloo", timeout=timeout)
        return topo

    def stream_groups(self, n: int, include_compute: bool) -> list:
        """`n` communication streams, each its own process group on the training backend (on a GPU,
        NCCL gives each group its own communicator and CUDA stream). With `include_compute` the
        compute group is stream 0. Every rank must call this at the same point."""
        groups = [self.compute] if include_compute else []
        while len(groups) < n:
            groups.append(dist.new_group(backend=self.backend, timeout=timedelta(seconds=self.timeout_s)))
        return groups

    def host_stream_groups(self, n: int) -> tuple[list, list]:
        """Across hosts: for each of `n` streams, the group of this rank's host and the group of the ranks
        with this rank's local index on every host (its peers on the other hosts). Every rank must call this
        at the same point."""
        k, timeout = self.local_world_size, timedelta(seconds=self.timeout_s)
        host, local = divmod(self.rank, k)
        within, across = [], []
        for _ in range(n):
            for h in range(self.world_size // k):
                group = dist.new_group(ranks=list(range(h * k, h * k + k)), backend=self.backend, timeout=timeout)
                if h == host:
                    within.append(group)
            for j in range(k):
                group = dist.new_group(ranks=list(range(j, self.world_size, k)), backend=self.backend,
                                       timeout=timeout)
                if j == local:
                    across.append(group)
        return within, across

    def subgroups(self, rank_lists: list[list[int]]) -> object | None:
        """One process group on the training backend per list of ranks (`rank_lists` cover each rank at most
        once: a pipeline's replicas, a stage's replicas); returns the one this rank is in (None: none). Every
        rank must call this at the same point with the same lists."""
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=sorted(ranks), backend=self.backend, timeout=timedelta(seconds=self.timeout_s))
            if self.rank in ranks:
                mine = group
        return mine

    def release(self, groups: list) -> None:
        """Destroy groups made by stream_groups (the compute and side groups stay)."""
        for group in groups:
            if group is not self.compute and group is not self.side:
                dist.destroy_process_group(group)

    def hosts(self) -> list[int]:
        """The host (node) of every rank: an agent gives each host `local_world_size` consecutive ranks; its
        number where the hosts said it (a run that lost a host numbers the ranks over the hosts left)."""
        if self.host_ids is not None:
            return list(self.host_ids)
        return [r // self.local_world_size for r in range(self.world_size)]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
