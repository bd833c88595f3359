"""What a step achieves (engine/training/throughput.py, engine/run/report.py Throughput): the FLOPs torch counts
for a step, the device's peak by name or as stated, tokens where samples are sequences."""

from __future__ import annotations

import pytest
import torch

from engine.run.report import Throughput
from engine.runtime.control import COLUMN, FIELDS
from engine.training.throughput import counted_flops, device_peak_flops, tokens_per_sample


def test_a_step_of_a_linear_layer_counts_its_forward_and_both_backward_matmuls():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)   # a layer after the first: its input's gradient is computed
    _, flops, why = counted_flops(lambda: layer(x).sum().backward())
    assert flops == 3 * 2 * 8 * 64 * 32 and why is None   # forward, the input's and the weight's gradient


def _strict_sdpa_flop_count(query_shape, key_shape, value_shape):
    """torch 2.11's formula (what an H200 ran): as many key/value heads as query heads, or an AssertionError."""
    if query_shape[1] != key_shape[1]:
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    b, h, s_q, d = query_shape
    return 2 * 2 * b * h * s_q * key_shape[2] * d


@pytest.mark.parametrize("op", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"])
def test_grouped_query_attention_is_counted_as_its_query_heads_by_torch_versions_that_refused_it(monkeypatch, op):
    # an H200 with torch 2.11: a GQA model's (TinyLlama, Llama 3) first step failed in the count; on meta tensors
    monkeypatch.setattr(torch.utils.flop_counter, "sdpa_flop_count", _strict_sdpa_flop_count)
    q = torch.empty(2, 8, 16, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 16, 32, device="meta", dtype=torch.bfloat16)
    call = getattr(torch.ops.aten, op)
    _, flops, why = counted_flops(lambda: call(q, kv, kv) if "flash" in op else call(q, kv, kv, None, False))
    assert why is None and flops == 2 * 2 * 2 * 8 * 16 * 16 * 32   # QK^T and PV, over the query's 8 heads


def test_an_operator_torch_cannot_count_leaves_the_step_done_and_its_flops_unknown(monkeypatch):
    from torch.utils import flop_counter

    def refuses(*args, **kwargs):
        raise AssertionError("shapes unforeseen")
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, refuses)
    layer = torch.nn.Linear(64, 32, bias=False)
    out, flops, why = counted_flops(lambda: layer(torch.randn(8, 64)).sum().backward() or "stepped")
    assert out == "stepped" and layer.weight.grad is not None
    assert flops is None and "aten.mm" in why and "shapes unforeseen" in why and "no MFU" in why


def test_the_peak_comes_from_a_stated_figure_the_datasheet_table_or_nowhere():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == (989.4e12, "datasheet: H100, dense bf16")
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16")[0] == 756e12   # the part a name says, before its family
    assert device_peak_flops("NVIDIA L40S", "fp32")[0] == pytest.approx(91.6e12)
    assert device_peak_flops("NVIDIA H200", "bf16", stated_tflops=500)[0] == 500e12
    peak, why = device_peak_flops("cpu", "fp32")
    assert peak is None and "device.peak_tflops" in why


def test_tokens_are_counted_only_where_samples_are_token_ids():
    assert tokens_per_sample(torch.zeros(4, 128, dtype=torch.long)) == 128
    assert tokens_per_sample(torch.zeros(4, 64)) is None               # features
    assert tokens_per_sample(torch.zeros(4, 1, 8, 8)) is None          # images


def test_a_step_record_says_tokens_a_second_and_mfu_once_every_rank_has_counted():
    def table(*flops):   # the boundary's table, every rank's counted FLOPs in its column
        rows = torch.zeros(len(flops), len(FIELDS), dtype=torch.float64)
        rows[:, COLUMN["flops"]] = torch.tensor(flops, dtype=torch.float64)
        return rows
    t = Throughput(tokens_per_step=1000, peak_flops=1e9, devices=2)
    assert t.fields(0.5, table(0.0, 4e8)) == {"tokens_per_s": 2000.0}   # a rank has not counted yet
    assert t.fields(0.5, table(4e8, 4e8)) == {"tokens_per_s": 2000.0, "mfu": 0.8}
    assert t.fields(1.0, table(4e8, 4e8)) == {"tokens_per_s": 1000.0, "mfu": 0.4}
    assert t.summary() == {"tokens_per_s": 1500.0, "mfu": 0.6}   # the steps after the first: their median
    assert Throughput().fields(0.5, table(1.0)) == {}     # not sequences, no peak: nothing to say


def test_the_summary_holds_the_latest_steps_only():
    """A day of steps: the summary's figures are the median of the latest SUMMARY_STEPS, in bounded memory."""
    from engine.run.report import SUMMARY_STEPS
    t = Throughput(tokens_per_step=1000)
    rows = torch.zeros(1, len(FIELDS), dtype=torch.float64)
    for wall_s in [1.0] * (SUMMARY_STEPS + 5) + [0.5] * (SUMMARY_STEPS // 2 + 1):
        t.fields(wall_s, rows)
    assert len(t.seen["tokens_per_s"]) == SUMMARY_STEPS and t.summary() == {"tokens_per_s": 2000.0}
