"""Unit tests of data sets, stateless global batches and per-rank shards.

    /tmp/v/bin/python -m pytest tests/test_data.py -q
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import DataConfig
from engine.training.data import (batch_for, global_batch_indices, load_dataset, rank_slice,
                         tensor_dataset, text_corpus)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- batches and shards

def test_global_batch_is_deterministic_and_stateless():
    a = global_batch_indices(100, 10, step=37, seed=3)
    b = global_batch_indices(100, 10, step=37, seed=3)
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (10,)
    assert not torch.equal(a, global_batch_indices(100, 10, step=37, seed=4))


def test_each_epoch_covers_samples_without_repetition():
    n, batch = 103, 10  # 10 steps per epoch, 3 samples dropped each epoch
    epochs = []
    for epoch in range(3):
        idx = torch.cat([global_batch_indices(n, batch, epoch * 10 + s, seed=0) for s in range(10)])
        assert len(set(idx.tolist())) == 100 and 0 <= idx.min() and idx.max() < n
        epochs.append(idx)
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])


@settings(max_examples=60, deadline=None, database=None)  # no .hypothesis/ folder
@given(per_rank=st.integers(1, 8), world_size=st.integers(1, 8), step=st.integers(0, 1000),
       seed=st.integers(0, 2**31))
def test_rank_slices_partition_the_global_batch(per_rank, world_size, step, seed):
    batch = per_rank * world_size
    idx = global_batch_indices(200, batch, step, seed)
    parts = [rank_slice(idx, r, world_size) for r in range(world_size)]
    assert all(len(p) == per_rank for p in parts)
    assert torch.equal(torch.cat(parts), idx)


def test_batch_for_shards_match_global_batch():
    ds = load_dataset(DataConfig(name="digits"), seed=0)
    x, y = batch_for(ds, step=5, batch_size=8, seed=1)
    shards = [batch_for(ds, 5, 8, 1, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)


def test_batch_and_world_size_errors():
    with pytest.raises(ValueError, match=r"batch_size 20.*10 training samples"):
        global_batch_indices(10, 20, step=0, seed=0)
    with pytest.raises(ValueError, match=r"10 samples.*world_size 3"):
        rank_slice(torch.arange(10), 0, 3)
    with pytest.raises(ValueError, match="rank 3"):
        rank_slice(torch.arange(9), 3, 3)


# ---------------------------------------------------------------- data sets

def test_digits_shapes_and_ranges():
    ds = load_dataset(DataConfig(name="digits", test_fraction=0.2), seed=0)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.x_train.shape[1] == 64 and ds.n_train + len(ds.x_test) == 1797
    assert len(ds.x_test) == round(1797 * 0.2)
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    assert set(ds.y_train.tolist()) == set(range(10))
    assert ds.meta == {"input_dim": 64, "num_classes": 10, "image_shape": (1, 8, 8)}
    other = load_dataset(DataConfig(name="digits"), seed=1)
    assert not torch.equal(ds.y_test, other.y_test)  # the split follows the seed


def corpus_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_text_corpus_identical_across_builds_and_processes():
    text = text_corpus(20_000)
    assert len(text) == 20_000
    text_corpus.cache_clear()
    assert text_corpus(20_000) == text
    code = "from engine.training.data import text_corpus; import hashlib; " \
           "print(hashlib.sha256(text_corpus(20000).encode()).hexdigest())"
    # PYTHONHASHSEED differs per process: set iteration would show up here
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == corpus_hash(text)


def test_text_samples_and_vocab():
    cfg = DataConfig(name="text", seq_len=16, text_chars=10_000)
    ds = load_dataset(cfg, seed=0)
    itos = ds.meta["itos"]
    assert ds.meta["vocab_size"] == len(itos) and ds.meta["seq_len"] == 16
    assert list(itos) == sorted(set(text_corpus(10_000)))
    assert ds.x_train.shape[1] == 16 and ds.x_train.dtype == torch.int64
    assert ds.n_train + len(ds.x_test) == 10_000 // 17
    assert int(ds.x_train.max()) < len(itos)
    # y is x shifted by one character
    assert torch.equal(ds.x_train[:, 1:], ds.y_train[:, :-1])
    sample = "".join(itos[i] for i in ds.x_train[0].tolist())
    assert sample in text_corpus(10_000)
    assert load_dataset(cfg, seed=0) is ds  # memoised


def test_text_too_few_samples():
    with pytest.raises(ValueError, match="too few"):
        load_dataset(DataConfig(name="text", seq_len=4096, text_chars=5000), seed=0)


def test_synthetic_is_seeded_and_learnable():
    cfg = DataConfig(name="synthetic", samples=400, features=16, classes=4)
    ds = load_dataset(cfg, seed=0)
    assert ds.x_train.shape == (320, 16) and ds.y_train.shape == (320,)
    assert ds.meta == {"input_dim": 16, "num_classes": 4, "image_shape": (1, 4, 4)}
    assert "image_shape" not in load_dataset(DataConfig(name="synthetic", features=10), 0).meta
    again = load_dataset(DataConfig(name="synthetic", samples=400, features=16, classes=4, batch_size=7), 0)
    assert torch.equal(again.x_train, ds.x_train)
    # labels come from a linear teacher: least squares on one-hot targets nearly recovers them
    onehot = torch.nn.functional.one_hot(ds.y_train, 4).float()
    w = torch.linalg.lstsq(ds.x_train, onehot).solution
    assert ((ds.x_test @ w).argmax(1) == ds.y_test).float().mean() > 0.7


def test_tensor_dataset_infers_meta():
    ds = tensor_dataset(torch.randn(10, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3]))
    assert ds.meta == {"input_dim": 5, "num_classes": 4, "ignored_labels": False} and ds.n_train == 10
    masked = tensor_dataset(torch.randn(3, 5), torch.tensor([0, -100, 1]))
    assert masked.meta["num_classes"] == 2 and masked.meta["ignored_labels"]   # -100: not a class, not counted
    assert len(ds.x_test) == 0 and ds.name == "custom"
    images = tensor_dataset(torch.randn(4, 3, 2, 2), torch.zeros(4, dtype=torch.int64))
    assert images.meta["image_shape"] == (3, 2, 2)
    with pytest.raises(ValueError, match="10 samples but y_train has 3"):
        tensor_dataset(torch.randn(10, 5), torch.zeros(3, dtype=torch.int64))
