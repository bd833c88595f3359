"""Optimizers from `[optim]`: SGD with momentum, AdamW; fused kernels where torch has them; the learning rate of
each step.

    opt = make_optimizer(cfg.optim, params)     # kernel "auto": fused, else foreach
    step(opt)                                   # opt.step(); a fused AdamW or SGD: its kernel, no wrapper
    lr = lr_at(cfg.optim, step, cfg.run.steps)  # the schedule: a pure function of the step

A fused step is one kernel over all of a layer's tensors: on an H100's host, AdamW over 100M fp32
parameters took 110 ms fused against 716 ms with foreach (single thread). Host updates
(engine/techniques/updates/updater.py) run far beside backward only at that speed. The device side uses the same
kernel, so an update gives the same values wherever it runs.
"""

from __future__ import annotations

import math

import torch

from engine.config import OptimConfig

_CLASSES = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def make_optimizer(cfg: OptimConfig, params, kernel: str | None = None) -> torch.optim.Optimizer:
    """`kernel` overrides `cfg.kernel` (benchmarks compare them)."""
    if cfg.name not in _CLASSES:
        raise ValueError(f"optim.name = {cfg.name!r}: must be one of 'sgd', 'adamw'")
    kernel = kernel or cfg.kernel
    params = list(params)
    if cfg.name == "sgd":
        settings = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        settings = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    cls = _CLASSES[cfg.name]
    if kernel in ("auto", "fused"):
        try:
            return cls(params, fused=True, **settings)
        except (RuntimeError, ValueError) as e:   # this torch has no fused kernel for these tensors
            if kernel == "fused":
                raise ValueError(f"optim.kernel = \"fused\": torch {torch.__version__} has no fused {cfg.name} "
                                 f"for these parameters ({e}); use \"auto\" or \"foreach\"") from None
    return cls(params, foreach=True, **settings)


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """The learning rate of step `step` (from 0) of a run of `total_steps`: `warmup_steps` of linear warmup
    (step s: lr x (s + 1) / warmup), then `lr_schedule` from `lr` at the first step after the warmup down to
    `min_lr` at the run's last step (`constant`: `lr` throughout). The same number on every rank and after a
    resume, as it depends on nothing else."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
    if cfg.lr_schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - progress)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _fused_adamw_groups(optimizer: torch.optim.Optimizer) -> list | None:
    """A fused AdamW's (group, params, states) to step, as AdamW's own step would, or None where this path
    does not cover it (hooks, a state not made yet, an option the kernel call below leaves out): then
    `optimizer.step()` must run."""
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group["amsgrad"] or group["maximize"] or group["capturable"] \
                or group["differentiable"] or any(torch.is_tensor(v) for v in (group["lr"], *group["betas"])):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state.get(p) for p in params]
        if not all(states) or not _one_kind(params):
            return None   # its first step makes the state
        calls.append((group, params, states))
    return calls


def _fused_adamw(group: dict, params: list, states: list) -> None:
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=group["lr"],
                        beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                        maximize=False, grad_scale=None, found_inf=None)


def _fused_sgd_groups(optimizer: torch.optim.Optimizer) -> list | None:
    """A fused SGD's (group, params, momentum buffers) to step, as SGD's own step would after its first (which
    checks the tensors' device and makes the buffers), or None where this path does not cover it."""
    if getattr(optimizer, "_need_device_dtype_check_for_fused", True):
        return None
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group["maximize"] or group["differentiable"] or torch.is_tensor(group["lr"]):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        buffers = []
        if group["momentum"] != 0:
            buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
            if any(b is None for b in buffers):
                return None   # its first step with momentum makes the buffers
        if not _one_kind(params):
            return None
        calls.append((group, params, buffers))
    return calls


def _fused_sgd(group: dict, params: list, buffers: list) -> None:
    torch._fused_sgd_(params, [p.grad for p in params], buffers, weight_decay=group["weight_decay"],
                      momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                      nesterov=group["nesterov"], maximize=False, is_first_step=False, grad_scale=None,
                      found_inf=None)


def _one_kind(params: list) -> bool:
    """One device and dtype, dense and real: what one kernel launch takes."""
    return len({(p.device, p.dtype) for p in params}) == 1 and not any(p.grad.is_sparse or p.is_complex()
                                                                       for p in params)


# the fused optimizers a launch of several covers: their groups' calls, the launch, what one launch must share
_FUSED = {torch.optim.AdamW: (_fused_adamw_groups, _fused_adamw, ("lr", "betas", "weight_decay", "eps")),
          torch.optim.SGD: (_fused_sgd_groups, _fused_sgd,
                            ("lr", "momentum", "weight_decay", "dampening", "nesterov"))}


def step_together(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """Step several fused AdamWs or SGDs (a layer's each) whose groups agree on what one launch must share and
    whose parameters share a device and dtype with one multi-tensor launch: the kernel works tensor by tensor,
    so the values are each optimizer's own step's, bit for bit (tests/test_training.py), with one launch and one
    Python call in place of one per layer. Returns those it did not step (the caller steps each)."""
    taken, left = {}, []
    for optimizer in optimizers:
        kind = _FUSED.get(type(optimizer))
        calls = None
        if kind is not None and not (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks):
            calls = kind[0](optimizer)
        if calls is None:
            left.append(optimizer)
            continue
        for group, params, states in calls:
            key = (type(optimizer), tuple(group[k] for k in kind[2]), params[0].device, params[0].dtype)
            mine = taken.setdefault(key, (kind[1], group, [], []))
            mine[2].extend(params)
            mine[3].extend(states)
    for launch, group, params, states in taken.values():
        launch(group, params, states)
    return left


def step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`. A fused AdamW or SGD whose state is made (every step after its first) calls its kernel
    itself, as its own step does (torch/optim/adam.py `_fused_adam`: the steps counted, then `torch._fused_adamw_`
    over the parameters that have a gradient; torch/optim/sgd.py `_fused_sgd`), without the wrapper around it
    (hooks, the profiler's record, grouping by device and dtype): about 45 us less a call on the CPU, once per
    layer per step. The values are the optimizer's own, bit for bit (tests/test_training.py); any other
    optimizer, or a state or group this path does not cover, goes through `optimizer.step()`."""
    if step_together([optimizer]):   # not a fused AdamW or SGD this path covers
        optimizer.step()
