"""What a step achieves: tokens per second, and the fraction of the device's peak it reaches (MFU).

    tokens = tokens_per_sample(x)                      # token ids (batch, seq): seq; anything else: None
    out, flops, why = counted_flops(lambda: train_step(x, y))   # the step's matmul/attention FLOPs, counted once
                                                                # (None, and why, where torch's formulas fail)
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


def _heads_as_query(query_shape, *shapes):
    """Grouped-query attention (fewer key/value heads than query heads, SDPA's `enable_gqa`): the shapes with the
    key/value heads broadcast to the query's, as the kernel computes them."""
    heads = query_shape[1]
    return [(s[0], heads, *s[2:]) for s in shapes]


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, *_heads_as_query(query_shape, key_shape, value_shape))


def _sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out_shape, query_shape,
                                    *_heads_as_query(query_shape, key_shape, value_shape))


def _attention_formulas() -> dict:
    """torch's SDPA formulas, for grouped-query attention too: before torch 2.13 they refused a key with fewer
    heads than the query (every Llama 2 70B, Llama 3, Mistral, Qwen or TinyLlama on a GPU)."""
    aten = torch.ops.aten
    forward = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention")
    return {**{getattr(aten, name): _sdpa_flops for name in forward if hasattr(aten, name)},
            **{getattr(aten, f"{name}_backward"): _sdpa_backward_flops for name in forward
               if hasattr(aten, f"{name}_backward")}}


def counted_flops(run):
    """(what `run()` returns, the FLOPs it ran, None) counted by torch's FlopCounterMode; compiled code is counted
    too, without a recompile. An operator whose formula fails on its shapes is not allowed to fail the step: its
    FLOPs are then unknown, and the third item names it (the count is None: an MFU without it would be low)."""
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False, custom_mapping=_attention_formulas())
    failed: list[str] = []

    def guarded(packet, formula):
        def count(*args, **kwargs):
            try:
                return formula(*args, **kwargs)
            except Exception as e:   # torch's formula on shapes it did not foresee: the step goes on
                failed.append(f"{packet}: {type(e).__name__}: {e}")
                return 0
        return count

    counter.flop_registry = {packet: guarded(packet, formula) for packet, formula in counter.flop_registry.items()}
    with counter:
        out = run()
    if failed:
        return out, None, f"FLOPs not counted ({failed[0]}); no MFU is reported"
    return out, int(counter.get_total_flops()), None
