"""Tokens from disk (`[data] name = "tokens"`): a flat file of ids, memory-mapped by every worker, cut into
samples deterministically; a run on it, an exact resume, and bad files refused by name before any worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import ConfigError, DataConfig, config_from_dict
from engine.training.data import TokenWindows, batch_for, load_dataset
from engine.runtime.checkpoint import list_checkpoints
from tests.conftest import read_jsonl

SEQ = 16


def write_tokens(path, n: int, vocab: int = 50, dtype=np.uint16, seed: int = 0):
    """A token stream that can be learned: each id mostly follows from the one before."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, vocab)
    ids = [int(rng.integers(0, vocab))]
    for _ in range(n - 1):
        ids.append(int(table[ids[-1]]) if rng.random() > 0.2 else int(rng.integers(0, vocab)))
    np.asarray(ids, dtype=dtype).tofile(path)
    return np.asarray(ids)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_samples_are_windows_of_the_file_and_targets_the_next_ids(tmp_path, dtype):
    ids = write_tokens(tmp_path / "t.bin", 1000, dtype=np.dtype(dtype))
    cfg = DataConfig(name="tokens", train=str(tmp_path / "t.bin"), dtype=dtype, seq_len=SEQ)
    ds = load_dataset(cfg, seed=0)
    assert ds.n_train == (1000 - 1) // SEQ and ds.meta == {"vocab_size": int(ids.max()) + 1, "seq_len": SEQ}
    x, y = ds.x_train[torch.tensor([0, 5])], ds.y_train[torch.tensor([0, 5])]
    assert x.dtype == torch.int64 and x.shape == (2, SEQ)
    assert x[1].tolist() == ids[5 * SEQ:6 * SEQ].tolist() and y[1].tolist() == ids[5 * SEQ + 1:6 * SEQ + 1].tolist()
    # the same global batch wherever it is read, and a rank's share is its slice of it
    whole = batch_for(ds, 7, 8, seed=3)
    halves = [batch_for(ds, 7, 8, seed=3, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole[0])
    assert torch.equal(torch.cat([h[1] for h in halves]), whole[1])
    assert isinstance(ds.x_train, TokenWindows) and len(ds.x_test) == 0   # no val file: no test split


def test_a_worker_maps_the_file_and_holds_no_copy(tmp_path):
    import pickle
    write_tokens(tmp_path / "t.bin", 5000)
    windows = TokenWindows(str(tmp_path / "t.bin"), "uint16", SEQ, 1)
    assert len(pickle.dumps(windows)) < 500   # the path travels, not the ids
    assert isinstance(windows.ids, np.memmap)


@pytest.mark.parametrize("data, problem", [
    ({"train": "missing.bin"}, 'data.train = "missing.bin": no such file'),
    ({"train": "t.bin", "val": "nope.bin"}, 'data.val = "nope.bin": no such file'),
    ({"train": "odd.bin"}, 'data.train = "odd.bin": 3 bytes is not a whole number of uint16 ids'),
    ({"train": "t.bin", "dtype": "int64"}, 'data.dtype = "int64": must be one of "uint16", "uint32"'),
    ({"train": "tiny.bin", "seq_len": 16}, 'data.train = "tiny.bin": holds 10 tokens, fewer than one sample'),
    ({}, 'data.name = "tokens": requires data.train'),
])
def test_a_bad_token_file_is_refused_by_name(tmp_path, monkeypatch, data, problem):
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "t.bin", 100)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    write_tokens(tmp_path / "tiny.bin", 10)
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"model": {"name": "transformer"}, "data": {"name": "tokens", **data}})


def test_token_data_needs_a_language_model():
    with pytest.raises(ConfigError, match='data.name = "tokens": requires model.name = "transformer" or "hf"'):
        config_from_dict({"data": {"name": "tokens", "train": "x.bin"}})


@pytest.mark.slow
def test_a_run_on_a_token_file_learns_and_resumes_exactly(cli, tmp_path):
    ids = write_tokens(tmp_path / "all.bin", 44_000)   # one stream, one rule: the val file is its tail
    ids[:40_000].astype(np.uint16).tofile(tmp_path / "train.bin")
    ids[40_000:].astype(np.uint16).tofile(tmp_path / "val.bin")
    common = ["--set", "model.name=transformer", "--set", "model.depth=2", "--set", "model.d_model=32",
              "--set", "data.name=tokens", "--set", f"data.train={tmp_path / 'train.bin'}",
              "--set", f"data.val={tmp_path / 'val.bin'}", "--set", f"data.seq_len={SEQ}",
              "--set", "data.batch_size=32", "--set", "optim.name=adamw", "--set", "optim.lr=0.01",
              "--set", "checkpoint.every=10", "--set", "parallel.world_size=2", "--set", "device.memory=1GiB"]
    straight = tmp_path / "straight.jsonl"
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--steps", "30", *cli.base_args("straight"),
                *common, "--telemetry-log", str(straight), timeout=120)
    assert r.returncode == 0, r.stderr
    at_10 = next(c for c in list_checkpoints(tmp_path / "runs" / "straight") if c.name.endswith("10"))
    split = tmp_path / "split.jsonl"
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--steps", "30", *cli.base_args("split"),
                *common, "--telemetry-log", str(split), "--resume", str(at_10), timeout=120)
    assert r.returncode == 0, r.stderr

    def losses(path):
        return {rec["step"]: rec["loss"] for rec in read_jsonl(path) if rec["type"] == "step"}
    want, got = losses(straight), losses(split)
    assert [got[s] for s in range(11, 31)] == [want[s] for s in range(11, 31)]   # exact: batches are (step, seed)'s
    assert want[30] < want[1] - 1.0   # it learns: the ids mostly follow from the one before
    summary = next(rec for rec in read_jsonl(straight) if rec["type"] == "summary")
    assert summary["test_accuracy"] > 0.3


def test_a_model_given_to_train_fits_any_data_and_a_config_file_cannot_claim_one(cli, tmp_path):
    write_tokens(tmp_path / "t.bin", 100)
    cfg = config_from_dict({"model": {"name": "user"}, "data": {"name": "tokens", "train": str(tmp_path / "t.bin")}})
    assert cfg.model.name == "user"   # what engine.train sets for the model it is given
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--set", "model.name=user", timeout=30)
    assert r.returncode == 2 and 'model.name = "user": names the model given to engine.train' in r.stderr
