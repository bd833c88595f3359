"""What every rank of every mode sets up alike: the Job it was given, its place among the hosts, its pid
file, device, data and model.

    job = Job(config=cfg)                       # pickled to each worker process by the launcher
    restart, device, data, model = build_rank(job, topo)

The data-parallel and pipeline step loop (engine/run/worker.py) starts here, and hands `build_rank` to the
parameter server's roles (engine/strategies/param_server/), which sit below the run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from engine.config import Config
from engine.training.data import Dataset, load_dataset
from engine.models import LayerList, build_model
from engine.models.compile import compile_layers
from engine.training.precision import param_dtype
from engine.runtime.devices import open_device
from engine.run.claim import hold_as_worker
from engine.run.handover import received_model
from engine.runtime.topology import Topology


@dataclass
class Job:
    """Everything a worker needs; pickled to each worker process (never with the caller's model: see
    engine/run/handover.py)."""
    config: Config
    model: LayerList | None = None       # a user's model, the caller's own object: the launcher's alone
    data: Dataset | None = None          # a user's data (None: load cfg.data); handed over as a private copy
    model_file: Path | None = None       # the user's model, saved by the launcher; each worker loads its own
    resume: Path | None = None           # a verified checkpoint folder
    telemetry_log: Path | None = None
    headless: bool = True
    launched_at: float = 0.0
    # several hosts, our launcher: (the workers' store host, its port): host 0, the rendezvous port + 1
    placement: tuple[str, int] | None = None
    # our launcher, from its main thread: the file a worker writes a refusal to before signalling it
    # (engine/runtime/refusal.py)
    refusal_path: str | None = None
    # our launcher or torchrun's agent: (pid, start time), which every worker watches (engine/processes/lifeline.py)
    launcher: tuple[int, int | None] | None = None
    # the launcher's claim on the run folder (engine/run/claim.py): the launcher's alone, never pickled
    claim: object | None = None
    # our launcher: how many times its agent has restarted the worker group, for a failure or for a host that
    # joins (torch's TORCHELASTIC_RESTART_COUNT counts failures only); the next start's pickle carries it
    generation: int = 0
    # our launcher: whether its agent's latest restart was for a host that joins, not a failure (what rank 0's
    # run says of the restart: a parameter server's world is the same size before and after one)
    joined: bool = False
    # (kind, capacity_bytes, local_rank, local_world_size) -> device; None: engine.runtime.devices.open_device.
    # Tests give one whose probe returns a GPU's figures, so the CUDA telemetry path runs on the CPU.
    open_device: Callable | None = None
    # a user's loss (engine/training/loss.py: the mean over a share's samples); None: cross entropy, -100 ignored
    loss_fn: Callable | None = None

    def __getstate__(self) -> dict:
        # Pickling the caller's model to a spawned worker would move its tensors into shared memory and make
        # them the worker's: workers load model_file instead (handover.hand_over writes it first).
        if self.model is not None and self.model_file is None:
            raise RuntimeError("a Job with a user's model is pickled before handover.hand_over(job) saved it")
        return {**self.__dict__, "model": None, "claim": None}

    def log_path(self) -> Path:
        if self.telemetry_log:
            return Path(self.telemetry_log)
        log = self.config.telemetry.log
        return Path(log) if log else self.config.run_dir / "telemetry.jsonl"


def agent_dir(run_dir: Path, node_rank: int) -> Path:
    """Where host `node_rank`'s elastic agent keeps its logs (and the launcher its refusal file)."""
    return Path(run_dir) / "agent" / f"node{node_rank}"


def restart_marker(run_dir: Path, node_rank: int) -> Path:
    """The file host `node_rank`'s launcher writes the restart's generation to when its agent restarts the worker
    group for a host that joins, before the agent signals the workers (launch._RestartReporter): what tells a
    stopped worker that the run goes on (Worker.restarting)."""
    return agent_dir(run_dir, node_rank) / "restarting"


def restart_marked(run_dir: Path, node_rank: int) -> int:
    """The generation the marker names; -1 where there is none."""
    try:
        return int(restart_marker(run_dir, node_rank).read_text())
    except (OSError, ValueError):
        return -1


def place_on_host(job: Job) -> None:
    """Before the process group starts: the network interface, and (several hosts under our launcher) the
    workers' store on host 0. The ranks are the agent's: the rendezvous numbers the hosts that are there in the
    order of their names, which our launcher makes their host numbers (launch.host_name), so the ranks are
    contiguous over the hosts present, host 0's first; meet() checks it."""
    interface = job.config.cluster.interface
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if job.placement is not None:
        host, port = job.placement
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))


def build_rank(job: Job, topo: Topology):
    """What every rank builds alike: its pid file, device, data and model (the same weights on every
    rank, from the seed). Returns (restart count, device, data, model)."""
    cfg = job.config
    pid_dir = cfg.run_dir / "pids"
    hold_as_worker(cfg.run_dir, cfg.cluster.node_rank)   # the folder is this run's while any worker lives
    (pid_dir / f"rank{topo.rank}.pid").write_text(str(os.getpid()))
    device = (job.open_device or open_device)(cfg.device.kind, cfg.capacity_bytes, topo.local_rank,
                                              topo.local_world_size)
    data = job.data if job.data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = received_model(job) if job.model_file is not None else build_model(cfg.model, data.meta, cfg.run.seed)
    restart, device.rank_names = meet(topo, device.name, job.generation,
                                      job.config.cluster.node_rank if job.placement is not None else None)
    # the working weights in their dtype (bf16 under precision.params = "bf16"; the fp32 masters are made
    # where the updates run: engine/techniques/updates/layer.py)
    model = model.to(device.torch_device, dtype=param_dtype(cfg.precision))
    if cfg.model.compile:   # before any technique wraps a layer or hooks it: they act around the compiled call
        for note in compile_layers(model):
            if topo.is_first:
                print(f"trainyard: model.compile: {note}", file=sys.stderr, flush=True)
    return restart, device, data, model


def meet(topo: Topology, device_name: str, generation: int = 0, node_rank: int | None = None
         ) -> tuple[int, list[str]]:
    """Every rank's word at start: how many times the group has restarted (the largest count of any
    host's agent: a host that was lost and started again has a fresh agent, count 0, while the others
    count on, and its ranks must resume too; a restart for a host that joins is counted by our launcher,
    `generation`, as torch counts failures only), and every rank's device name (run_start's `devices`).
    `node_rank`: this rank's host number (several hosts, our launcher), which sets `topo.host_ids`: the
    hosts there, in rank order, must come in host order (RuntimeError otherwise: ranks numbered by another
    order would put rank 0, the hub and the pipeline's neighbours elsewhere than configured)."""
    mine = (max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), generation), device_name, node_rank)
    everyone: list = [None] * topo.world_size
    dist.all_gather_object(everyone, mine, group=topo.side)
    if node_rank is not None:
        hosts = [host for _, _, host in everyone]
        twice = sorted({h for h in hosts if hosts.count(h) > topo.local_world_size})
        if twice:
            raise RuntimeError(f"host number(s) {', '.join(map(str, twice))} joined the run from two hosts: every host "
                               f"needs its own --node-rank (cluster.node_rank)")
        if hosts != sorted(hosts):
            raise RuntimeError(f"the rendezvous numbered the ranks over hosts {hosts} (by rank), not in host order; "
                               f"this torch orders hosts otherwise than by name (engine/run/launch.py host_name)")
        topo.host_ids = hosts
    return max(count for count, _, _ in everyone), [name for _, name, _ in everyone]
