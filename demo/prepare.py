"""Files a demo writes before its run: `trainyard demo llm`'s token files and model config.

    overrides = prepare_llm(runs_dir)   # ["data.train=...", "data.val=...", "model.hf_config=..."]

Written into RUNS_DIR/demo-llm-data/, once (a second demo reuses them), atomically (a file is complete or
absent). Imports numpy and engine.training.data; transformers only for the config, and only when it must be written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# a Llama-shaped model that trains on 2 cores: 4 decoder blocks of width 96
LLAMA = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}
TEXT_CHARS = 400_000
VAL_FRACTION = 0.1


def _write(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def prepare_llm(runs_dir: Path) -> list[str]:
    import numpy as np

    from engine.training.data import text_corpus
    folder = Path(runs_dir) / "demo-llm-data"
    folder.mkdir(parents=True, exist_ok=True)
    train, val, config = folder / "train.bin", folder / "val.bin", folder / "llama.json"
    if not (train.exists() and val.exists() and config.exists()):
        text = text_corpus(TEXT_CHARS)
        itos = "".join(sorted(set(text)))
        ids = np.array([itos.index(ch) for ch in text], dtype=np.uint16)
        cut = int(len(ids) * (1 - VAL_FRACTION))
        _write(train, ids[:cut].tobytes())
        _write(val, ids[cut:].tobytes())
        _write(config, json.dumps({**LLAMA, "vocab_size": len(itos)}, indent=1).encode())
    return [f"data.train={train}", f"data.val={val}", f"model.hf_config={config}"]


PREPARE = {"llm": prepare_llm}
