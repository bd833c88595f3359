"""A format-2/3 checkpoint's files (engine/runtime/checkpoint.py): one safetensors file per rank, every
tensor under its global name, and the reader that takes from them what a rank holds in any job shape, by name.

    write_rank_file(staged, rank, weights, optimizer, rng, extra)   # rank{rank}.safetensors, the step in its header
    write_tensors(staged, rank, *rank_tensors(weights, optimizer, rng))   # the same, in two parts (a snapshot's)
    index_of(staged)                          # the manifest's index: which file holds each name
    with Reader(path, manifest) as reader:    # one tensor at a time
        reader.weight("layers.3.fc.weight")

The files are safetensors files (safetensors, transformers and other tools read them), written and read here
one tensor at a time: safetensors' writer wants every tensor on the host at once, and its reader maps the
file, whose pages then count in the process's resident memory until it is closed. Imports torch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the file."""


WEIGHTS, OPTIMIZER, RNG = "weights/", "optimizer/", "rng/"


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


_STEP_FOLDER = re.compile(r"step_(\d{6,})(\.tmp)?")


def folder_step(folder: Path) -> int | None:
    """The step a checkpoint folder's name says (step_000020, or its staging folder step_000020.tmp), or None."""
    found = _STEP_FOLDER.fullmatch(Path(folder).name)
    return int(found.group(1)) if found else None


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def write_rank_file(directory: Path, rank: int, weights: dict, optimizer: dict, rng: dict,
                    extra: dict | None = None, step: int | None = None) -> dict:
    """Rank `rank`'s part of a checkpoint: `weights` ({state_dict key: tensor}, the fp32 master where there is
    one), `optimizer` ({parameter name: {"exp_avg": tensor, "step": ...}}: named_state's form), `rng`
    ({"torch": ..., "cuda": ...}) and a strategy's `extra` (JSON), as one safetensors file (write_tensors).
    The tensors may be the live ones, on any device: each is copied to the host as it is written, one at a
    time (safetensors' own writer wants them all on the host at once). Returns {"sha256", "bytes"}."""
    return write_tensors(directory, rank, *rank_tensors(weights, optimizer, rng), extra=extra, step=step)


def rank_tensors(weights: dict, optimizer: dict, rng: dict) -> tuple[dict, dict, dict]:
    """What a rank file holds, by its names: ({name: tensor}, {alias: name}, {optimizer scalar: value}). A
    tensor two names share (a tied weight) is held once, its other names aliases."""
    tensors, aliases, scalars, seen = {}, {}, {}, {}

    def put(name: str, value: torch.Tensor) -> None:
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               value.dtype)
        if value.numel() and key in seen:
            aliases[name] = seen[key]
            return
        seen[key] = name
        tensors[name] = value.detach()

    for key, value in weights.items():
        put(WEIGHTS + key, value)
    for name, entry in optimizer.items():
        for stat, value in entry.items():
            if torch.is_tensor(value):
                put(f"{OPTIMIZER}{name}/{stat}", value)
            else:
                scalars[f"{name}/{stat}"] = value
    for key, value in rng.items():
        put(RNG + key, value)
    return tensors, aliases, scalars


def checksum_file(directory: Path, name: str) -> Path:
    """Where a rank file's writer leaves the sha256 of the bytes it wrote (finalize reads it, not the file)."""
    return Path(directory) / f".{name}.sha256"


CHUNK = 64 << 20   # bytes written (and hashed, on another thread) at a time


def write_tensors(directory: Path, rank: int, tensors: dict, aliases: dict, scalars: dict,
                  extra: dict | None = None, step: int | None = None) -> dict:
    """rank_tensors' parts as rank{rank}.safetensors, written under a temporary name, fsynced and renamed. The
    header holds the checkpoint's `step` (default: the one `directory`'s name says, step_NNNNNN.tmp), which a
    reader checks against the manifest's (check_step). The sha256 is of the bytes as they are written (a
    thread hashes each chunk while the next one is written: no read back), left beside the file in
    checksum_file for finalize; returns {"sha256", "bytes"}."""
    table, offset = {}, 0
    for name, value in tensors.items():
        size = value.numel() * value.element_size()
        table[name] = {"dtype": _CODES[value.dtype], "shape": list(value.shape), "data_offsets": [offset, offset + size]}
        offset += size
    step = folder_step(directory) if step is None else step
    own = {"aliases": aliases, "optimizer_scalars": scalars, "extra": extra or {}}
    table["__metadata__"] = {"trainyard": json.dumps(own if step is None else {"step": step, **own})}
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)   # the data starts 8-byte aligned, as safetensors writes it
    directory.mkdir(parents=True, exist_ok=True)
    name = rank_file(rank)
    tmp = directory / f".{name}.partial"
    digest = _Hashing()
    try:
        with open(tmp, "wb") as f:
            first = len(head).to_bytes(8, "little") + head
            f.write(first)
            digest.update(first)
            for value in tensors.values():
                host = value.to("cpu").contiguous().reshape(-1)   # a device's tensor: this one's copy only
                data = memoryview(host.view(torch.uint8).numpy()) if host.numel() else memoryview(b"")
                for at in range(0, len(data), CHUNK):
                    f.write(data[at:at + CHUNK])
                    digest.update(data[at:at + CHUNK], keep=host)
            f.flush()
            os.fsync(f.fileno())
        written = {"sha256": digest.hexdigest(), "bytes": 8 + len(head) + offset}
        checksum_file(directory, name).write_text(json.dumps(written))
    except BaseException:
        digest.close()
        tmp.unlink(missing_ok=True)   # a full disk (OSError), or anything else: no half-written file
        checksum_file(directory, name).unlink(missing_ok=True)
        raise
    os.replace(tmp, directory / name)
    return written


class _Hashing:
    """sha256 on a thread of its own, one chunk behind the writer (hashlib lets go of the GIL over a big
    buffer): a file is hashed at the disk's speed, not at the sum of both."""

    def __init__(self):
        import hashlib
        from concurrent.futures import ThreadPoolExecutor
        self.h = hashlib.sha256()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="trainyard-sha256")
        self.pending = None

    def update(self, data, keep=None) -> None:
        if self.pending is not None:
            self.pending.result()
        self.pending = self.pool.submit(lambda: (self.h.update(data), keep))   # `keep`: the chunk's tensor alive

    def hexdigest(self) -> str:
        if self.pending is not None:
            self.pending.result()
        self.close()
        return self.h.hexdigest()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _table(file: Path) -> tuple[dict, dict, int]:
    """A safetensors file's table ({name: its header entry: dtype, shape, data_offsets}), trainyard's header,
    and where the data starts, from its first bytes; CheckpointError naming the file where they do not parse
    (a reader that did not check the file's checksum)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > os.fstat(f.fileno()).st_size - 8:
            raise CheckpointError(f"{file}: corrupted (its header's length runs past the file's end)")
        try:
            table = json.loads(f.read(size))
            meta = json.loads(table.pop("__metadata__", {}).get("trainyard", "{}"))
            if not isinstance(meta, dict):
                raise ValueError("trainyard's header is not an object")
        except (ValueError, AttributeError) as e:   # JSON, UTF-8, or a table that is not one
            raise CheckpointError(f"{file}: corrupted (its header does not parse: {e})") from None
    return table, meta, 8 + size


def check_step(file: Path, meta: dict, step: int, required: bool) -> None:
    """A rank file's header says the step of the checkpoint it belongs to (format 3; `required`): it must be
    the manifest's `step`. A format-2 file has none and is checked only where it has one."""
    if "step" not in meta:
        if required:
            raise CheckpointError(f"{file}: its header holds no step (the manifest says step {step}): a file of "
                                  f"another checkpoint, or altered")
        return
    if meta["step"] != step:
        raise CheckpointError(f"{file}: its header says step {meta['step']}; the manifest says step {step} "
                              f"(a file of another checkpoint)")


def rank_header(file: Path) -> tuple[dict, dict]:
    """A safetensors file's tensors ({name: (shape, dtype)}) and trainyard's header."""
    table, meta, _ = _table(file)
    return {k: (v["shape"], v["dtype"]) for k, v in table.items()}, meta


class RankFile:
    """One rank file read a tensor at a time into memory of its own, with plain reads. (safetensors' safe_open
    maps the whole file, and every page a read touches stays in the process's resident memory until the file
    is closed: loading a 1.2 GB rank file that way raised a rank's RSS by the file's size.)"""

    def __init__(self, file: Path):
        self.file = file
        self.table, self.meta, self.start = _table(file)
        self.handle = open(file, "rb")

    def keys(self) -> list[str]:
        return list(self.table)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.table[name]
        begin, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        self.handle.seek(self.start + begin)
        if end > begin and self.handle.readinto(view) != end - begin:
            raise CheckpointError(f"{self.file}: {name} ends past the file's end (truncated)")
        return out

    def close(self) -> None:
        self.handle.close()


def index_of(directory: Path) -> dict:
    """Where each tensor of a staged checkpoint (format 2 or 3) is: {"weights": {key: [file, shape, dtype]},
    "optimizer": {parameter name: file}, "rng": {rank: file}, "extra": {file: extra}} (the manifest's index)."""
    index: dict = {"weights": {}, "optimizer": {}, "rng": {}, "extra": {}}
    for file in sorted(Path(directory).glob("rank*.safetensors")):
        tensors, meta = rank_header(file)
        for name, (shape, dtype) in tensors.items():
            if name.startswith(WEIGHTS):
                index["weights"].setdefault(name[len(WEIGHTS):], [file.name, shape, dtype])
            elif name.startswith(OPTIMIZER):
                index["optimizer"].setdefault(name[len(OPTIMIZER):].rsplit("/", 1)[0], file.name)
        for alias, target in meta.get("aliases", {}).items():
            if alias.startswith(WEIGHTS):
                index["weights"].setdefault(alias[len(WEIGHTS):], [file.name, *tensors[target]])
        for entry in meta.get("optimizer_scalars", {}):
            index["optimizer"].setdefault(entry.rsplit("/", 1)[0], file.name)
        if any(n.startswith(RNG) for n in tensors):
            index["rng"][file.name[len("rank"):-len(".safetensors")]] = file.name
        if meta.get("extra"):
            index["extra"][file.name] = meta["extra"]
    return index


class Reader:
    """A format-2 or 3 checkpoint read by name, one tensor at a time (what a rank holds in the new job shape, and
    nothing else: a tensor read is the caller's to copy and drop).

        with Reader(path, manifest) as reader:
            reader.weight("layers.3.fc.weight")        # fp32 master, or the working weight; a tied name too
            reader.optimizer["layers.3.fc.weight"]     # {"exp_avg": ..., "step": ...}, or KeyError
            reader.rng(rank)                           # {"torch": ...} or None
    """

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = Path(path), manifest
        self.index = manifest["index"]
        self.tied = {k: group for group in manifest.get("tied", []) for k in group}
        self._files: dict = {}
        self._meta: dict = {}
        self.optimizer = _OptimizerEntries(self)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def weight_keys(self) -> list[str]:
        keys = list(self.index["weights"])
        return keys + [k for k in self.tied if k not in self.index["weights"] and self.holder(k) is not None]

    def holder(self, key: str) -> str | None:
        """The name `key` is written under: its own, or that of the tied weight it is one with."""
        if key in self.index["weights"]:
            return key
        return next((k for k in self.tied.get(key, ()) if k in self.index["weights"]), None)

    def spec(self, key: str, shape: tuple | None = None) -> list:
        """[file, shape, dtype] of weight `key`; CheckpointError where it is missing or (given `shape`) another
        shape: the checkpoint is another model's."""
        holder = self.holder(key)
        if holder is None:
            raise CheckpointError(f"{self.path}: holds no weight {key!r} (a checkpoint of another model: resume "
                                  f"with the model the run was started with)")
        found = self.index["weights"][holder]
        if shape is not None and tuple(found[1]) != tuple(shape):
            raise CheckpointError(f"{self.path}: its {key!r} is {tuple(found[1])}; this model's is {tuple(shape)} "
                                  f"(a checkpoint of another model: resume with the model the run was started with)")
        return found

    def _open(self, file: str) -> RankFile:
        if file not in self._files:
            opened = RankFile(self.path / file)
            try:   # verify checked it already, against the manifest; a caller's own manifest is checked here
                check_step(opened.file, opened.meta, int(self.manifest["step"]),
                           required=self.manifest.get("format", 0) >= 3)
            except CheckpointError:
                opened.close()
                raise
            self._files[file] = opened
        return self._files[file]

    def _layout(self, file: str) -> tuple[dict, dict]:
        """A file's trainyard header, and its optimizer entries: {parameter name: {stat: tensor name or a
        scalar}} (read once per file)."""
        if file not in self._meta:
            tensors, meta = self._open(file).table, self._open(file).meta
            entries: dict = {}
            names = [*tensors, *meta.get("aliases", {})]
            for name in names:
                if name.startswith(OPTIMIZER):
                    param, stat = name[len(OPTIMIZER):].rsplit("/", 1)
                    entries.setdefault(param, {})[stat] = meta.get("aliases", {}).get(name, name)
            for entry, value in meta.get("optimizer_scalars", {}).items():
                param, stat = entry.rsplit("/", 1)
                entries.setdefault(param, {})[stat] = (value,)   # a scalar, not a tensor's name
            self._meta[file] = (meta, entries)
        return self._meta[file]

    def stored(self, key: str, shape: tuple | None = None) -> tuple[str, str]:
        """(file, tensor name) weight `key` is stored under: a tied or aliased name gives its holder's."""
        file = self.spec(key, shape)[0]
        name = WEIGHTS + self.holder(key)
        return file, self._layout(file)[0].get("aliases", {}).get(name, name)

    def weight(self, key: str, shape: tuple | None = None) -> torch.Tensor:
        file, name = self.stored(key, shape)
        return self._open(file).get_tensor(name)

    def optimizer_entry(self, name: str) -> dict | None:
        """Parameter `name`'s optimizer state ({"exp_avg": ..., "step": ...}), or None where the checkpoint
        has none (a parameter never updated, or a run that had not stepped)."""
        file = self.index["optimizer"].get(name)
        if file is None:
            return None
        handle = self._open(file)
        return {stat: where[0] if isinstance(where, tuple) else handle.get_tensor(where)
                for stat, where in self._layout(file)[1].get(name, {}).items()}

    def rng(self, rank: int) -> dict | None:
        file = self.index["rng"].get(str(rank))
        if file is None:
            return None
        handle = self._open(file)
        return {k[len(RNG):]: handle.get_tensor(k) for k in handle.keys() if k.startswith(RNG)}

    def extras(self) -> dict:
        """Every file's strategy extras merged ({key: {...}}: a parameter server's per-layer versions)."""
        merged: dict = {}
        for extra in self.index["extra"].values():
            for key, value in extra.items():
                merged.setdefault(key, {}).update(value)
        return merged


class _OptimizerEntries:
    """reader.optimizer: the optimizer state by parameter name, read when asked (load_named_state's `state`)."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __contains__(self, name: str) -> bool:
        return name in self.reader.index["optimizer"]

    def __getitem__(self, name: str) -> dict:
        entry = self.reader.optimizer_entry(name)
        if entry is None:
            raise KeyError(name)
        return entry
