"""Which tokenizer a Hugging Face export carries: the one the run's token files were made with (the meta.json
`trainyard prepare` wrote beside data.train names it, docs/data.md), else the one in the model's folder.

    lines = copy_run_tokenizer(folder, extras, data_cfg)   # engine/run/export.py, after save_pretrained
    names = copy_tokenizer(source, folder)                 # a folder's tokenizer files (TOKENIZER_FILES)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.config.files import TOKENIZER_FILES, token_meta, tokenizer_fingerprint


def copy_run_tokenizer(folder: Path, extras: Path | None, data_cfg: dict) -> list[str]:
    """The tokenizer the run's token files were made with (the meta.json beside data.train names it), else the
    one in the model's folder, copied into `folder`; what was done, in lines."""
    lines, tokenizer = [], extras
    meta = _data_meta(data_cfg)
    named = meta.get("tokenizer") if meta else None
    if isinstance(named, str) and Path(named).is_dir():
        tokenizer = Path(named)
        if meta.get("fingerprint") not in (None, tokenizer_fingerprint(named)):
            lines.append(f"note: the tokenizer files in {named} changed since the token files were prepared "
                         f"(their fingerprint differs from meta.json's)")
    elif isinstance(named, str):
        lines.append(f"note: the token files' meta.json names the tokenizer {named}, which is not there")
    copied = copy_tokenizer(tokenizer, folder)
    where = f"{tokenizer}" if tokenizer is not None else "the run's model"
    return lines + [f"tokenizer files copied from {where}: {', '.join(copied)}" if copied else
                    f"no tokenizer files: {where} has none (save the tokenizer into the folder yourself)"]


def _data_meta(data_cfg: dict) -> dict | None:
    """The meta.json beside the run's training token file, where there is one (a relative path is from the
    folder the run was started in, as the model's are)."""
    if data_cfg.get("name") != "tokens" or not data_cfg.get("train"):
        return None
    try:
        return token_meta(data_cfg["train"])
    except ValueError:
        return None


def copy_tokenizer(source: Path | None, folder: Path) -> list[str]:
    """Copy the tokenizer files of `source` (a save_pretrained or Hub folder) into `folder`; their names."""
    if source is None or not Path(source).is_dir():
        return []
    names = sorted({p.name for pattern in TOKENIZER_FILES for p in Path(source).glob(pattern) if p.is_file()})
    for name in names:
        shutil.copy2(Path(source) / name, Path(folder) / name)
    return names
