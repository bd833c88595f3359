"""Files a demo writes before its run: `trainyard demo llm`'s tokenizer, token files and model config.

    overrides = prepare_llm(runs_dir)   # ["data.train=...", "data.val=...", "model.hf_config=..."]

Written into RUNS_DIR/demo-llm-data/, once (a second demo reuses them), each complete or absent: the corpus
(the standard library's docstrings, corpus.txt), a byte-level BPE tokenizer of VOCAB ids trained on it
(tokenizer/, a transformers folder: nothing is downloaded), the token files `trainyard prepare` makes with it
(train.bin, val.bin, meta.json; engine/prepare.py) and the model's config (llama.json). Imports
engine.training.data and engine.prepare; tokenizers, transformers and datasets (pip install -e '.[hf,data]').
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# a Llama-shaped model that trains on 2 cores: 4 decoder blocks of width 96
LLAMA = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TEXT_CHARS = 400_000
VOCAB = 512              # small: the embedding and head stay a small share of a 4-block model
EOS = "<|endoftext|>"
VAL_FRACTION = 0.1


def _write(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def train_tokenizer(text: str, folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE of `vocab` ids trained on `text`, saved as a transformers folder (the same text gives
    the same files); written beside `folder` and renamed into place."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text], trainer=trainer)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS).save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def prepare_llm(runs_dir: Path) -> list[str]:
    from engine.prepare import prepare
    from engine.training.data import text_corpus
    folder = Path(runs_dir) / "demo-llm-data"
    folder.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer, config = folder / "corpus.txt", folder / "tokenizer", folder / "llama.json"
    train, val, meta_path = folder / "train.bin", folder / "val.bin", folder / "meta.json"
    if not all(p.exists() for p in (train, val, meta_path, config, tokenizer)):
        text = text_corpus(TEXT_CHARS)
        _write(corpus, text.encode())
        train_tokenizer(text, tokenizer)
        config.unlink(missing_ok=True)   # written last: its presence says the rest is whole
        meta = prepare([str(corpus)], str(tokenizer), str(folder), val_fraction=VAL_FRACTION)
        eos = meta["eos"]["id"]
        _write(config, json.dumps({**LLAMA, "vocab_size": meta["vocab_size"], "bos_token_id": eos,
                                   "eos_token_id": eos}, indent=1).encode())
    return [f"data.train={train}", f"data.val={val}", f"model.hf_config={config}"]


PREPARE = {"llm": prepare_llm}
