"""Tokens from disk (`[data] name = "tokens"`): a flat file of ids, memory-mapped by every worker, cut into
samples deterministically; a run on it, an exact resume, and bad files refused by name before any worker:
ids past the model's vocabulary among them, found by a scan kept beside the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import engine
from engine.config import ConfigError, DataConfig, config_from_dict
from engine.models import LayerList
from engine.run.checks import RunSetupError, check_model, check_token_ids
from engine.run.rank import Job
from engine.training import token_scan as scan_module
from engine.training.data import TokenWindows, batch_for, global_batch_indices, load_dataset, rank_slice
from engine.training.token_scan import largest_id, scan_path
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
    # the token file's own path (indices read from the permutation in numpy) takes every step's, every rank's
    # samples of the global batch indices every other data set takes, across epochs (7 steps an epoch)
    for step in (0, 14, 15, 40):
        for rank, world in ((0, 1), (1, 2), (3, 4)):
            idx = rank_slice(global_batch_indices(ds.n_train, 8, step, seed=3), rank, world)
            x, y = batch_for(ds, step, 8, seed=3, rank=rank, world_size=world)
            assert torch.equal(x, ds.x_train[idx]) and torch.equal(y, ds.y_train[idx])
    assert isinstance(ds.x_train, TokenWindows) and len(ds.x_test) == 0   # no val file: no test split
    # batch_for reads a sample's inputs and targets as one window of SEQ + 1 ids: the same ids as two reads
    idx = torch.tensor([3, 0, len(ds.x_train) - 1])
    x, y = ds.x_train.with_targets(ds.y_train, idx)
    assert torch.equal(x, ds.x_train[idx]) and torch.equal(y, ds.y_train[idx])
    assert x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype == torch.int64
    assert ds.x_train.with_targets(ds.x_train, idx) is None   # not its targets: each is read alone
    with pytest.raises(IndexError, match=r"sample index out of range for .*t\.bin \(62 samples\)"):
        ds.x_train.with_targets(ds.y_train, torch.tensor([62]))


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


def test_evaluations_without_a_val_file_are_refused(tmp_path):
    """run.eval_every on a tokens run with no data.val asked for evaluations that would say nothing: refused before
    launch, not an eval event of nulls every N steps."""
    write_tokens(tmp_path / "t.bin", 100)
    data = {"name": "tokens", "train": str(tmp_path / "t.bin")}
    with pytest.raises(ConfigError, match=r"run.eval_every = 50: evaluates on a test split, and this tokens run has "
                                          r"none \(data.val is empty\): set data.val .* or run.eval_every = 0"):
        config_from_dict({"model": {"name": "transformer"}, "data": data, "run": {"eval_every": 50}})
    write_tokens(tmp_path / "v.bin", 100)
    assert config_from_dict({"model": {"name": "transformer"}, "data": {**data, "val": str(tmp_path / "v.bin")},
                             "run": {"eval_every": 50}}).run.eval_every == 50
    assert config_from_dict({"model": {"name": "transformer"}, "data": data}).run.eval_every == 0   # the end's alone


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
              "--set", "checkpoint.every=10", "--set", "parallel.world_size=2", "--set", "device.memory=1GiB",
              "--set", "device.peak_tflops=0.5"]   # a stated peak: mfu on the CPU
    straight = tmp_path / "straight.jsonl"
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--steps", "30", *cli.base_args("straight"),
                *common, "--telemetry-log", str(straight), timeout=120)
    assert r.returncode == 0, r.stderr
    at_10 = next(c for c in list_checkpoints(tmp_path / "runs" / "straight") if c.name.endswith("10"))
    split = tmp_path / "split.jsonl"
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--steps", "30", *cli.base_args("split"),
                *common, "--telemetry-log", str(split), "--resume", str(at_10),
                "--set", "telemetry.trace_steps=12-13", "--set", "checkpoint.at_end=false",
                timeout=120)   # traced: the same values
    assert r.returncode == 0, r.stderr
    # no checkpoint of the end (the one at 20 is the cadence's)
    assert [c.name for c in list_checkpoints(tmp_path / "runs" / "split")] == ["step_000020"]
    traces = tmp_path / "runs" / "split" / "trace"
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]
    assert "aten::mm" in (traces / "rank1.txt").read_text()
    events = json.loads((traces / "rank0.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)

    def losses(path):
        return {rec["step"]: rec["loss"] for rec in read_jsonl(path) if rec["type"] == "step"}
    want, got = losses(straight), losses(split)
    assert [got[s] for s in range(11, 31)] == [want[s] for s in range(11, 31)]   # exact: batches are (step, seed)'s
    assert want[30] < want[1] - 1.0   # it learns: the ids mostly follow from the one before
    summary = next(rec for rec in read_jsonl(straight) if rec["type"] == "summary")
    assert summary["test_accuracy"] > 0.3
    # samples are sequences: every step says its tokens a second, and (the peak stated) the fraction of the
    # peak its FLOPs reach, counted once on the first step: the FLOPs a token costs are the same at every step
    steps = [rec for rec in read_jsonl(straight) if rec["type"] == "step"]
    assert all(s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * SEQ, rel=1e-4) for s in steps)
    per_token = [s["mfu"] * 0.5e12 * 2 / s["tokens_per_s"] for s in steps]
    assert min(per_token) > 0 and max(per_token) == pytest.approx(min(per_token), rel=1e-3)
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1


def test_a_model_given_to_train_fits_any_data_and_a_config_file_cannot_claim_one(cli, tmp_path):
    write_tokens(tmp_path / "t.bin", 100)
    cfg = config_from_dict({"model": {"name": "user"}, "data": {"name": "tokens", "train": str(tmp_path / "t.bin")}})
    assert cfg.model.name == "user"   # what engine.train sets for the model it is given
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--set", "model.name=user", timeout=30)
    assert r.returncode == 2 and 'model.name = "user": names the model given to engine.train' in r.stderr


# --- ids past the model's vocabulary ---------------------------------------------------------------------
def token_job(train, vocab_size: int = 0, val=None, dtype: str = "uint16", model=None, given=None) -> Job:
    """The launcher's job for a token file: [model] `model` (the built-in transformer), or a LayerList `given`
    to engine.train."""
    data = {"name": "tokens", "train": str(train), "vocab_size": vocab_size, "dtype": dtype, "seq_len": SEQ}
    if val is not None:
        data["val"] = str(val)
    model = {"name": "user"} if given is not None else model or {"name": "transformer"}
    return Job(config=config_from_dict({"model": model, "data": data}), model=given)


def ids_with(path, n: int, planted: dict, dtype=np.uint16):
    """n ids below 50, with {position: id} planted."""
    ids = np.random.default_rng(1).integers(0, 50, n).astype(dtype)
    for position, token in planted.items():
        ids[position] = token
    ids.tofile(path)


def test_an_id_past_the_vocabulary_far_from_the_start_is_refused_naming_it_and_its_position(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_module, "SCAN_CHUNK_IDS", 1000)   # the largest id in a late chunk, found there
    ids_with(tmp_path / "t.bin", 200_000, {150_001: 60000, 180_000: 60000, 3: 99})
    with pytest.raises(RunSetupError) as refused:
        check_model(token_job(tmp_path / "t.bin", vocab_size=100))   # what prepare_run_dir calls
    assert str(refused.value) == (
        f'data.train = "{tmp_path / "t.bin"}": token id 60000 at token index 150001 is past the model\'s vocabulary '
        f"of 100 ids (data.vocab_size); re-tokenize the file with a vocabulary of at most 100 ids, or set "
        f"data.vocab_size to at least 60001")


def test_ids_up_to_the_last_of_the_vocabulary_pass_and_a_val_id_past_the_training_files_is_refused(tmp_path):
    ids_with(tmp_path / "t.bin", 5000, {4000: 99})
    check_token_ids(token_job(tmp_path / "t.bin", vocab_size=100))
    ids_with(tmp_path / "v.bin", 500, {10: 99})
    check_token_ids(token_job(tmp_path / "t.bin", val=tmp_path / "v.bin"))   # data.vocab_size = 0: train's 99 + 1
    ids_with(tmp_path / "v.bin", 500, {10: 99, 20: 100})
    with pytest.raises(RunSetupError, match=r'data.val = ".*v.bin": token id 100 at token index 20 is past the '
                                            r"model's vocabulary of 100 ids \(data.vocab_size = 0: the training "
                                            r"file's largest id \+ 1\)"):
        check_token_ids(token_job(tmp_path / "t.bin", val=tmp_path / "v.bin"))


def test_the_scan_is_kept_beside_the_file_reused_and_made_again_when_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "t.bin"
    ids_with(path, 4000, {1234: 77})
    assert largest_id(str(path), "uint16") == (77, 1234)
    kept = json.loads(scan_path(str(path)).read_text())
    assert kept == {"bytes": 8000, "mtime_ns": path.stat().st_mtime_ns, "dtype": "uint16", "max_id": 77,
                    "max_id_position": 1234}
    scan = scan_module._scan

    def no_scan(*args):
        raise AssertionError("scanned again")
    monkeypatch.setattr(scan_module, "_scan", no_scan)
    assert largest_id(str(path), "uint16") == (77, 1234)
    with pytest.raises(RunSetupError, match="token id 77 at token index 1234"):   # the launcher's check reads it too
        check_token_ids(token_job(path, vocab_size=50))
    ids_with(path, 4000, {99: 88})   # another file under the same name: its size and mtime_ns say so
    with pytest.raises(AssertionError, match="scanned again"):
        largest_id(str(path), "uint16")
    monkeypatch.setattr(scan_module, "_scan", scan)
    assert largest_id(str(path), "uint16") == (88, 99)
    as_uint32 = np.fromfile(path, dtype=np.uint32)   # the same bytes as other ids: scanned afresh
    assert largest_id(str(path), "uint32") == (int(as_uint32.max()), int(as_uint32.argmax()))
    assert json.loads(scan_path(str(path)).read_text())["dtype"] == "uint32"


def test_a_folder_that_cannot_be_written_is_scanned_each_time(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    ids_with(folder / "t.bin", 4000, {2000: 120})
    folder.chmod(0o555)

    def refused(*args, **kwargs):   # what a read-only folder answers (root writes whatever the mode says)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(scan_module.tempfile, "mkstemp", refused)
    try:
        for _ in range(2):
            with pytest.raises(RunSetupError, match="token id 120 at token index 2000"):
                check_token_ids(token_job(folder / "t.bin", vocab_size=100))
        assert sorted(p.name for p in folder.iterdir()) == ["t.bin"]
    finally:
        folder.chmod(0o755)


def test_uint32_ids_past_65535(tmp_path):
    ids_with(tmp_path / "t.bin", 3000, {2999: 70_000}, dtype=np.uint32)
    check_token_ids(token_job(tmp_path / "t.bin", vocab_size=70_001, dtype="uint32"))
    with pytest.raises(RunSetupError, match="token id 70000 at token index 2999 .* vocabulary of 70000 ids"):
        check_token_ids(token_job(tmp_path / "t.bin", vocab_size=70_000, dtype="uint32"))


def test_a_hugging_face_config_and_a_model_given_to_train_give_the_vocabulary(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2).to_json_file(tmp_path / "config.json")
    ids_with(tmp_path / "t.bin", 3000, {700: 64})
    hf = token_job(tmp_path / "t.bin", model={"name": "hf", "hf_config": str(tmp_path)})
    with pytest.raises(RunSetupError) as refused:
        check_token_ids(hf)
    assert (f"token id 64 at token index 700 is past the model's vocabulary of 64 ids (vocab_size in "
            f"{tmp_path / 'config.json'}); re-tokenize") in str(refused.value)
    assert str(refused.value).endswith("use a model whose vocab_size is at least 65")
    embedding = LayerList([("embed", torch.nn.Embedding(64, 8)), ("head", torch.nn.Linear(8, 64))])
    with pytest.raises(RunSetupError, match="vocabulary of 64 ids \\(num_embeddings of layer 'embed' of the model "
                                            "given to engine.train\\)"):
        check_token_ids(token_job(tmp_path / "t.bin", given=embedding))
    unclear = LayerList([("fc", torch.nn.Linear(8, 8))])   # no input embedding to read: not checked
    check_token_ids(token_job(tmp_path / "t.bin", given=unclear))


def test_engine_train_refuses_an_id_past_the_vocabulary_before_any_worker(tmp_path):
    ids_with(tmp_path / "t.bin", 3000, {2500: 50})
    model = LayerList([("embed", torch.nn.Embedding(50, 8)), ("head", torch.nn.Linear(8, 50))])
    with pytest.raises(RunSetupError, match="token id 50 at token index 2500"):
        data = {"name": "tokens", "train": str(tmp_path / "t.bin"), "seq_len": SEQ}
        engine.train({"run": {"dir": str(tmp_path / "runs")}, "data": data}, model=model)
    assert not (tmp_path / "runs").exists()
