"""Checkpoints: atomic directories with a manifest of checksums, every tensor under its global name.

    runs/NAME/checkpoints/step_000010/
        manifest.json          step, world size, layout, config, ties, {file: sha256, bytes}, and the index:
                               each weight's and each parameter's optimizer state's file, shape and dtype
        rank0.safetensors ...  what rank 0 holds: "weights/layers.3.fc.weight" (the fp32 master where there is
                               one), "optimizer/layers.3.fc.weight/exp_avg", "rng/torch"; its header's metadata
                               the optimizer's scalars, a tied tensor's other names, a strategy's own extras

Format 2 and 3 are the same for every strategy and job shape: a parameter has one global name
(the model's own state_dict key), and trainyard owns whole parameters (a sharded run's owner, a pipeline's
stage, a parameter server's server), so a name is all a resume at another world size or strategy needs:
each rank reads the names it holds in the new shape, one tensor at a time, from whichever files hold them
(Reader, in checkpoint_files.py). Why not torch.distributed.checkpoint: its resharding is for a tensor split across ranks, which
trainyard never does; its load is a collective of the group that reads, which a parameter server's
servers (a group without their workers) and `trainyard export` (no group) do not have; and safetensors files
are what export and other tools read. Format 3 (FORMAT_VERSION) is format 2 with the manifest's own
checksum (`manifest_sha256`, over the canonical JSON of its other fields) and the step in every rank file's
header. Format 2 (written earlier) still resumes and exports, its step checked against its folder's name
and its index against its files' headers (verify). Format 1 (one file layout per strategy, .pt files; before
2026-11-26) is read for its weights (model_state: export, engine.train's final weights), and refused for a
resume by check_format, which says what to do.

Every rank writes its file into `step_000010.tmp/` (in the background, hashing as it writes: the step loop's
engine/run/checkpointer.py); when all have (the ranks agree through the step boundary's exchange, or a
parameter server's answers), rank 0 writes the manifest and renames the folder. A reader therefore sees a whole checkpoint or none, and a file that was
truncated or altered later fails its checksum and is refused with its name: a rank file against the
manifest's, the manifest against its own, a step against the folder's name and each rank file's header.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from engine.runtime.checkpoint_files import (CheckpointError, Reader, check_step, checksum_file, folder_step,
                                             index_of, rank_file, rank_header, write_rank_file)
from engine.runtime.disk import disk_words

__all__ = ["CheckpointError", "CheckpointWriteError", "Reader", "index_of", "rank_file", "write_rank_file"]

MANIFEST = "manifest.json"
MANIFEST_SHA = "manifest_sha256"   # the manifest's own checksum, over its other fields (manifest_checksum)
FORMAT_VERSION = 3
RESUME_FORMATS = (2, 3)  # format 2: no checksum of its own, no step in its rank files (verify checks less)
READ_FORMATS = (1, 2, 3)  # format 1: weights only (model_state); a resume refuses it (check_format)


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk): the run stops, the previous checkpoint whole."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}.tmp"


def write_file(directory: Path, name: str, obj) -> None:
    """torch.save into a temporary name, fsync, rename: never a half-written file under `name`."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.partial"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)   # an object that does not save leaves nothing behind
        raise
    os.replace(tmp, directory / name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_checksum(manifest: dict) -> str:
    """The sha256 of a manifest's content, its own checksum left out: of its canonical JSON (sorted keys, no
    whitespace), so a byte of the file that changes no value (whitespace) changes nothing it says."""
    content = {k: v for k, v in manifest.items() if k != MANIFEST_SHA}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def finalize(run_dir: Path, step: int, meta: dict, keep: int) -> Path:
    """Write the manifest over the staged files, publish the folder, prune old ones. A file's checksum is the
    one its writer took of the bytes it wrote (checksum_file), where that is there and its size is the file's;
    otherwise the file is read."""
    staged = staging_dir(run_dir, step)
    files = {p.name: _written(p) for p in sorted(staged.iterdir()) if p.is_file() and not p.name.startswith(".")}
    # the checksum is of what a reader parses: a tuple or an int key as JSON gives them back
    manifest = json.loads(json.dumps({"format": FORMAT_VERSION, "step": step, **meta, "files": files,
                                      "index": index_of(staged)}))
    manifest[MANIFEST_SHA] = manifest_checksum(manifest)
    for name in files:
        checksum_file(staged, name).unlink(missing_ok=True)
    tmp = staged / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, staged / MANIFEST)
    final = checkpoints_dir(run_dir) / f"step_{step:06d}"
    if final.exists():           # the same step written again after a restart
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    prune(run_dir, keep, before=step)
    return final


def _written(path: Path) -> dict:
    size = path.stat().st_size
    try:
        said = json.loads(checksum_file(path.parent, path.name).read_text())
        if said.get("bytes") == size and isinstance(said.get("sha256"), str):
            return {"sha256": said["sha256"], "bytes": size}
    except (OSError, ValueError, AttributeError):
        pass
    return {"sha256": _sha256(path), "bytes": size}


def write_failed(run_dir: Path, step: int, why: str) -> CheckpointWriteError:
    """The error that stops a run whose checkpoint `step` could not be written, naming the disk (its free
    bytes) and the checkpoint to resume from."""
    published = list_checkpoints(run_dir)
    previous = (f"the previous checkpoint, {published[-1]}, is whole: resume from it with --resume {run_dir}"
                if published else "there is no earlier checkpoint")
    return CheckpointWriteError(f"the checkpoint of step {step} could not be written in {checkpoints_dir(run_dir)}: "
                                f"{why} ({disk_words(checkpoints_dir(run_dir))}); {previous}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Published checkpoints, oldest first (staging folders are not listed)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp") and folder_step(p) is not None]
    return sorted(found, key=folder_step)


def latest_said(run_dir: Path) -> str:
    """Where a stopped run can go on from, in words: its latest checkpoint (each is whole: published only once
    written), or that there is none."""
    saved = list_checkpoints(run_dir)
    return f"latest checkpoint: {saved[-1]}" if saved else "no checkpoint was written"


def prune(run_dir: Path, keep: int, before: int | None = None) -> None:
    """Keep the newest `keep` checkpoints; remove the staged folders of steps before `before` (all, if None):
    a later step's may be being written (a background write, engine/runtime/checkpoint_writer.py)."""
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    remove_staged(run_dir, before)


def remove_staged(run_dir: Path, before: int | None = None) -> None:
    """Staged folders no rank is writing: those a checkpoint left when a rank stopped or failed before it was
    published (the launcher's, at the run's start and end; the next checkpoint's: those of earlier steps)."""
    for stale in checkpoints_dir(run_dir).glob("step_*.tmp"):
        if before is None or (folder_step(stale) is not None and folder_step(stale) < before):
            shutil.rmtree(stale, ignore_errors=True)


def resolve(path: Path) -> Path:
    """A checkpoint folder, or a run directory (its latest checkpoint)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    found = list_checkpoints(path)
    if not found:
        if path.name.startswith("step_"):
            raise CheckpointError(f"{path / MANIFEST}: missing; the checkpoint is incomplete")
        raise CheckpointError(f"{path}: no checkpoint in this directory (expected {MANIFEST} "
                              f"or checkpoints/step_NNNNNN/)")
    return found[-1]


def verify(path: Path, checksums: bool = True) -> dict:
    """Read the manifest, check its own checksum, its step against the folder's name and every rank file's
    header, and every file's size and checksum; return the manifest. `checksums=False`: the files' sizes and
    headers only (a checkpoint the launcher verified before any worker started: one pass over the files, not
    one per rank)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path}: corrupted ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: corrupted (not a JSON object)")
    # Checked wherever there is one: a format 3 whose "format" was flipped to 2 or 1 is still refused.
    if MANIFEST_SHA in manifest or manifest.get("format") == 3:
        if MANIFEST_SHA not in manifest:
            raise CheckpointError(f"{manifest_path}: corrupted (its checksum, {MANIFEST_SHA}, is missing)")
        if manifest[MANIFEST_SHA] != manifest_checksum(manifest):
            raise CheckpointError(f"{manifest_path}: corrupted (its checksum does not match)")
    if manifest.get("format") not in READ_FORMATS or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: not a trainyard checkpoint manifest (format "
                              f"{' or '.join(map(str, READ_FORMATS))} expected)")
    try:
        _check_files(path, manifest, checksums)
    except (KeyError, TypeError, AttributeError, ValueError) as e:   # a format-2 manifest: no checksum of its own
        raise CheckpointError(f"{manifest_path}: corrupted ({type(e).__name__}: {e})") from None
    return manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_files(path: Path, manifest: dict, checksums: bool) -> None:
    """verify's checks past the manifest's own: the step, every file, the rank files' headers."""
    manifest_path, step = path / MANIFEST, manifest.get("step")
    if not _is_int(step):
        raise CheckpointError(f"{manifest_path}: corrupted (its step is {step!r}, not a number)")
    named = folder_step(path.resolve())
    if named is not None and named != step:
        raise CheckpointError(f"{manifest_path}: says step {step}, but its folder's name {path.resolve().name} says "
                              f"step {named}")
    for name, want in manifest["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{file}: truncated or altered ({size} bytes, manifest says {want['bytes']})")
        if checksums and _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file}: corrupted (checksum does not match the manifest)")
    if manifest["format"] not in RESUME_FORMATS:
        return
    for name in manifest["files"]:
        if name.endswith(".safetensors"):
            _, meta = rank_header(path / name)
            check_step(path / name, meta, step, required=manifest["format"] >= 3)
    if manifest["format"] == 2 and manifest.get("index") != index_of(path):
        # format 2's manifest has no checksum of its own: its index must be what its (checksummed) files hold
        raise CheckpointError(f"{manifest_path}: corrupted (its index is not what the rank files' headers hold)")


def verify_or_offer(path: Path) -> dict:
    """verify(path); where the checkpoint is damaged, the error also offers the newest earlier checkpoint of
    the same run that verifies (what `--resume` can take instead), if there is one."""
    try:
        return verify(path)
    except CheckpointError as e:
        path = Path(path)
        earlier = [c for c in list_checkpoints(path.parent.parent) if c.name < path.name]
        for candidate in reversed(earlier):
            try:
                step = verify(candidate)["step"]
            except CheckpointError:
                continue
            raise CheckpointError(f"{e}. The previous checkpoint verifies (step {step}): resume from it with "
                                  f"--resume {candidate}") from None
        raise


def load_file(path: Path, name: str):
    file = Path(path) / name
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:   # verified already; this catches a file the manifest never described
        raise CheckpointError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None


def resume_source(run_dir: Path, requested: Path | None, restart: int) -> Path | None:
    """Where a worker resumes: after an elastic restart, the newest checkpoint that verifies (a damaged
    one is skipped with a line on stderr); otherwise, or if none does, the one asked for (or None)."""
    if restart > 0:
        for candidate in reversed(list_checkpoints(run_dir)):
            try:
                verify(candidate)
                return candidate
            except CheckpointError as e:
                print(f"trainyard: skipping a damaged checkpoint: {e}", file=sys.stderr, flush=True)
    return requested


def check_format(source: Path, manifest: dict) -> None:
    """A resume reads formats 2 and 3; a format-1 checkpoint is refused naming its format and what to do."""
    if manifest.get("format") not in RESUME_FORMATS:
        raise CheckpointError(
            f"{source}: written in trainyard's checkpoint format {manifest.get('format')} (one file layout per "
            f"strategy, before 2026-11-26), which this version does not resume (it resumes formats "
            f"{' and '.join(map(str, RESUME_FORMATS))}: any world size and strategy). Finish the run with the "
            f"trainyard that wrote it, or start afresh from its weights: `trainyard export RUN DIR`, then "
            f"model.hf_weights = DIR (a Hugging Face model; the optimizer state and the step are not carried)")


def check_optimizer(source: Path, manifest: dict, name: str) -> None:
    """The optimizer state carries over only to the same kind of optimizer (its statistics differ)."""
    saved = manifest.get("config", {}).get("optim", {}).get("name")
    if saved is not None and saved != name:
        raise CheckpointError(f"{source}: its optimizer state is {saved!r}'s; this run has optim.name = "
                              f"{name!r} (resume with the optimizer the run was started with)")


def check_shapes(source: Path, manifest: dict, model: torch.nn.Module) -> None:
    """Every entry of `model`'s state dict is in the checkpoint, with its shape: another model is refused by
    the first name that differs (a user's model, which the config's [model] does not describe)."""
    reader = Reader(source, manifest)
    for key, value in model.state_dict().items():
        reader.spec(key, tuple(value.shape))


def check_precision(source: Path, manifest: dict, precision: dict) -> None:
    """A checkpoint resumes only in the precision that wrote it: its files hold that run's working weights
    and fp32 masters (a checkpoint from before `[precision]` existed is fp32)."""
    saved = {"compute": "fp32", "params": "fp32", "reduce": "fp32", **manifest.get("config", {}).get("precision", {})}
    for key in ("compute", "params", "reduce"):
        if saved[key] != precision[key]:
            raise CheckpointError(f"{source}: written with precision.{key} = \"{saved[key]}\"; this run has "
                                  f"precision.{key} = \"{precision[key]}\" (resume in the precision the run was "
                                  f"started with)")


def model_state(path: Path, manifest: dict | None = None) -> dict:
    """The whole model's state dict from a checkpoint, whichever strategy and job shape wrote it (format 1
    too): the fp32 masters where the run kept them, a tied weight one tensor under every key. Verified first,
    unless `manifest` (verify's) says it was."""
    manifest = manifest or verify(path)
    if manifest["format"] in RESUME_FORMATS:
        with Reader(path, manifest) as reader:
            held: dict = {}   # (file, tensor) -> the tensor read: a tied weight is one tensor under every key
            state = {}
            for key in reader.weight_keys():
                where = reader.stored(key)
                if where not in held:
                    held[where] = reader.weight(key)
                state[key] = held[where]
            return state
    files = manifest["files"]
    if "model.pt" in files:
        return load_file(path, "model.pt")
    shards = sorted((n for n in files if re.fullmatch(r"(shard|stage|server)\d+\.pt", n)),
                    key=lambda n: int(re.search(r"\d+", n).group()))
    if not shards:
        raise CheckpointError(f"{path}: holds neither model.pt nor shard, stage or server files")
    state = {}
    for name in shards:
        shard = load_file(path, name)
        state.update(shard["params"])
        state.update(shard.get("buffers") or {})
    for keys in manifest.get("tied", []):   # a tied weight is written once, under its first holder's name
        held = next((state[k] for k in keys if k in state), None)
        if held is not None:
            state.update({k: held for k in keys if k not in state})
    return state


def load_into(module: torch.nn.Module, path: Path, manifest: dict | None = None) -> None:
    """`module` (the whole model) takes a checkpoint's weights in place, on whatever devices its tensors are:
    by name, one tensor in flight at a time (a format-1 checkpoint: its whole state dict at once). Another
    model's checkpoint is refused naming the first key that differs. Verified first, unless `manifest` says
    it was."""
    manifest = manifest or verify(path)
    if manifest["format"] not in RESUME_FORMATS:
        module.load_state_dict(model_state(path, manifest))
        return
    own = module.state_dict(keep_vars=True)
    with Reader(path, manifest) as reader, torch.no_grad():
        extra = sorted(set(reader.weight_keys()) - set(own))
        if extra:
            raise CheckpointError(f"{path}: holds {extra[0]!r}, which this model has not (a checkpoint of "
                                  f"another model)")
        for key, value in own.items():
            value.copy_(reader.weight(key, tuple(value.shape)))


def tied_keys(model) -> list[list[str]]:
    """The state-dict keys of each tied weight (LayerList.ties): a sharded or parameter-server checkpoint holds
    it once, and model_state gives it under every key, as the model's own state_dict does."""
    index = {name: i for i, name in enumerate(getattr(model, "names", []))}
    return [[f"layers.{index[layer]}.{param}" for layer, param in tie] for tie in getattr(model, "ties", [])]
