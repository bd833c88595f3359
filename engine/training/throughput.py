"""What a step achieves: tokens per second, and the fraction of the device's peak it reaches (MFU).

    tokens = tokens_per_sample(x)                      # token ids (batch, seq): seq; anything else: None
    out, flops = counted_flops(lambda: train_step(x, y))   # the step's matmul/attention FLOPs, counted once
    peak, source = device_peak_flops(name, "bf16", stated_tflops=0.0)   # FLOP/s, and where it came from
    mfu = flops / (step_s * peak)

FLOPs are torch's own count (`torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions, attention, by
their shapes) over one step's forward and backward; the optimizer's elementwise work is not counted, and a
step with a recomputed layer is not counted at all (its rerun forward is no useful work): the caller counts a
step where every layer keeps its activations. The peak is the device's dense figure for the dtype the step
computes in, from its maker's datasheet (PEAK_TFLOPS), or the one `[device] peak_tflops` states; a CPU has none
(its figure depends on its cores and vector units, which a table would guess), so no MFU is reported there
unless it is stated.

Imports nothing of engine.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) tensor-core TFLOP/s in bf16, and fp32 on the CUDA cores (TF32 off, torch's default for
# matmuls), from each maker's datasheet; the SXM part where a name does not say otherwise. Matched in order, as a
# substring of the device's name (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe").
PEAK_TFLOPS: list[tuple[str, float, float | None]] = [
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),
    ("H200", 989.4, 66.9),
    ("GH200", 989.4, 66.9),
    ("B200", 2250.0, None),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L4", 121.0, 30.3),
]


def device_peak_flops(name: str, compute: str, stated_tflops: float = 0.0) -> tuple[float | None, str]:
    """The device's peak FLOP/s for steps computing in `compute` ("bf16" or "fp32"), and where it came from:
    `stated_tflops` where given (a user's `[device] peak_tflops`), else the datasheet table by `name`; (None, why)
    where neither says."""
    if stated_tflops > 0:
        return stated_tflops * 1e12, "stated (device.peak_tflops)"
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key in name:
            tflops = bf16 if compute == "bf16" else fp32
            if tflops is None:
                return None, f"{key}'s {compute} peak is not in the table"
            return tflops * 1e12, f"datasheet: {key}, dense {compute}"
    return None, f"no peak known for {name!r}: set device.peak_tflops"


def tokens_per_sample(x: torch.Tensor) -> int | None:
    """Tokens in one sample of a batch `x`: its sequence length where the samples are token ids (an integer
    tensor of batch x sequence), else None (images, features: samples are not sequences)."""
    if x.dim() == 2 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
        return int(x.shape[1])
    return None


def counted_flops(run):
    """(what `run()` returns, the FLOPs it ran), counted by torch's FlopCounterMode; compiled code is counted
    too, without a recompile."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        out = run()
    return out, int(counter.get_total_flops())
