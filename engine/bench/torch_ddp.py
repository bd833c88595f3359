"""torch's DistributedDataParallel exactly as users run it (default buckets, one optimizer stepping after
backward): `bench broadcast`'s baseline, timed as the strategies time theirs.

Imports engine.training.optim and engine.training.timing (late).
"""

from __future__ import annotations


class TorchDDP:
    """The baseline exactly as users run it: DistributedDataParallel (default buckets) and one optimizer
    stepping after backward (trainyard's own ddp strategy steps each layer inline instead)."""

    def __init__(self, model, optim_cfg, topo, device):
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel

        from engine.training.optim import make_optimizer
        from engine.training.timing import Clock, StepTimes
        self.net = DistributedDataParallel(model, process_group=topo.compute)
        self.optimizer = make_optimizer(optim_cfg, model.parameters())
        self.device, self.loss = device, F.cross_entropy
        self.times = StepTimes(Clock(device.torch_device), ("fwd_ms", "bwd_ms", "optim_ms"))
        self.timings: dict = {}

    def saving(self):
        """What counts the forward's saved activations: the ledger's hooks, which the strategies pay too."""
        return self.device.ledger.saved_activations()

    def train_step(self, x, y) -> float:
        """As the strategies time theirs: on the device's clock, read after the loss (which waits for the step)."""
        self.optimizer.zero_grad(set_to_none=True)
        times = self.times
        t0 = times.mark()
        with self.saving():
            loss = self.loss(self.net(x), y)
            t1 = times.mark()
            loss.backward()
        t2 = times.mark()
        self.optimizer.step()
        for name, a, b in (("fwd_ms", t0, t1), ("bwd_ms", t1, t2), ("optim_ms", t2, times.mark())):
            times.add(name, a, b)
        value = loss.item()
        self.timings = times.end_step()
        return value

    def sync(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
