"""`trainyard prepare`: a user's text made into the token files `[data] name = "tokens"` reads (docs/data.md).

    trainyard prepare corpus/*.jsonl --tokenizer my-model --out data/mine --workers 4
    meta = prepare(["book.txt"], "my-model", "data/mine")    # the same in Python: meta.json's dict

Sources are local text (.txt, .md), JSON-lines (.jsonl, .json) or Parquet files, read with Hugging Face `datasets`
offline; the tokenizer is a local folder read with transformers' AutoTokenizer. Each document is tokenized
without special tokens and followed by the end-of-document token (the tokenizer's eos, or --eos), in
`workers` processes. A deterministic share of the documents (`val_fraction`, at least one) goes to val.bin,
the rest to train.bin, flat arrays of uint16 ids (a tokenizer of at most 65536 ids) or uint32, nanoGPT's
format; meta.json says what made them, and the run checks it against the model (engine/config/files.py,
engine/run/checks.py). The same inputs give the same bytes. Files are written under temporary names in
the folder and renamed when all are whole: an interrupted run leaves the folder's files as they were.

Imports engine.config.files, datasets, transformers, numpy and pyarrow when it runs (`trainyard --help` needs none).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

SUFFIXES = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}   # .md: text
TEXT_UNITS = ("paragraph", "line", "document")   # what one document of a .txt file is
VAL_FRACTION = 0.0005
BATCH_DOCS = 1000          # documents a tokenizing call and a write take at once
UINT16_IDS = 1 << 16


class PrepareError(ValueError):
    """Sources, a tokenizer or a flag that cannot be prepared, named."""


def prepare(sources: list[str], tokenizer: str, out: str, *, field: str = "text",
            val_fraction: float = VAL_FRACTION, workers: int = 1, eos: str | None = None,
            text_unit: str = "paragraph") -> dict:
    """Tokenize `sources` with the tokenizer folder `tokenizer` into OUT/train.bin, val.bin and meta.json;
    returns what meta.json holds."""
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction}: give a share of the documents, 0 <= F < 1")
    if workers < 1:
        raise PrepareError(f"--workers {workers}: give at least 1")
    if text_unit not in TEXT_UNITS:
        raise PrepareError(f"--text-unit {text_unit!r}: choose one of {', '.join(TEXT_UNITS)}")
    files = source_files(sources)
    with offline():
        return _prepare(files, tokenizer, Path(out), field, val_fraction, workers, eos, text_unit)


def _prepare(files: list[Path], tokenizer: str, out_dir: Path, field: str, val_fraction: float, workers: int,
             eos: str | None, text_unit: str) -> dict:
    from engine.config.files import META, tokenizer_fingerprint
    tok = load_tokenizer(tokenizer)
    eos_token, eos_id = end_of_document(tok, eos, tokenizer)
    dtype = "uint16" if len(tok) <= UINT16_IDS else "uint32"
    fingerprint = tokenizer_fingerprint(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix=".prepare-cache-", dir=out_dir)   # datasets' cache: gone when done
    partials: dict[str, Path] = {}
    try:
        docs = read_documents(files, field, text_unit, cache)
        ids = tokenize(docs, tok, eos_id, workers, fingerprint)
        splits, max_id = write_splits(ids, out_dir, dtype, val_fraction, partials)
        meta = {"dtype": dtype, "vocab_size": len(tok), "tokenizer": str(Path(tokenizer).resolve()),
                "special_tokens": special_tokens(tok), "eos": {"token": eos_token, "id": eos_id},
                "fingerprint": fingerprint, "max_id": max_id, **splits,
                "sources": [str(f.resolve()) for f in files], "field": field, "text_unit": text_unit,
                "val_fraction": val_fraction}
        partials[META] = _partial(out_dir, META)
        partials[META].write_text(json.dumps(meta, indent=1) + "\n")
        _commit(out_dir, partials, val_written="val.bin" in partials)
    finally:
        for path in partials.values():
            path.unlink(missing_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
    return meta


def source_files(sources: list[str]) -> list[Path]:
    """The files named, in the order given; a folder stands for the files in it (and below) with a known suffix,
    in name order."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise PrepareError(f"{source}: a folder holding no {', '.join(SUFFIXES)} file")
            files += found
        elif not path.is_file():
            raise PrepareError(f"{source}: no such file or folder")
        elif path.suffix not in SUFFIXES:
            raise PrepareError(f"{source}: not a text (.txt, .md), JSON-lines (.jsonl, .json) or Parquet (.parquet) file")
        else:
            files.append(path)
    if not files:
        raise PrepareError("no source: name the text, JSON-lines or Parquet files to prepare")
    return files


@contextmanager
def offline():
    """Nothing fetched from the Hub (datasets and transformers read these when they load; a datasets loaded
    before is told too), and each worker process tokenizing on one thread (the tokenizers library's own
    threads would fight them); the caller's environment and datasets' setting are restored after."""
    wanted = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}
    was = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        import datasets
    except ImportError:
        raise PrepareError("trainyard prepare needs datasets and transformers: pip install -e '.[data]'") from None
    was_offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = was_offline
        for name, value in was.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_tokenizer(folder: str):
    if not Path(folder).is_dir():
        raise PrepareError(f"--tokenizer {folder}: no such folder (give a save_pretrained folder, one holding "
                           f"tokenizer.json or the like)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PrepareError("trainyard prepare needs transformers and datasets: pip install -e '.[data]'") from None
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrepareError(f"--tokenizer {folder}: transformers reads no tokenizer from it ({e})") from None


def end_of_document(tok, eos: str | None, folder: str) -> tuple[str, int]:
    """The token that goes after every document, and its id: `eos` where given, else the tokenizer's own."""
    token = eos if eos is not None else tok.eos_token
    if token is None:
        raise PrepareError(f"--tokenizer {folder}: has no end-of-sequence token (eos_token), which goes between "
                           f"documents; name one of its tokens with --eos TOKEN")
    token_id = tok.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or (token_id == tok.unk_token_id and token != tok.unk_token):
        raise PrepareError(f"--eos {token!r}: not a token of the tokenizer {folder}")
    return str(token), token_id


def special_tokens(tok) -> dict:
    """The tokenizer's special tokens by role, each {"token", "id"} (a list of them for a list)."""
    def one(token: str) -> dict:
        return {"token": str(token), "id": tok.convert_tokens_to_ids(str(token))}
    return {role: [one(t) for t in value] if isinstance(value, list) else one(value)
            for role, value in sorted(tok.special_tokens_map.items())}


def read_documents(files: list[Path], field: str, text_unit: str, cache: str):
    """One data set of documents, one column `text`, in the files' order: each run of files of one format is
    read by one of datasets' builders."""
    import datasets
    runs: list[tuple[str, list[Path]]] = []
    for f in files:
        kind = SUFFIXES[f.suffix]
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(f)
        else:
            runs.append((kind, [f]))
    parts = []
    for kind, group in runs:
        options = {"sample_by": text_unit, "keep_linebreaks": True} if kind == "text" else {}
        try:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in group], split="train", cache_dir=cache,
                                       **options)
        except Exception as e:   # datasets wraps a parser's error in its own classes
            raise PrepareError(f"{group[0]}{' ...' if len(group) > 1 else ''}: datasets cannot read it as "
                               f"{kind} ({type(e).__name__}: {e})") from None
        name = "text" if kind == "text" else field
        if name not in ds.column_names:
            raise PrepareError(f"{group[0]}: no field {name!r} (its fields: {', '.join(ds.column_names)}); name the "
                               f"text field with --field")
        feature = ds.features[name]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise PrepareError(f"{group[0]}: field {name!r} holds {feature}, not text; name the text field with "
                               f"--field")
        ds = ds.select_columns([name])
        parts.append(ds.rename_column(name, "text") if name != "text" else ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _encode(batch: dict, tok, eos_id: int) -> dict:
    texts = [t or "" for t in batch["text"]]
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    return {"ids": [ids + [eos_id] if text else [] for ids, text in zip(encoded, texts)]}   # an empty one: none


def tokenize(docs, tok, eos_id: int, workers: int, fingerprint: str):
    """The documents' ids, each followed by eos_id (an empty document: no ids), in order, in `workers`
    processes, with a progress bar."""
    import datasets
    # named here: datasets would otherwise hash the tokenizer object to name its cache
    key = hashlib.sha256(f"{docs._fingerprint}|{fingerprint}|{eos_id}".encode()).hexdigest()[:16]
    return docs.map(_encode, batched=True, batch_size=BATCH_DOCS, num_proc=workers if workers > 1 else None,
                    remove_columns=["text"], fn_kwargs={"tok": tok, "eos_id": eos_id}, new_fingerprint=key,
                    features=datasets.Features({"ids": datasets.List(datasets.Value("uint32"))}),
                    desc="tokenizing")


def val_rows(lengths, val_fraction: float):
    """The rows whose documents go to val: `val_fraction` of the non-empty documents (at least one where it
    is above 0), spread evenly, each the middle of its stride, so the first document stays in train."""
    import numpy as np
    documents = np.flatnonzero(lengths > 0)
    count = len(documents)
    n_val = 0 if val_fraction == 0 else max(1, round(count * val_fraction))
    if count - n_val < 1:
        raise PrepareError(f"{count} non-empty document{'s' if count != 1 else ''}: too few for a train split and "
                           f"{n_val} for val; give more documents (a .txt file: --text-unit paragraph or line) "
                           f"or --val-fraction 0")
    return documents[((np.arange(n_val) + 0.5) * count / n_val).astype(np.int64)]


def write_splits(ids, out_dir: Path, dtype: str, val_fraction: float, partials: dict) -> tuple[dict, int]:
    """train.bin and val.bin written under temporary names (kept in `partials`); meta.json's per-split
    counts and the largest id."""
    import numpy as np
    import pyarrow.compute as pc
    table = ids.data   # the map's Arrow table, memory-mapped: the ids are read a batch at a time
    lengths = pc.list_value_length(table.column("ids")).to_numpy().astype(np.int64)
    is_val = np.zeros(len(lengths), dtype=bool)
    is_val[val_rows(lengths, val_fraction)] = True
    names = ["train.bin", "val.bin"] if is_val.any() else ["train.bin"]
    for name in names:
        partials[name] = _partial(out_dir, name)
    handles = {name: open(partials[name], "wb") for name in names}
    max_id = -1
    try:
        for start in range(0, len(lengths), BATCH_DOCS):
            stop = min(start + BATCH_DOCS, len(lengths))
            values = pc.list_flatten(table.slice(start, stop - start).column("ids")).to_numpy()
            if values.size:
                max_id = max(max_id, int(values.max()))
            to_val = np.repeat(is_val[start:stop], lengths[start:stop])
            write_ids(handles["train.bin"], values[~to_val], dtype)
            if to_val.any():
                write_ids(handles["val.bin"], values[to_val], dtype)
    finally:
        for handle in handles.values():
            handle.close()
    nonempty = lengths > 0
    splits = {"train": {"file": "train.bin", "tokens": int(lengths[~is_val].sum()),
                        "documents": int((nonempty & ~is_val).sum())},
              "val": {"file": "val.bin" if is_val.any() else None, "tokens": int(lengths[is_val].sum()),
                      "documents": int(is_val.sum())}}
    return splits, max_id


def write_ids(handle, ids, dtype: str) -> None:
    import numpy as np
    handle.write(ids.astype(np.dtype(dtype), copy=False).tobytes())


def _partial(out_dir: Path, name: str) -> Path:
    fd, path = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".partial")
    os.fchmod(fd, 0o644)   # mkstemp's 0600 would hide the files from the other users of a shared folder
    os.close(fd)
    return Path(path)


def _commit(out_dir: Path, partials: dict, val_written: bool) -> None:
    """Every file renamed into place once all are whole; the old meta.json goes first, so that a stop between
    two renames leaves token files without a meta.json, never with another run's."""
    from engine.config.files import META
    (out_dir / META).unlink(missing_ok=True)
    if not val_written:
        (out_dir / "val.bin").unlink(missing_ok=True)   # an earlier run's, which meta.json no longer describes
    for name in ("train.bin", "val.bin", META):
        if name in partials:
            os.replace(partials.pop(name), out_dir / name)


def describe(meta: dict, out: str) -> list[str]:
    """What the command prints when done."""
    from engine.config.files import META
    lines = [f"{out}: {meta['dtype']} ids, vocabulary {meta['vocab_size']} ({meta['tokenizer']}), "
             f"end of document {meta['eos']['token']!r} (id {meta['eos']['id']})"]
    for split in ("train", "val"):
        s = meta[split]
        if s["file"]:
            lines.append(f"  {s['file']}: {s['tokens']} tokens, {s['documents']} documents")
    lines.append(f"  {META}: the largest id {meta['max_id']}, tokenizer {meta['fingerprint'][:19]}...")
    return lines
