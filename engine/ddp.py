"""Baseline data parallel: torch DistributedDataParallel, the reference every technique is measured against.

    strategy = DDPStrategy(model, optimizer, topo, device)
    loss = strategy.train_step(x, y)      # forward, backward (all-reduce inside), optimizer step

Each rank runs its slice of the global batch; DDP averages gradients, so a step
equals a single-process step on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from engine.devices import LedgerDevice
from engine.topology import Topology


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Classification (B, C) and next-token (B, T, V) losses alike."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DDPStrategy:
    name = "ddp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
                 device: LedgerDevice, loss_fn=cross_entropy):
        self.model, self.optimizer, self.device, self.loss_fn = model, optimizer, device, loss_fn
        ids = [device.torch_device.index] if device.kind == "cuda" else None
        # DDP broadcasts rank 0's parameters here, so every rank starts from the same weights.
        self.ddp = DistributedDataParallel(model, device_ids=ids, process_group=topo.compute)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.to(self.device.torch_device), y.to(self.device.torch_device)
        self.optimizer.zero_grad(set_to_none=True)
        with self.device.ledger.saved_activations():
            loss = self.loss_fn(self.ddp(x), y)
            loss.backward()
        self.optimizer.step()
        self.device.ledger.refresh()
        return loss.item()

    def layout(self) -> dict:
        return {"strategy": self.name}
