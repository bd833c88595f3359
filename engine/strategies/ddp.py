"""Baseline data parallel: torch DistributedDataParallel, the reference every technique is measured against.

    strategy = DDPStrategy(model, optim_cfg, topo, device)
    loss = strategy.train_step(x, y)      # forward, backward (all-reduce inside), optimizer step
    strategy.timings                      # fwd_ms, bwd_ms, optim_ms of that step
    strategy.stream_stats()               # the one communicator: bytes, busy time, in flight
    strategy.save(staged_dir); strategy.load(checkpoint, manifest)

Every strategy has this interface (engine/strategies/interface.py: Strategy): it builds its own
optimizer over what it updates, and writes and reads its own checkpoint files.

Each rank runs its slice of the global batch; DDP averages gradients, so a step
equals a single-process step on the whole global batch. A communication hook
around DDP's own all-reduce measures the traffic without changing it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from engine.runtime import checkpoint as ckpt
from engine.config import OptimConfig, UpdateConfig
from engine.runtime.devices import LedgerDevice
from engine.techniques.hybrid import HybridUpdater
from engine.runtime.topology import Topology

COMMANDS = ("pause", "resume", "stop", "checkpoint", "set-placement")   # what an operator can do in this mode


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Classification (B, C) and next-token (B, T, V) losses alike."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class CommMeter:
    """Bytes and busy time of one communicator, from launch to completion of each operation."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.busy_ms = 0.0
        self.in_flight = 0

    def started(self, nbytes: int) -> float:
        with self._lock:
            self.in_flight += 1
            self.bytes += nbytes
        return time.perf_counter()

    def finished(self, t0: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.busy_ms += (time.perf_counter() - t0) * 1000

    def take(self) -> dict:
        with self._lock:
            out = {"bytes": self.bytes, "busy_ms": self.busy_ms, "in_flight": self.in_flight}
            self.bytes, self.busy_ms = 0, 0.0
        return out


def stream_entry(stream: int, taken: dict, step_ms: float) -> dict:
    """A step record's `streams` entry from a meter's take(): its busy time as a fraction of the step."""
    busy = min(taken["busy_ms"] / step_ms, 1.0) if step_ms > 0 else 0.0
    return {"stream": stream, "bytes": taken["bytes"], "busy_ms": round(taken["busy_ms"], 3),
            "busy_fraction": round(busy, 4), "in_flight": taken["in_flight"]}


class DDPStrategy:
    name = "ddp"
    commands = COMMANDS

    def __init__(self, model: torch.nn.Module, optim_cfg: OptimConfig, topo: Topology,
                 device: LedgerDevice, update_cfg: UpdateConfig | None = None, loss_fn=cross_entropy):
        self.model, self.topo, self.device, self.loss_fn = model, topo, device, loss_fn
        ids = [device.torch_device.index] if device.kind == "cuda" else None
        # DDP broadcasts rank 0's parameters here, so every rank starts from the same weights. With
        # gradients as views into DDP's buckets, a bucket's gradients are final when its all-reduce is.
        # Host updates start when their bucket's all-reduce completes: with updates on the host, buckets
        # of about one layer (1 MiB) let them start layer by layer; all on the device, DDP's default.
        update_cfg = update_cfg or UpdateConfig()
        bucket_mb = 25.0 if update_cfg.placement == "device" else 1.0
        self.ddp = DistributedDataParallel(model, device_ids=ids, process_group=topo.compute,
                                           gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
        self.meter = CommMeter()
        self.ddp.register_comm_hook(topo.compute, self._metered_allreduce)
        # each layer's update, on the device or the host, dispatched as its bucket's all-reduce completes
        self.updater = HybridUpdater(model, params_by_layer(model), optim_cfg, device, update_cfg)
        self.optimizer = self.updater   # what the ledger counts: device-side optimizer state
        for p in model.parameters():    # device updates run inline on the compute thread, during backward
            p.register_post_accumulate_grad_hook(lambda _p: self.updater.run_device_ready())
        self.timings = {"fwd_ms": 0.0, "bwd_ms": 0.0, "optim_ms": 0.0}

    def _metered_allreduce(self, group, bucket):
        buffer = bucket.buffer()
        t0 = self.meter.started(buffer.numel() * buffer.element_size())

        def done(fut):
            self.meter.finished(t0)
            self.updater.params_reduced(bucket.parameters())
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()
        return default_hooks.allreduce_hook(group, bucket).then(done)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.to(self.device.torch_device), y.to(self.device.torch_device)
        self.updater.begin_step()   # gradients were zeroed by the updates that used them
        t0 = time.perf_counter()
        with self.device.ledger.saved_activations():
            loss = self.loss_fn(self.ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.updater.end_backward()
        t3 = time.perf_counter()
        hybrid = self.updater.timings()
        self.timings = {"fwd_ms": (t1 - t0) * 1000, "bwd_ms": (t2 - t1) * 1000,
                        "optim_ms": hybrid["update_device_ms"], **hybrid, "after_backward_ms": (t3 - t2) * 1000}
        self.device.ledger.refresh()
        return loss.item()

    def stream_stats(self, step_ms: float) -> list[dict]:
        return [stream_entry(0, self.meter.take(), step_ms)]

    def layout(self) -> dict:
        return {"strategy": self.name}

    def sync(self) -> float:
        """Host updates in flight land (before a checkpoint, an evaluation, the end)."""
        return self.updater.wait_host()

    def close(self) -> None:
        self.updater.close()

    # --- checkpoints: ranks hold equal copies, rank 0 writes them ---------------------------
    def save(self, staged: Path) -> None:
        self.sync()
        if self.topo.is_first:
            ckpt.write_file(staged, "model.pt", self.model.state_dict())
            ckpt.write_file(staged, "optimizer.pt", self.updater.state_dict())

    def load(self, source: Path, manifest: dict) -> None:
        ckpt.check_strategy(source, manifest, self.name)
        self.sync()
        self.model.load_state_dict(ckpt.load_file(source, "model.pt"))
        self.updater.load_state_dict(ckpt.load_file(source, "optimizer.pt"))


def params_by_layer(model, only=None) -> dict[int, list]:
    """Each layer's parameters (a parameter shared by layers belongs to the first), optionally only
    those in `only` (a set of ids: the parameters this rank updates)."""
    seen, out = set(), {}
    for index, layer in enumerate(model.layers):
        mine = []
        for p in layer.parameters():
            if id(p) not in seen and (only is None or id(p) in only):
                seen.add(id(p))
                mine.append(p)
        out[index] = mine
    return out
