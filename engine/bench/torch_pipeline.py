"""The torch.distributed.pipelining baseline that `trainyard bench pipeline` runs beside trainyard's
own pipeline (engine/strategies/pipeline/stage.py): the same stages, micro-batches and optimizer, but torch's
PipelineStage and Schedule1F1B / ScheduleGPipe doing the schedule and the messages.

    with DistPool(world=2) as pool:
        results = pool.run(torch_1f1b_job, build="engine.bench.torch_pipeline:mlp",
                           build_kwargs={"hidden": 32, "depth": 3, "input_dim": 64},
                           stage_layers=[["fc0", "act0", "fc1", "act1"], ["fc2", "act2", "head"]],
                           micro_batches=4, batches=[(x, y), ...], optim={"name": "adamw", "lr": 0.01},
                           schedule="1f1b", warmup=2)
        results[r]["step_ms"], results[-1]["losses"], results[r]["state"]

A step here equals a single-process step on the whole global batch: torch calls the loss
function once per micro-batch (cross_entropy, a mean) and, with scale_grads=True (its
default), divides the accumulated gradients by the number of micro-batches at the end of
the step, so gradients are those of the mean over equal micro-batches, i.e. of the whole
batch. The global-batch loss is likewise the mean of the micro-batch losses.

What torch.distributed.pipelining needs on gloo/CPU (torch 2.13), found by running it:
- nothing special. PipelineStage without input_args infers shapes inside the first step: a
  vote (plain send/recv) picks the dynamic mode, then stage by stage an extra forward and an
  input-gradient-only backward of one micro-batch on real CPU tensors, the shapes passed on
  with send_object_list / recv_object_list; no meta tensors, no example inputs. So the first
  step is slower (use warmup >= 1), and shapes are fixed from then on (inferred only once).
- the schedules' p2p works on gloo: isend/irecv alone for one-way batches, batch_isend_irecv
  for 1F1B's steady state (send forward + receive backward in one batch).
- the schedule accumulates into .grad and never zeroes it: zero before every step.

step_ms: each rank's wall time of schedule.step + optimizer.step, measured steps only (no
barrier between steps: a stage starts the next step as soon as it can, as trainyard's does).
losses: every step's global-batch loss (warm-up steps too) on the last stage, None elsewhere.
"""

from __future__ import annotations

import importlib
import time

import torch
from torch import nn


def mlp(hidden: int, depth: int, input_dim: int, num_classes: int = 10, seed: int = 0):
    """A builder for `build`: the built-in MLP, the same weights on every rank."""
    from engine.config import ModelConfig
    from engine.models import build_model
    return build_model(ModelConfig(name="mlp", hidden=hidden, depth=depth),
                       {"input_dim": input_dim, "num_classes": num_classes}, seed=seed)


class _Stage(nn.Module):
    """Layers i..j of a LayerList, applied in order. A ModuleDict keyed by the model index keeps the
    whole model's state_dict keys ("layers.3.weight") without any renaming."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        idx = [model.index(n) for n in names]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ValueError(f"stage layers {names} are not contiguous in model order")
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in idx})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _resolve(build: str):
    module, _, fn = build.partition(":")
    return getattr(importlib.import_module(module), fn)


class TorchPipeline:
    """Stage `topo.rank` of the model under torch's schedule, built once; `step(x, y)` runs one optimizer step
    on a global batch and returns its loss on the last stage (None elsewhere). `trainyard bench pipeline`
    steps one beside trainyard's stages in the same processes."""

    def __init__(self, topo, build: str, build_kwargs: dict, stage_layers: list[list[str]], micro_batches: int,
                 optim: dict, schedule: str = "1f1b"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from engine.config import OptimConfig
        from engine.runtime import compat
        from engine.training.loss import cross_entropy
        from engine.training.optim import make_optimizer

        if len(stage_layers) != topo.world_size:
            raise ValueError(f"{len(stage_layers)} stages for world size {topo.world_size}: one stage per rank")
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule {schedule!r}: must be '1f1b' or 'gpipe'")
        self.module = _Stage(_resolve(build)(**build_kwargs), stage_layers[topo.rank])
        stage = PipelineStage(self.module, stage_index=topo.rank, num_stages=topo.world_size,
                              device=torch.device("cpu"), group=topo.compute)
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        # scale_grads=True (the default): per-micro-batch mean losses, gradients divided by micro_batches
        self.schedule = cls(stage, n_microbatches=micro_batches, loss_fn=cross_entropy, scale_grads=True)
        # torch < 2.10's step has no return_outputs (an unknown keyword would reach the stage's forward)
        self.no_outputs = ({"return_outputs": False} if compat.accepts(self.schedule.step, "return_outputs")
                           else {})
        self.optimizer = make_optimizer(OptimConfig(**optim), list(self.module.parameters()))
        self.micro_batches = micro_batches
        self.first, self.last = topo.rank == 0, topo.rank == topo.world_size - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        if x.shape[0] % self.micro_batches:
            raise ValueError(f"batch of {x.shape[0]} does not split into {self.micro_batches} equal micro-batches")
        self.optimizer.zero_grad(set_to_none=True)
        mb_losses: list = []
        args = (x,) if self.first else ()   # middle and last stages receive their input from the previous stage
        self.schedule.step(*args, target=y if self.last else None, losses=mb_losses if self.last else None,
                           **self.no_outputs)
        self.optimizer.step()
        return torch.stack(mb_losses).mean().item() if self.last else None

    def state(self) -> dict[str, torch.Tensor]:
        return {f"layers.{key}": t.detach().clone() for key, t in self.module.layers.state_dict().items()}


def torch_1f1b_job(topo, build: str, build_kwargs: dict, stage_layers: list[list[str]], micro_batches: int,
                   batches: list[tuple[torch.Tensor, torch.Tensor]], optim: dict, schedule: str = "1f1b",
                   warmup: int = 0) -> dict:
    """On every rank: run stage `topo.rank` of the model under torch's schedule, one optimizer step per batch."""
    pipe = TorchPipeline(topo, build, build_kwargs, stage_layers, micro_batches, optim, schedule)
    step_ms, losses = [], []
    for k, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        ms = (time.perf_counter() - t0) * 1000
        if k >= warmup:
            step_ms.append(ms)
        losses.append(loss)   # every step, warm-up too
    return {"step_ms": step_ms, "losses": losses, "state": pipe.state()}
