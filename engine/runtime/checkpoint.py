"""Checkpoints: atomic directories with a manifest of checksums.

    runs/NAME/checkpoints/step_000010/
        manifest.json        step, world size, layout, config, {file: sha256, bytes}
        model.pt             model state (ddp: rank 0 writes it, the ranks hold equal copies)
        optimizer.pt         optimizer state (ddp)
        shard0.pt, ...       sharded: each owner's parameters and optimizer state
        stage0.pt, ...       pipeline: each stage's layers and optimizer state
        rank0.pt, rank1.pt   per-rank RNG states

Every rank writes its files into `step_000010.tmp/`; when all have (a barrier in
the caller), rank 0 writes the manifest and renames the folder. A reader
therefore sees a whole checkpoint or none, and a file that was truncated or
altered later fails its checksum and is refused with its name.
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

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d{6,})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and the file."""


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


def finalize(run_dir: Path, step: int, meta: dict, keep: int) -> Path:
    """Write the manifest over the staged files, publish the folder, prune old ones."""
    staged = staging_dir(run_dir, step)
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(staged.iterdir()) if p.is_file() and not p.name.startswith(".")}
    manifest = {"format": FORMAT_VERSION, "step": step, **meta, "files": files}
    tmp = staged / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, staged / MANIFEST)
    final = checkpoints_dir(run_dir) / f"step_{step:06d}"
    if final.exists():           # the same step written again after a restart
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    prune(run_dir, keep)
    return final


def agree_written(group, rank: int, run_dir: Path, step: int, failed: OSError | None) -> None:
    """Every rank of `group`, after its part of checkpoint `step`: whether any rank's write failed (`failed`,
    a full disk). If one did, every rank raises CheckpointWriteError together (none is left waiting at a
    barrier for one that gave up), rank 0 removes the staged folder, and the previous checkpoint is untouched."""
    import torch.distributed as dist
    flag = torch.tensor([0.0 if failed is None else float(rank + 1)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return
    if rank == 0:
        shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)
    why = f"{failed.strerror or failed}" if failed is not None else f"rank {int(flag.item()) - 1}'s write failed"
    raise write_failed(run_dir, step, why)


def write_failed(run_dir: Path, step: int, why: str) -> CheckpointWriteError:
    """The error that stops a run whose checkpoint `step` could not be written, naming the one to resume from."""
    published = list_checkpoints(run_dir)
    previous = (f"the previous checkpoint, {published[-1]}, is whole: resume from it with --resume {run_dir}"
                if published else "there is no earlier checkpoint")
    return CheckpointWriteError(f"the checkpoint of step {step} could not be written in {checkpoints_dir(run_dir)}: "
                                f"{why}; {previous}")


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
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.fullmatch(p.name).group(1)))


def prune(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in checkpoints_dir(run_dir).glob("step_*.tmp"):
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


def verify(path: Path) -> dict:
    """Read the manifest and check every file's size and checksum; return the manifest."""
    manifest_path = Path(path) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path}: corrupted ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or "files" not in manifest:
        raise CheckpointError(f"{manifest_path}: not a trainyard checkpoint manifest (format "
                              f"{FORMAT_VERSION} expected)")
    for name, want in manifest["files"].items():
        file = Path(path) / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{file}: truncated or altered ({size} bytes, manifest says {want['bytes']})")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file}: corrupted (checksum does not match the manifest)")
    return manifest


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


def check_world_size(source: Path, manifest: dict, world_size: int) -> None:
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"{source}: written by {manifest['world_size']} workers; this run has "
                              f"{world_size} (parallel.world_size must match to resume)")


def check_strategy(source: Path, manifest: dict, name: str) -> None:
    """A checkpoint resumes only under the parallel strategy that wrote it (their files differ)."""
    wrote = manifest.get("layout", {}).get("strategy", "unknown")
    if wrote != name:
        raise CheckpointError(f"{source}: written by a {wrote!r} run; this run is {name!r} "
                              f"(resume with the parallel.strategy that wrote it)")


def check_precision(source: Path, manifest: dict, precision: dict) -> None:
    """A checkpoint resumes only in the precision that wrote it: its files hold that run's working weights
    and fp32 masters (a checkpoint from before `[precision]` existed is fp32)."""
    saved = {"compute": "fp32", "params": "fp32", "reduce": "fp32", **manifest.get("config", {}).get("precision", {})}
    for key in ("compute", "params", "reduce"):
        if saved[key] != precision[key]:
            raise CheckpointError(f"{source}: written with precision.{key} = \"{saved[key]}\"; this run has "
                                  f"precision.{key} = \"{precision[key]}\" (resume in the precision the run was "
                                  f"started with)")


def model_state(path: Path) -> dict:
    """The whole model's state dict from a verified checkpoint, whichever strategy wrote it."""
    manifest = verify(path)
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


def tied_keys(model) -> list[list[str]]:
    """The state-dict keys of each tied weight (LayerList.ties): a sharded or parameter-server checkpoint holds
    it once, and model_state gives it under every key, as the model's own state_dict does."""
    index = {name: i for i, name in enumerate(getattr(model, "names", []))}
    return [[f"layers.{index[layer]}.{param}" for layer, param in tie] for tie in getattr(model, "ties", [])]
