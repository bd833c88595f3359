"""torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) as a PyTorch user applies it: `bench broadcast`'s peer of
the sharded variants, timed as the strategies time theirs.

    runner = TorchFSDP(model, optim_cfg, topo, device, reshard_after_forward=True, bf16=False)
    loss = runner.train_step(x, y)
    link_bytes(parameter_bytes, reduce_bytes, reshard_after_forward)   # what one step sends, per rank

Each layer with parameters is wrapped, then the root, as torchtitan does; one optimizer over the sharded
parameters steps after backward. bf16: FSDP2's mixed precision (bf16 working parameters gathered, gradients
reduced in fp32, fp32 sharded parameters stepped), the peer of the sharded variants' bf16 working weights and
fp32 masters.

Imports engine.bench.torch_ddp (its step), engine.training.optim and engine.training.timing (late).
"""

from __future__ import annotations

from engine.bench.torch_ddp import TorchDDP


class TorchFSDP(TorchDDP):
    """FSDP2 over the pool's compute group: per-layer fully_shard, then the root; one optimizer after backward,
    timed as TorchDDP times its step."""

    def __init__(self, model, optim_cfg, topo, device, reshard_after_forward: bool, bf16: bool = False):
        import torch
        import torch.nn.functional as F
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from engine.training.optim import make_optimizer
        from engine.training.timing import Clock, StepTimes
        mesh = DeviceMesh.from_group(topo.compute, device_type=device.torch_device.type)
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
        for layer in model.layers:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        self.net = fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        # foreach: torch has no fused kernel's sharding rule for DTensor parameters (aten._fused_sgd_)
        self.optimizer = make_optimizer(optim_cfg, model.parameters(), kernel="foreach")
        self.device, self.loss = device, F.cross_entropy
        self.times = StepTimes(Clock(device.torch_device), ("fwd_ms", "bwd_ms", "optim_ms"))
        self.timings: dict = {}

    def saving(self):
        """None: the ledger's saved-tensor hooks read every parameter's storage, which a sharded DTensor
        parameter has none of here (so FSDP2's rows run without the cost the others pay: in its favour)."""
        from contextlib import nullcontext
        return nullcontext()


def gathers(reshard_after_forward: bool) -> int:
    """How many times a step all-gathers every parameter: in forward, and again in backward when forward
    freed the gathered copy."""
    return 2 if reshard_after_forward else 1


def link_bytes(parameter_bytes: int, reduce_bytes: int, reshard_after_forward: bool) -> int:
    """What one step moves through a rank, counted as DDP's all-reduce is (every gradient byte once): each
    all-gather brings the whole working parameters, and the reduce-scatter of the gradients moves an
    all-reduce's bytes on gloo, whose reduce-scatter is an all-reduce (on NCCL it would move half)."""
    return gathers(reshard_after_forward) * parameter_bytes + reduce_bytes
