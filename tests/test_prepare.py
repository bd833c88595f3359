"""`trainyard prepare` (engine/prepare.py): text, JSON-lines and Parquet made into train.bin, val.bin and
meta.json with a local tokenizer; the same bytes on a rerun, nothing half-written when stopped; and the run's
checks of meta.json against the model (engine/config/files.py, engine/run/checks.py).

    .venv/bin/python -m pytest -p no:randomly -q tests/test_prepare.py

A tiny byte-level BPE is trained on text written here (module fixture `tokenizer`): nothing is downloaded.
"""

from __future__ import annotations

import math

import json
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from engine import prepare as prep  # noqa: E402
from engine.cli import main as trainyard  # noqa: E402
from engine.config import ConfigError, config_from_dict  # noqa: E402
from engine.run.checks import RunSetupError, check_token_ids  # noqa: E402

EOS = "<|eos|>"
WORDS = ("the pipeline moves layers between stages while the owner broadcasts its shard over several streams "
         "and a host thread updates what the plan placed there").split()


def text_of(n_docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))).capitalize() + "." for _ in range(n_docs)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["\n".join(text_of(200, seed=1))], trainer=trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok(tokenizer):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def ids_of(tok, doc: str) -> list[int]:
    return tok(doc, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(EOS)]


@pytest.fixture(scope="module")
def prepared(tokenizer, tmp_path_factory):
    """Forty JSON-lines documents prepared through the command with two workers, 10% for val."""
    root = tmp_path_factory.mktemp("prepared")
    docs = text_of(40)
    source = write_jsonl(root / "docs.jsonl", docs)
    args = ["prepare", str(source), "--tokenizer", str(tokenizer), "--out", str(root / "out"), "--workers", "2",
            "--val-fraction", "0.1"]
    assert trainyard(args) == 0
    return types.SimpleNamespace(root=root, out=root / "out", docs=docs, args=args)


def test_the_files_hold_the_documents_tokens_and_meta_json_counts_them(prepared, tok, tokenizer):
    out, docs = prepared.out, prepared.docs
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]   # no cache, no partial
    train, val = np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)
    first = ids_of(tok, docs[0])
    assert tok.decode(train[:len(first) - 1].tolist()) == docs[0]   # the start of the text, then the eos
    assert train[len(first) - 1] == tok.convert_tokens_to_ids(EOS)
    per_doc = [ids_of(tok, d) for d in docs]
    in_val = {int(i) for i in prep.val_rows(np.array([len(ids) for ids in per_doc]), 0.1)}
    assert len(in_val) == 4 and 0 not in in_val
    assert train.tolist() == [i for d, ids in enumerate(per_doc) if d not in in_val for i in ids]
    assert val.tolist() == [i for d, ids in enumerate(per_doc) if d in in_val for i in ids]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(tok) == 300
    assert meta["tokenizer"] == str(tokenizer.resolve())
    assert meta["special_tokens"]["eos_token"] == meta["eos"] == {"token": EOS, "id": tok.convert_tokens_to_ids(EOS)}
    assert meta["fingerprint"].startswith("sha256:") and len(meta["fingerprint"]) == 7 + 64
    assert meta["max_id"] == max(max(ids) for ids in per_doc)
    assert meta["train"] == {"file": "train.bin", "tokens": len(train), "documents": 36}
    assert meta["val"] == {"file": "val.bin", "tokens": len(val), "documents": 4}


def test_a_rerun_gives_the_same_bytes_with_any_number_of_workers(prepared):
    before = {p.name: p.read_bytes() for p in prepared.out.iterdir()}
    assert trainyard(prepared.args) == 0
    assert {p.name: p.read_bytes() for p in prepared.out.iterdir()} == before
    assert trainyard([*prepared.args[:-4], "--workers", "1", "--val-fraction", "0.1"]) == 0
    assert {p.name: p.read_bytes() for p in prepared.out.iterdir()} == before


def test_a_stopped_run_leaves_no_half_written_file(prepared, tokenizer, tmp_path, monkeypatch):
    """Stopped while writing (the second batch of ids): a fresh folder gets none of the three files, a prepared
    one keeps its files as they were; no temporary file or cache stays."""
    writes = []

    def stop_on_the_second(handle, ids, dtype):
        writes.append(len(ids))
        if len(writes) == 2:
            raise KeyboardInterrupt
        handle.write(ids.astype(dtype).tobytes())

    monkeypatch.setattr(prep, "BATCH_DOCS", 4)
    monkeypatch.setattr(prep, "write_ids", stop_on_the_second)
    source = prepared.root / "docs.jsonl"
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(source)], str(tokenizer), str(tmp_path / "fresh"), val_fraction=0.1)
    assert list((tmp_path / "fresh").iterdir()) == []
    before = {p.name: p.read_bytes() for p in prepared.out.iterdir()}
    writes.clear()
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(source)], str(tokenizer), str(prepared.out), val_fraction=0.3)
    assert {p.name: p.read_bytes() for p in prepared.out.iterdir()} == before


def test_text_json_lines_and_parquet_are_read_in_the_order_given(tokenizer, tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    text = "One paragraph of plain text\nover two lines.\n\nA second paragraph.\n"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "d.md").write_text("# A heading\n\nMarkdown is text.\n")   # .md: a text file too
    parquet_docs, jsonl_docs = text_of(3, seed=2), text_of(2, seed=3)
    pq.write_table(pa.table({"body": parquet_docs, "n": [1, 2, 3]}), tmp_path / "b.parquet")
    write_jsonl(tmp_path / "c.jsonl", jsonl_docs, field="body")
    meta = prep.prepare([str(tmp_path / n) for n in ("a.txt", "b.parquet", "c.jsonl", "d.md")], str(tokenizer),
                        str(tmp_path / "out"), field="body", val_fraction=0)
    docs = [p for p in text.split("\n\n") if p] + parquet_docs + jsonl_docs + ["# A heading", "Markdown is text.\n"]
    want = [i for d in docs for i in ids_of(tok, d)]
    assert np.fromfile(tmp_path / "out" / "train.bin", np.uint16).tolist() == want
    assert meta["train"] == {"file": "train.bin", "tokens": len(want), "documents": 9}
    assert meta["val"] == {"file": None, "tokens": 0, "documents": 0}
    assert not (tmp_path / "out" / "val.bin").exists()


def test_refusals_name_what_is_wrong(tokenizer, tmp_path, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", text_of(5))
    out = str(tmp_path / "out")
    assert trainyard(["prepare", str(source), "--tokenizer", str(tokenizer), "--out", out, "--field", "body"]) == 2
    assert "no field 'body'" in capsys.readouterr().err
    assert trainyard(["prepare", str(tmp_path / "none.csv"), "--tokenizer", str(tokenizer), "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    no_eos = tmp_path / "no-eos"
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer / "tokenizer.json")).save_pretrained(no_eos)
    assert trainyard(["prepare", str(source), "--tokenizer", str(no_eos), "--out", out]) == 2
    assert "--eos TOKEN" in capsys.readouterr().err
    assert trainyard(["prepare", str(source), "--tokenizer", str(no_eos), "--out", out, "--eos", EOS,
                     "--val-fraction", "0.2"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["eos"]["token"] == EOS and meta["val"]["documents"] == 1 and meta["train"]["documents"] == 4


def tokens_config(prepared, **data) -> dict:
    return {"model": {"name": "transformer"},
            "data": {"name": "tokens", "train": str(prepared.out / "train.bin"), "val": str(prepared.out / "val.bin"),
                     "seq_len": 8, "batch_size": 4, **data}}


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch(prepared):
    def check(cfg):
        check_token_ids(types.SimpleNamespace(config=cfg, model=None, data=None))

    with pytest.raises(RunSetupError) as refused:
        check(config_from_dict(tokens_config(prepared, vocab_size=299)))
    assert "tokenizer of 300 ids" in str(refused.value) and "vocabulary of 299 ids" in str(refused.value)
    check(config_from_dict(tokens_config(prepared, vocab_size=320)))   # padded to a larger vocabulary: fine
    check(config_from_dict(tokens_config(prepared)))   # 0: the tokenizer's


def test_a_dtype_contradicting_meta_json_is_refused(prepared):
    with pytest.raises(ConfigError, match=r'data.dtype = "uint32" contradicts .*meta.json.* uint16'):
        config_from_dict(tokens_config(prepared, dtype="uint32"))
    assert config_from_dict(tokens_config(prepared, dtype="uint16")).data.dtype == "uint16"


def test_export_copies_the_tokenizer_meta_json_names(prepared, tokenizer, tmp_path):
    from engine.run.export_tokenizer import copy_run_tokenizer
    data = {"name": "tokens", "train": str(prepared.out / "train.bin")}
    (tmp_path / "hf").mkdir()
    lines = copy_run_tokenizer(tmp_path / "hf", None, data)
    assert lines == [f"tokenizer files copied from {tokenizer.resolve()}: tokenizer.json, tokenizer_config.json"]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert copy_run_tokenizer(tmp_path / "hf", None, {"name": "digits"}) == \
        ["no tokenizer files: the run's model has none (save the tokenizer into the folder yourself)"]


def test_a_short_run_trains_on_the_prepared_files(prepared, cli, tmp_path):
    """World 1, a few steps of the built-in transformer (its vocabulary the tokenizer's, from meta.json): the
    files train and the val file is evaluated."""
    log = tmp_path / "run.jsonl"
    sets = {"model.name": "transformer", "model.depth": 1, "model.d_model": 16, "data.name": "tokens",
            "data.train": prepared.out / "train.bin", "data.val": prepared.out / "val.bin", "data.seq_len": 8,
            "data.batch_size": 4, "parallel.world_size": 1, "run.eval_every": 2}
    r = cli.run("run", "demo/configs/digits_ddp.toml", "--headless", "--steps", "4", *cli.base_args("prepared"),
                *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    from tests.conftest import read_jsonl
    records = read_jsonl(log)
    assert [rec["step"] for rec in records if rec["type"] == "step"] == [1, 2, 3, 4]
    summary = next(rec for rec in records if rec["type"] == "summary")
    assert summary["test_accuracy"] is not None and summary["val_loss"] > 0   # the val file's validation loss
    assert summary["perplexity"] == pytest.approx(math.exp(summary["val_loss"]))
    evals = [rec for rec in records if rec.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [2, 4] and all(e["val_loss"] > 0 for e in evals)
