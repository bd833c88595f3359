"""The CUDA paths on a real GPU: swap copies on side streams booked by event (stream_swap.py) and the
device clock (engine/training/timing.py). Skipped where torch sees no GPU (CI, this project's CPU machines); on
a GPU machine run `python -m pytest tests/test_on_cuda.py`. tests/test_stream_swap.py and
tests/test_timing.py prove the same logic on the CPU with stand-ins."""

from __future__ import annotations

import pytest
import torch

from engine.config import MemoryConfig
from engine.training.data import batch_for
from engine.models import build_model
from engine.runtime.devices import CudaDevice
from engine.training.loss import cross_entropy
from engine.techniques.memory import ActivationPolicy, StreamSwapper
from engine.training.timing import Clock
from test_memory import ZOO, setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_step(zoo: str, policy, capacity: int = 1 << 34) -> dict:
    cfg, data = setup(zoo)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.meta, 0).cuda()
    device = CudaDevice(capacity, 0)
    device.ledger.track_module(model)
    policies = ActivationPolicy(model, device, MemoryConfig(policy=policy, host_link_gbps=20.0))
    x, y = (t.cuda() for t in batch_for(data, 0, cfg.data.batch_size, 0))
    torch.manual_seed(3)
    with device.ledger.saved_activations():
        cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    if policies.swapper is not None:
        policies.swapper.reap()
    out = {"grads": {n: p.grad.detach().cpu() for n, p in model.named_parameters()},
           "end": dict(device.ledger.bytes), "swapper": policies.swapper, "link": policies.link}
    policies.close()
    return out


@pytest.fixture
def deterministic():
    """cuDNN picks a convolution's backward by speed, and some of its algorithms sum in a varying order: two
    runs of keep differ in the last bits. The comparisons below are exact, so they run with the
    deterministic ones."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic = False


@pytest.mark.parametrize("zoo", sorted(ZOO))
def test_swap_on_side_streams_computes_the_gradients_of_keep(zoo, deterministic):
    keep = cuda_step(zoo, "keep")
    again = cuda_step(zoo, "keep")
    for name, g in keep["grads"].items():   # the reference holds still, or no comparison means anything
        assert torch.equal(again["grads"][name], g), f"keep twice: {name} differs by {(again['grads'][name] - g).abs().max()}"
    got = cuda_step(zoo, "swap")
    assert isinstance(got["swapper"], StreamSwapper)
    for name, g in keep["grads"].items():
        assert torch.equal(got["grads"][name], g), f"{name} differs by {(got['grads'][name] - g).abs().max()}"
    assert got["end"]["activations"] == 0 and got["end"]["swapped"] == 0
    swapper, pool = got["swapper"], got["link"].pool
    assert not swapper._outbound and not swapper._settling
    assert sum(len(v) for v in pool._free.values()) == pool.made and pool.pinned


@pytest.mark.parametrize("zoo", sorted(ZOO))
def test_recompute_on_a_gpu_computes_the_gradients_of_keep(zoo, deterministic):
    """Dropout included: the recomputed forward draws the GPU's own random numbers again."""
    keep = cuda_step(zoo, "keep")
    got = cuda_step(zoo, "recompute")
    for name, g in keep["grads"].items():
        assert torch.equal(got["grads"][name], g), f"{name} differs by {(got['grads'][name] - g).abs().max()}"
    assert got["end"]["activations"] == 0


def test_the_device_clock_times_the_kernels_not_their_launch():
    clock = Clock(torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = clock.mark()
    for _ in range(20):
        a = a @ a / 64
    t1 = clock.mark()
    clock.settle()
    assert clock.on_device and clock.ms(t0, t1) > 0


def test_the_memory_benchs_allocator_peak_is_each_variants_own():
    """`bench memory` keeps every variant's model on the one GPU; a variant's allocator peak leaves the others'
    bytes out, so it is the same with a much larger neighbour resident as alone."""
    from engine.bench.memory import _Trainer
    from engine.config import load_config
    from engine.training.data import load_dataset
    cfg = load_config(None, ["model.name=transformer", "data.name=text", "data.seq_len=64", "data.text_chars=20000",
                             "model.d_model=64", "model.depth=2", "model.heads=4"])
    data = load_dataset(cfg.data, 0)
    alone = _Trainer("keep", data, cfg.model, 1 << 40, 0.0, 8, "cuda")
    for _ in range(3):
        alone.step(timed=True)
    peak = alone.allocator_peak
    big = load_config(None, ["model.name=transformer", "data.name=text", "data.seq_len=64", "data.text_chars=20000",
                             "model.d_model=512", "model.depth=4", "model.heads=4"])
    neighbour = _Trainer("keep", data, big.model, 1 << 40, 0.0, 8, "cuda")
    for _ in range(2):
        neighbour.step(timed=True)
    alone.allocator_peak = 0
    for _ in range(3):
        alone.step(timed=True)
    assert neighbour.allocator_peak > 4 * peak
    assert peak <= alone.allocator_peak <= peak * 1.05
    assert alone.allocator_peak >= alone.device.ledger.bytes["parameters"]
    alone.close()
    neighbour.close()
