"""The files a config names are there and fit, checked before any worker starts (a CROSS_CHECKS rule of
engine/config/check.py): a token file (and the meta.json `trainyard prepare` wrote beside it), a Hugging Face
config or weights folder. Imports only the standard library and engine.config.settings.

    meta = token_meta(cfg.data.train)    # the meta.json beside a token file, or None
    tokenizer_fingerprint(folder)        # sha256 of a tokenizer's files, what meta.json records
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from engine.config.settings import Config

META = "meta.json"   # beside the token files: what `trainyard prepare` made them with (docs/data.md)
# a tokenizer's files in a save_pretrained or Hub folder: what export copies and the fingerprint hashes
TOKENIZER_FILES = ("tokenizer*", "special_tokens*", "vocab*", "merges*", "added_tokens*", "chat_template*")


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
            problem = _against_meta(key, path, d.dtype, size // width)
            if problem:
                return problem
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


def token_meta(path: str) -> dict | None:
    """The meta.json beside the token file `path` (`trainyard prepare`'s), or None where there is none;
    ValueError where it is there but not a JSON object."""
    meta_path = os.path.join(os.path.dirname(path) or ".", META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path}: not readable as JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: not a JSON object")
    return meta


def _against_meta(key: str, path: str, dtype: str, tokens: int) -> str | None:
    """A data.dtype that contradicts the meta.json beside the file, or a file that is not the one it counted."""
    try:
        meta = token_meta(path)
    except ValueError as e:
        return f"data.{key} = {show(path)}: {e}"
    if meta is None:
        return None
    where = os.path.join(os.path.dirname(path) or ".", META)
    if meta.get("dtype") not in (None, dtype):
        return (f"data.dtype = {show(dtype)} contradicts {where}, which says the files hold {meta['dtype']} ids; "
                f"set data.dtype = {show(meta['dtype'])}")
    split = next((s for s in ("train", "val") if isinstance(meta.get(s), dict)
                  and meta[s].get("file") == os.path.basename(path)), None)
    counted = meta[split].get("tokens") if split else None
    if isinstance(counted, int) and counted != tokens:
        return (f"data.{key} = {show(path)}: holds {tokens} tokens, but {where} counted {counted} in it; the file "
                f"changed since `trainyard prepare` wrote it: prepare it again")
    return None


def tokenizer_fingerprint(folder: str) -> str:
    """sha256 over a tokenizer folder's files (TOKENIZER_FILES: names and bytes, in name order): the same
    tokenizer files give the same fingerprint wherever the folder is."""
    digest = hashlib.sha256()
    names = sorted({os.path.basename(p) for pattern in TOKENIZER_FILES
                    for p in glob.glob(os.path.join(glob.escape(folder), pattern)) if os.path.isfile(p)})
    for name in names:
        path = os.path.join(folder, name)
        digest.update(f"{name}\0{os.path.getsize(path)}\0".encode())   # lengths first: no two sets hash alike
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()
