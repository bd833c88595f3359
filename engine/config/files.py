"""The files a config names are there and fit, checked before any worker starts (a CROSS_CHECKS rule of
engine/config/check.py): a token file, a Hugging Face config or weights folder. Imports only the standard
library and engine.config.settings."""

from __future__ import annotations

import json
import os

from engine.config.settings import Config


def show(path: str) -> str:
    """A path as TOML spells it (check.show's rule for strings; check imports this module)."""
    return json.dumps(path, ensure_ascii=False)


def files_exist(cfg: Config) -> str | None:
    """The files a run reads are there, before any worker starts: a token file (a whole number of ids, at
    least one sample), a Hugging Face config or weights folder."""
    d, m = cfg.data, cfg.model
    if d.name == "tokens":
        if not d.train:
            return 'data.name = "tokens": requires data.train, the path of a token file'
        width = 2 if d.dtype == "uint16" else 4
        for key in ("train", "val"):
            path = getattr(d, key)
            if not path:
                continue
            if not os.path.isfile(path):
                return f"data.{key} = {show(path)}: no such file"
            size = os.path.getsize(path)
            if size % width:
                return (f"data.{key} = {show(path)}: {size} bytes is not a whole number of {d.dtype} ids "
                        f"(is data.dtype right?)")
            if size // width < d.seq_len + 1:
                return (f"data.{key} = {show(path)}: holds {size // width} tokens, fewer than one sample of "
                        f"data.seq_len + 1 = {d.seq_len + 1}")
    if m.name == "hf":
        if not m.hf_config and not m.hf_weights:
            return 'model.name = "hf": requires model.hf_config (a config.json) or model.hf_weights (a folder)'
        if m.hf_config and not os.path.exists(m.hf_config):
            return f"model.hf_config = {show(m.hf_config)}: no such file or folder"
        if m.hf_weights and not os.path.isdir(m.hf_weights):
            return f"model.hf_weights = {show(m.hf_weights)}: no such folder"
        if m.hf_weights and not m.hf_config and not os.path.isfile(os.path.join(m.hf_weights, "config.json")):
            return f"model.hf_weights = {show(m.hf_weights)}: holds no config.json (give model.hf_config)"
    return None
