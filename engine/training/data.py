"""Data sets, deterministic global batches and per-rank shards.

    ds = load_dataset(cfg.data, seed=cfg.run.seed)      # digits | text | synthetic
    x, y = batch_for(ds, step, cfg.data.batch_size, seed=cfg.run.seed,
                     rank=rank, world_size=world_size)   # this rank's share of step's batch
    max_id, position = largest_id(path, "uint16")        # a token file's; kept in PATH.scan.json

The batch of every optimizer step is a pure function of (step, seed): no iterator
state, so a run resumed at step k (with any world size that divides the batch)
sees exactly the samples an uninterrupted run would have. Users with their own
data wrap tensors with `tensor_dataset(x_train, y_train, x_test, y_test)`.

Data sets are memoised per process; treat their tensors as read-only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import DataConfig
from engine.training.loss import IGNORE, counted, cross_entropy
from engine.training.token_scan import largest_id


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    meta: dict = field(default_factory=dict)  # input_dim / num_classes / image_shape / vocab_size / seq_len / itos

    @property
    def n_train(self) -> int:
        return len(self.x_train)


def _generator(*parts) -> torch.Generator:
    """A generator seeded from a tuple: (seed, epoch) and (seed + 1, epoch - 1) never collide,
    unlike arithmetic mixing, and the hash is stable across processes (no PYTHONHASHSEED)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


# ---------------------------------------------------------------- batches and shards

@functools.lru_cache(maxsize=8)
def _epoch_permutation(n_train: int, seed: int, epoch: int) -> torch.Tensor:
    # cached: all the steps of an epoch slice the same permutation
    return torch.randperm(n_train, generator=_generator("epoch", seed, epoch))


def _batch_start(n_train: int, batch_size: int, step: int) -> tuple[int, int]:
    """(epoch, where step `step`'s global batch starts in that epoch's permutation), checked."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size < 1 or n_train // batch_size < 1:
        raise ValueError(f"batch_size {batch_size} does not fit the {n_train} training samples: "
                         f"need 1 <= batch_size <= n_train")
    epoch, offset = divmod(step, n_train // batch_size)
    return epoch, offset * batch_size


def global_batch_indices(n_train: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Indices into the train split of the global batch at optimizer step `step` (0-based).

    Each epoch is a fresh seeded permutation, cut into n_train // batch_size batches
    (the remainder is dropped), so within an epoch no sample repeats."""
    epoch, start = _batch_start(n_train, batch_size, step)
    return _epoch_permutation(n_train, seed, epoch)[start:start + batch_size].clone()


def _share(batch: int, rank: int, world_size: int) -> tuple[int, int]:
    """Where rank `rank`'s share of a global batch of `batch` samples starts and ends in it, checked."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if batch % world_size != 0:
        raise ValueError(f"batch of {batch} samples is not divisible by world_size {world_size}")
    per_rank = batch // world_size
    return rank * per_rank, (rank + 1) * per_rank


def rank_slice(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The contiguous 1/world_size share of `indices` that data-parallel rank `rank` trains on."""
    lo, hi = _share(len(indices), rank, world_size)
    return indices[lo:hi]


@functools.lru_cache(maxsize=2)
def _epoch_order(n_train: int, seed: int, epoch: int):
    """The epoch's permutation as a numpy array (the same memory): a token file's batch reads it with no torch
    operation. Two kept: a step needs its own epoch's, and an epoch of a large file's samples is 8 bytes each."""
    return _epoch_permutation(n_train, seed, epoch).numpy()


def batch_for(ds: Dataset, step: int, batch_size: int, seed: int, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of rank `rank`'s share of the global batch at `step`."""
    if isinstance(ds.x_train, TokenWindows) and ds.x_train.pairs_with(ds.y_train):
        # a token file: each sample's inputs and targets in one read of the file, the share's indices read from
        # the permutation in numpy, with no torch operation: each cost ~10-20 microseconds in the step loop, where
        # the step before leaves their code cold (a batch 0.094-0.096 ms against 0.130-0.137; docs/training.md)
        epoch, start = _batch_start(ds.n_train, batch_size, step)
        lo, hi = _share(batch_size, rank, world_size)
        return ds.x_train.with_targets(ds.y_train, _epoch_order(ds.n_train, seed, epoch)[start + lo:start + hi])
    idx = rank_slice(global_batch_indices(ds.n_train, batch_size, step, seed), rank, world_size)
    return ds.x_train[idx], ds.y_train[idx]


def micro_steps(x: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A share cut into `n` micro-steps of equal size (`data.accumulate`; the config checks that they divide)."""
    return list(zip(x.chunk(n), y.chunk(n))) if n > 1 else [(x, y)]


def global_count(ds: Dataset, step: int, batch_size: int, seed: int, loss_fn=cross_entropy) -> int | None:
    """The targets the loss counts in the whole global batch at `step` (engine/training/loss.py), read by every rank
    from the data itself, no collective; None where every share of it counts alike (no -100 label in the
    data, or a user's loss, which counts samples)."""
    if not ds.meta.get("ignored_labels") or loss_fn is not cross_entropy:
        return None
    return counted(ds.y_train[global_batch_indices(ds.n_train, batch_size, step, seed)], loss_fn)


# ---------------------------------------------------------------- data sets

def _split(name: str, x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int,
           meta: dict) -> Dataset:
    n = len(x)
    n_test = max(1, round(n * test_fraction))
    if n - n_test < 1:
        raise ValueError(f"data set {name!r} has only {n} samples: too few for a train and a test split")
    perm = torch.randperm(n, generator=_generator("split", seed))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], meta)


def tensor_dataset(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor | None = None,
                   y_test: torch.Tensor | None = None, name: str = "custom") -> Dataset:
    """Wrap your own tensors. Without a test split the test tensors are empty.

    meta is inferred: input_dim for 2-D float x, image_shape for 4-D float x,
    num_classes = max label + 1 for integer y."""
    if len(x_train) != len(y_train):
        raise ValueError(f"x_train has {len(x_train)} samples but y_train has {len(y_train)}")
    if (x_test is None) != (y_test is None):
        raise ValueError("give both x_test and y_test, or neither")
    if x_test is None:
        x_test, y_test = x_train[:0], y_train[:0]
    if len(x_test) != len(y_test):
        raise ValueError(f"x_test has {len(x_test)} samples but y_test has {len(y_test)}")
    meta: dict = {}
    if x_train.is_floating_point() and x_train.dim() == 2:
        meta["input_dim"] = x_train.shape[1]
    if x_train.is_floating_point() and x_train.dim() == 4:
        meta["image_shape"] = tuple(x_train.shape[1:])
    if not y_train.is_floating_point() and len(y_train):
        meta["num_classes"] = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
        # labels of -100 count for nothing in the loss (engine/training/loss.py): shares may then count differently
        meta["ignored_labels"] = bool((y_train == IGNORE).any())
    return Dataset(name, x_train, y_train, x_test, y_test, meta)


def _digits(test_fraction: float, seed: int) -> Dataset:
    # The 8x8 digits ship inside scikit-learn as a CSV (no download). Read the file itself: importing
    # sklearn costs every rank about 2.5 s of CPU, which `load_digits` would spend to read 560 KB.
    import gzip
    import importlib.util

    import numpy as np
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError('data.name = "digits" needs scikit-learn installed (it ships the data set)')
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        raw = np.loadtxt(f, delimiter=",")
    x = torch.tensor(raw[:, :-1], dtype=torch.float32) / 16.0  # pixel intensities are 0..16
    y = torch.tensor(raw[:, -1], dtype=torch.int64)
    return _split("digits", x, y, test_fraction, seed,
                  {"input_dim": 64, "num_classes": 10, "image_shape": (1, 8, 8)})


# Fixed and sorted: the corpus must be identical in every process. Pure-Python modules
# whose docstrings do not change with import order; a module that fails to import is skipped.
_TEXT_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "difflib", "email.message", "enum", "fileinput",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac",
    "http.client", "inspect", "ipaddress", "json", "logging", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pprint", "queue", "random", "shlex", "shutil", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "urllib.parse", "uuid", "warnings", "zipfile",
)
_PRINTABLE = frozenset(map(chr, range(32, 127))) | {"\n"}


@functools.lru_cache(maxsize=4)
def text_corpus(max_chars: int) -> str:
    """The first `max_chars` characters of the standard library's docstrings (printable ASCII and newlines)."""
    docs: list[str] = []
    for module_name in _TEXT_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        docs.append(module.__doc__ or "")
        for name, obj in inspect.getmembers(module):  # sorted by name
            # only what the module defines, so a re-exported helper is not counted twice
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                docs.append(doc)
    text = "\n\n".join(d for d in docs if d.strip())
    return "".join(ch for ch in text if ch in _PRINTABLE)[:max_chars]


def _text(seq_len: int, text_chars: int, test_fraction: float, seed: int) -> Dataset:
    text = text_corpus(text_chars)
    window = seq_len + 1  # x is the window minus its last char, y minus its first
    n = len(text) // window
    if n < 2:
        raise ValueError(f"the text corpus has {len(text)} characters: too few for two samples of "
                         f"seq_len {seq_len} (is Python running with -OO, which strips docstrings?)")
    itos = "".join(sorted(set(text)))
    stoi = {ch: i for i, ch in enumerate(itos)}
    ids = torch.tensor([stoi[ch] for ch in text[:n * window]], dtype=torch.int64).view(n, window)
    return _split("text", ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), test_fraction, seed,
                  {"vocab_size": len(itos), "seq_len": seq_len, "itos": itos})


def _synthetic(samples: int, features: int, classes: int, test_fraction: float, seed: int) -> Dataset:
    x = torch.randn(samples, features, generator=_generator("synthetic-x", seed))
    # labels come from a fixed linear "teacher", so a linear model can learn them exactly
    teacher = torch.randn(features, classes, generator=_generator("synthetic-teacher", seed))
    y = (x @ teacher).argmax(dim=1)
    meta = {"input_dim": features, "num_classes": classes}
    side = math.isqrt(features)
    if side * side == features:
        meta["image_shape"] = (1, side, side)
    return _split("synthetic", x, y, test_fraction, seed, meta)


class TokenWindows:
    """Samples of a flat token file, memory-mapped: sample k is the ids [k*T, k*T + T) (`shift` 0: the
    inputs) or [k*T + 1, k*T + T + 1) (`shift` 1: the next-token targets), T = seq_len, so consecutive
    samples overlap by the one id that is both a target and the next sample's first input. Indexed like a
    tensor by an index tensor or a slice; it reads only the ids asked for (the page cache holds the file once
    for every process on the host) and returns int64 tensors."""

    def __init__(self, path: str, dtype: str, seq_len: int, shift: int):
        import numpy as np
        self.path, self.dtype_name, self.seq_len, self.shift = path, dtype, seq_len, shift
        self.ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.n = (len(self.ids) - 1) // seq_len
        # sample k's ids and its next one's: the file seen as n rows of seq_len + 1 ids, row k starting at k*T (a
        # view: no copy; one row read gives a sample's inputs and targets, as a plain loop's window does)
        item = self.ids.itemsize
        self.windows = np.lib.stride_tricks.as_strided(self.ids, shape=(self.n, seq_len + 1),
                                                       strides=(seq_len * item, item), writeable=False)
        self.dtype, self.shape = torch.int64, (self.n, seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index) -> torch.Tensor:
        import numpy as np
        rows = self.windows[self._index(index), self.shift:self.shift + self.seq_len]
        return torch.from_numpy(rows.astype(np.int64))

    def with_targets(self, targets, index) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(self[index], targets[index]) in one read of the file, where `targets` are these inputs' next tokens
        (the same file and seq_len, shifted by one); None otherwise."""
        import numpy as np
        if not self.pairs_with(targets):
            return None
        rows = self.windows[self._index(index)].astype(np.int64)   # a fresh array: its two parts made contiguous
        return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))

    def pairs_with(self, targets) -> bool:
        """Whether `targets` are these inputs' next tokens: the same file and seq_len, shifted by one."""
        return (isinstance(targets, TokenWindows) and targets.path == self.path and targets.seq_len == self.seq_len
                and self.shift == 0 and targets.shift == 1)

    def _index(self, index):
        import numpy as np
        if isinstance(index, slice):
            index = np.arange(*index.indices(self.n), dtype=np.int64)
        else:
            index = (index if isinstance(index, np.ndarray) else torch.as_tensor(index).numpy()).astype(np.int64,
                                                                                                     copy=False)
        # checked by Python's min and max over a share's few indices: numpy's two reductions took ~27 microseconds
        # more a step in the step loop, where the step before leaves their code cold (docs/training.md)
        listed = index.reshape(-1).tolist()   # a single index too
        if listed and (min(listed) < 0 or max(listed) >= self.n):
            raise IndexError(f"sample index out of range for {self.path} ({self.n} samples)")
        return index

    def is_floating_point(self) -> bool:
        return False

    def __reduce__(self):   # a worker maps the file itself; the mapping never travels
        return TokenWindows, (self.path, self.dtype_name, self.seq_len, self.shift)


def _tokens(train: str, val: str, dtype: str, seq_len: int, vocab_size: int) -> Dataset:
    x_train, y_train = TokenWindows(train, dtype, seq_len, 0), TokenWindows(train, dtype, seq_len, 1)
    if val:
        x_test, y_test = TokenWindows(val, dtype, seq_len, 0), TokenWindows(val, dtype, seq_len, 1)
    else:
        x_test, y_test = torch.zeros(0, seq_len, dtype=torch.int64), torch.zeros(0, seq_len, dtype=torch.int64)
    from engine.config.files import token_meta
    # data.vocab_size, else the tokenizer's (meta.json, `trainyard prepare`'s), else the largest id + 1
    vocab = vocab_size or (token_meta(train) or {}).get("vocab_size") or largest_id(train, dtype)[0] + 1
    return Dataset("tokens", x_train, y_train, x_test, y_test, {"vocab_size": vocab, "seq_len": seq_len})


@functools.lru_cache(maxsize=16)
def _load(name: str, test_fraction: float, seq_len: int, text_chars: int, samples: int,
          features: int, classes: int, seed: int, files: tuple = ()) -> Dataset:
    if name == "tokens":
        train, val, dtype, vocab_size = files
        return _tokens(train, val, dtype, seq_len, vocab_size)
    if name == "digits":
        return _digits(test_fraction, seed)
    if name == "text":
        return _text(seq_len, text_chars, test_fraction, seed)
    if name == "synthetic":
        return _synthetic(samples, features, classes, test_fraction, seed)
    raise ValueError(f"unknown data set {name!r}; choose digits, text, synthetic or tokens")


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """The data set named by cfg: split into train and test by a seeded permutation, or for `tokens`, the
    files as they are (the train file's samples, the val file's as the test split)."""
    # keyed by value, not by cfg (a mutable dataclass is unhashable); batch_size is irrelevant
    files = (cfg.train, cfg.val, cfg.dtype, cfg.vocab_size) if cfg.name == "tokens" else ()
    return _load(cfg.name, cfg.test_fraction, cfg.seq_len, cfg.text_chars, cfg.samples,
                 cfg.features, cfg.classes, seed, files)
