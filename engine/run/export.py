"""A run's model out of its checkpoint: a Hugging Face `save_pretrained` folder, or a LayerList's weights.

    trainyard export runs/llm llm-hf                         # the latest checkpoint, fp32
    trainyard export llm llm-hf --step 200 --dtype bf16 --overwrite
    done = export("runs/llm", "llm-hf")                      # the same in Python: Exported(path, step, ...)
    export_at_end(cfg)                                       # host 0's launcher, after a run of an hf model
    state = read_layer_state("mlp-out")                      # a LayerList export's state dict, ties restored

A Hugging Face model trains as a LayerList whose modules are the model's own (engine/models/hf), so the
export builds the model from its config (nothing downloaded, random weights), loads the checkpoint's
LayerList state dict into that LayerList (which fills the model) and lets transformers write it:
`save_pretrained`'s config.json, generation_config.json, safetensors shards and their index, a tied weight
as transformers expects it. The config comes from `[model] hf_config` / `hf_weights` (a config file's
`name = "hf"`; relative paths are from where the run started), or from `runs/NAME/hf_config/`, which
engine.train writes at the start of a run given a Hugging Face model as an object (keep_hf_config).
Tokenizer files are copied beside it: those of the tokenizer the run's token files were made with (their
meta.json, `trainyard prepare`'s), else those of an `hf_weights` folder.

Any other model (the built-in ones, a user's LayerList) has no class to rebuild here, so its state dict is
written under the LayerList's own keys as one `model.safetensors` (a tied weight stored once under its
first key, the others named in the file's metadata) with a `trainyard.json` saying what it is.

The folder is written as DIR.partial-PID beside DIR and renamed when whole: a failure leaves nothing, and
`overwrite` replaces an existing DIR only then; a full disk (any OSError) is an ExportError naming the disk.
DIR may not be, hold or be inside a path the run writes (run_writes; its hf/ excepted, where the run's end
exports). Refusals (ExportError, CheckpointError) name what is wrong.
Reads checkpoints only through load_into (a Hugging Face model's weights, one tensor at a time), model_state
(a LayerList's state dict), verify (the manifest: step, config, the "tied" keys) and
list_checkpoints (engine/runtime/checkpoint.py), whatever the format of the files behind them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.run.export_tokenizer import copy_run_tokenizer, copy_tokenizer  # noqa: F401 (copy_tokenizer: tests')
from engine.runtime.checkpoint import list_checkpoints, load_into, model_state, verify
from engine.runtime.disk import describe_os_error

HF_CONFIG_DIR = "hf_config"     # in a run directory: the config of a model given to engine.train
END_DIR = "hf"                  # in a run directory: the folder a run of an hf model leaves at its end
LAYERS_FILE, LAYERS_INFO = "model.safetensors", "trainyard.json"
MAX_SHARD_SIZE = "5GB"          # the Hub's usual shard size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ExportError(ValueError):
    """A run that cannot be exported as asked: the reason, naming the run, the step or the folder."""


@dataclass
class Exported:
    path: Path
    step: int
    hugging_face: bool          # a save_pretrained folder; else a LayerList's model.safetensors
    lines: list[str] = field(default_factory=list)   # what was written, for the command to print


@dataclass
class HFSource:
    """Where a Hugging Face model's description is: `config` (a config.json, or a folder holding one) and
    `extras` (the folder its generation_config.json and tokenizer files are taken from, if any)."""
    config: str
    extras: Path | None


def export(run: str | Path, dest: str | Path, *, step: int | None = None, dtype: str = "fp32", overwrite: bool = False,
           max_shard_size: str | int = MAX_SHARD_SIZE, runs_dir: str | Path = "runs") -> Exported:
    """Write the model of `run` (a run folder, or a run name under `runs_dir`) at checkpoint `step` (default:
    the latest) into the folder `dest`, its weights in `dtype` ("fp32" or "bf16")."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    run_dir = find_run(run, Path(runs_dir))
    dest = Path(dest)
    _check_dest(dest, run_dir, overwrite)
    checkpoint = pick_checkpoint(run_dir, step)
    manifest = verify(checkpoint)   # CheckpointError names a damaged file before anything is built
    model_cfg = manifest.get("config", {}).get("model", {})
    source = hf_source(run_dir, model_cfg)
    with _whole_or_nothing(dest, overwrite) as folder:
        if source is not None:
            lines = _write_hugging_face(folder, source, checkpoint, manifest, DTYPES[dtype], max_shard_size)
            lines += copy_run_tokenizer(folder, source.extras, manifest.get("config", {}).get("data", {}))
        else:
            lines = _write_layers(folder, model_state(checkpoint, manifest), DTYPES[dtype], manifest.get("tied", []),
                                  {"step": manifest["step"], "model": model_cfg, "run": str(run_dir)})
    what = "a Hugging Face save_pretrained folder" if source is not None else "a LayerList's state dict"
    return Exported(dest, manifest["step"], source is not None,
                    [f"{dest}: {what}, step {manifest['step']} of {run_dir}, {dtype}", *lines])


def find_run(run: str | Path, runs_dir: Path = Path("runs")) -> Path:
    """`run` as a run folder (one holding config.toml or checkpoints/), else as a run name under `runs_dir`."""
    for candidate in (Path(run), runs_dir / run):
        if _is_run(candidate):
            return candidate
    known = sorted(p.name for p in runs_dir.iterdir() if _is_run(p)) if runs_dir.is_dir() else []
    there = f"runs there: {', '.join(known)}" if known else "it holds none"
    raise ExportError(f"{str(run)!r} is not a run: neither a run folder (with config.toml or checkpoints/) nor the "
                      f"name of one under {runs_dir}/ ({there})")


def _is_run(path: Path) -> bool:
    return path.is_dir() and ((path / "config.toml").is_file() or (path / "checkpoints").is_dir())


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder of `step` in `run_dir`, or its latest; ExportError names the steps there are."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ExportError(f"{run_dir}: the run has no checkpoint (one is written every checkpoint.every steps "
                          f"and at the run's end)")
    if step is None:
        return found[-1]
    by_step = {_step_of(path): path for path in found}
    if step not in by_step:
        raise ExportError(f"{run_dir}: no checkpoint of step {step}; the run has checkpoints of steps "
                          f"{', '.join(str(s) for s in by_step)}")
    return by_step[step]


def _step_of(checkpoint: Path) -> int:
    number = re.search(r"(\d+)$", checkpoint.name)   # step_000200; a folder named otherwise says in its manifest
    return int(number.group(1)) if number else int(verify(checkpoint)["step"])


def run_writes(run_dir: Path) -> list[tuple[Path, str, str, str]]:
    """What a run writes in its folder, and its telemetry log wherever its config puts it: (folder, a pattern
    of names in it, the name shown, what it is). Its hf/ is not here: the run's end exports into it."""
    run_dir = run_dir.resolve()
    written = [(run_dir, "checkpoints", "the run's checkpoints"), (run_dir, "config.toml", "the run's config"),
               (run_dir, "agent", "its agents' logs"), (run_dir, "pids", "its pid files"),
               (run_dir, HF_CONFIG_DIR, "the config this export builds a model given to engine.train from"),
               (run_dir, "update_profile.json", "its update planner's profile")]
    found = [(folder, re.escape(name), name, what) for folder, name, what in written]
    found.append((run_dir, r"user_model\.node\d+\.pt", "user_model.nodeN.pt", "a user's model handed to its workers"))
    for log in {run_dir / "telemetry.jsonl", *_configured_log(run_dir)}:
        found.append((log.parent, re.escape(log.name), log.name, "its telemetry log"))
        found.append((log.parent, rf"{re.escape(log.stem)}\.\d+{re.escape(log.suffix)}", f"{log.stem}.N{log.suffix}",
                      "a part of its telemetry log"))
    return found


def _configured_log(run_dir: Path) -> list[Path]:
    """The telemetry log the run's config.toml names (`[telemetry] log`), if any; relative: from here."""
    try:
        log = tomllib.loads((run_dir / "config.toml").read_text()).get("telemetry", {}).get("log", "")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return []   # no config, or one that does not parse: the default log is still guarded
    return [Path(log).resolve()] if isinstance(log, str) and log else []


def _check_dest(dest: Path, run_dir: Path, overwrite: bool) -> None:
    if dest.resolve() == run_dir.resolve() or dest.resolve() in run_dir.resolve().parents:
        raise ExportError(f"{dest}: it holds the run {run_dir} itself; export into another folder")
    target = dest.resolve()
    for folder, pattern, shown, what in run_writes(run_dir):
        for at in (target, *target.parents):
            if at.parent == folder and re.fullmatch(pattern, at.name):
                where = "it is" if at == target else "it is inside"
                raise ExportError(f"{dest}: {where} {what} ({at}), which the run writes (and --overwrite would "
                                  f"replace); export into another folder")
        if target == folder or target in folder.parents:
            raise ExportError(f"{dest}: it holds {what} ({folder / shown}), which the run writes (and --overwrite "
                              f"would replace); export into another folder")
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest}: a file, not a folder; choose another DIR")
    if dest.exists() and not overwrite:
        raise ExportError(f"{dest} already exists: choose another DIR, or replace it with --overwrite")


@contextmanager
def _whole_or_nothing(dest: Path, overwrite: bool):
    """A folder to write into, beside `dest`, that becomes `dest` when the block ends well (an existing `dest`
    is replaced only then) and is removed if it raises. An OSError (a full disk) becomes an ExportError
    naming the disk and its free bytes."""
    dest = dest.resolve()   # "." and "out/" have a name to put beside
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    try:
        shutil.rmtree(partial, ignore_errors=True)   # a crashed export of this pid's
        partial.mkdir(parents=True)
        yield partial
        _publish(partial, dest, overwrite)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        failed = _os_error(e)
        if failed is None:
            raise
        kept = f"; {dest}, as it was, is untouched" if dest.exists() else ""
        raise ExportError(f"{dest}: the export stopped ({describe_os_error(failed, dest.parent)}); no partial "
                          f"folder is left{kept}") from None


def _publish(partial: Path, dest: Path, overwrite: bool) -> None:
    if not (dest.exists() and overwrite):
        os.replace(partial, dest)
        return
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    os.replace(dest, old)
    try:
        os.replace(partial, dest)
    except OSError:
        os.replace(old, dest)   # the existing folder back, as it was
        raise
    shutil.rmtree(old, ignore_errors=True)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, or the one safetensors' writer (Rust) reports in its text."""
    if isinstance(e, OSError):
        return e
    found = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


# --- a Hugging Face model ----------------------------------------------------------------------------------
def hf_source(run_dir: Path, model_cfg: dict) -> HFSource | None:
    """Where the run's Hugging Face model is described (its checkpoint's [model] section), or None for a run
    of any other model."""
    if model_cfg.get("name") == "hf":
        weights, config = model_cfg.get("hf_weights", ""), model_cfg.get("hf_config", "")
        for key, path in (("hf_config", config), ("hf_weights", weights)):
            if path and not os.path.exists(path):
                raise ExportError(f"model.{key} = {path!r}: no such file or folder (the run's [model] names it; a "
                                  f"relative path is from the folder the run was started in: export from there)")
        extras = weights or (config if os.path.isdir(config) else "")
        return HFSource(config or weights, Path(extras) if extras else None)
    kept = Path(run_dir) / HF_CONFIG_DIR
    if model_cfg.get("name") == "user" and (kept / "config.json").is_file():
        return HFSource(str(kept), kept)
    return None


def _write_hugging_face(folder: Path, source: HFSource, checkpoint: Path, manifest: dict, dtype: torch.dtype,
                        max_shard_size: str | int) -> list[str]:
    from engine.models.hf import _auto_model, _config, layers
    try:
        model = _auto_model().from_config(_config(source.config), dtype=torch.float32)
    except (OSError, ValueError) as e:   # transformers missing, a config it cannot read
        raise ExportError(f"{source.config}: the model cannot be built from it ({e})") from None
    if source.extras is not None and (source.extras / "generation_config.json").is_file():
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(source.extras, local_files_only=True)
    try:   # the LayerList's modules are the model's: loading it fills the model, a tied weight once
        load_into(layers(model, check=False), checkpoint, manifest)   # one tensor in flight at a time
    except RuntimeError as e:
        raise ExportError(f"{checkpoint}: its weights do not fit the model {source.config} describes: {e}") from None
    model.to(dtype)
    with _quiet_transformers():
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return []


@contextmanager
def _quiet_transformers():
    """transformers draws a progress bar per shard written: not a command's output."""
    from transformers.utils import logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def keep_hf_config(cfg, model) -> None:
    """engine.train, once the run directory is prepared: a Hugging Face model given as an object leaves its
    config (and generation config) in runs/NAME/hf_config/, what export builds the model from later; any
    other model removes an earlier run's, which would describe another model. Host 0's launcher only."""
    if cfg.cluster.node_rank != 0:
        return
    kept = cfg.run_dir / HF_CONFIG_DIR
    shutil.rmtree(kept, ignore_errors=True)
    if model is None or not hasattr(getattr(model, "config", None), "to_json_file"):
        return
    kept.mkdir()   # what save_pretrained writes, without the checks that would stop a run before it starts
    model.config.to_json_file(kept / "config.json")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(kept / "generation_config.json")


def export_at_end(cfg) -> Path | None:
    """After a run that ended well, on host 0's launcher: a run of a Hugging Face model is written as
    runs/NAME/hf/ (replacing the previous end's), and a line on stderr says where. Returns the folder, or
    None (another model, another host, `checkpoint.at_end = false`, or an export that failed: the run's result
    stands, a line says why)."""
    if cfg.cluster.node_rank != 0 or not cfg.checkpoint.at_end:   # no checkpoint of the end to export
        return None
    try:
        if hf_source(cfg.run_dir, cfg.to_dict()["model"]) is None:
            return None
        done = export(cfg.run_dir, cfg.run_dir / END_DIR, overwrite=True)
    except Exception as e:   # the trained checkpoint is whole: `trainyard export` can try again
        print(f"trainyard: the model was not written as a Hugging Face folder ({type(e).__name__}: {e}); "
              f"the checkpoint is whole: `trainyard export {cfg.run_dir} DIR` tries again", file=sys.stderr, flush=True)
        return None
    print(f"trainyard: the model, step {done.step}, as a Hugging Face folder (save_pretrained's): {done.path}",
          file=sys.stderr, flush=True)
    return done.path


# --- any other LayerList -----------------------------------------------------------------------------------
def _write_layers(folder: Path, state: dict, dtype: torch.dtype, declared_ties: list, info: dict) -> list[str]:
    """`state` as one safetensors file under its own keys. safetensors refuses two names for one tensor, so a
    tied weight is stored under its first key and its other keys are listed in the file's metadata ("ties")
    and in trainyard.json."""
    from safetensors.torch import save_file
    first = tied_first_keys(state, declared_ties)
    tensors, storages = {}, set()
    for key, tensor in state.items():
        if first.get(key, key) != key:
            continue
        stored = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
        if stored.untyped_storage().data_ptr() in storages or not stored.is_contiguous():
            stored = stored.contiguous().clone()   # a view into another tensor's storage: safetensors refuses it
        storages.add(stored.untyped_storage().data_ptr())
        tensors[key] = stored
    ties: dict[str, list[str]] = {}
    for key, root in first.items():
        if key != root:
            ties.setdefault(root, [root]).append(key)
    tie_lists = list(ties.values())
    save_file(tensors, folder / LAYERS_FILE, metadata={"format": "pt", "ties": json.dumps(tie_lists)})
    (folder / LAYERS_INFO).write_text(json.dumps(
        {"what": "a trainyard LayerList's state dict (LayerList.load_state_dict takes it; engine.run.export."
                 "read_layer_state restores the ties)", "file": LAYERS_FILE, "ties": tie_lists,
         "dtype": str(dtype).removeprefix("torch."), **info}, indent=2))
    return ["not a Hugging Face folder: the run's model is a LayerList (no transformers config to rebuild it "
            f"from), so {LAYERS_FILE} holds its state dict under the LayerList's keys"]


def tied_first_keys(state: dict, declared: list[list[str]]) -> dict[str, str]:
    """{key: the first key of its tied weight} for every key of `state` that is part of a tie: the keys the
    checkpoint declares tied (its manifest's "tied") and the keys that are one tensor (a checkpoint loaded
    with its sharing), each kept only where its values are the first key's."""
    same_tensor: dict[tuple, list[str]] = {}
    for key, t in state.items():
        if t.numel():
            where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            same_tensor.setdefault(where, []).append(key)
    order = {key: i for i, key in enumerate(state)}
    first: dict[str, str] = {}
    for group in [*declared, *same_tensor.values()]:
        keys = sorted({k for k in group if k in state}, key=order.get)
        if len(keys) < 2:
            continue
        root = min((first.get(k, k) for k in keys), key=order.get)
        for key in keys:
            a, b = state[key], state[root]
            if a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
                first[key] = root
    return first


def read_layer_state(folder: str | Path) -> dict:
    """A LayerList export's state dict, every tied key present again (as LayerList.load_state_dict wants)."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    path = Path(folder) / LAYERS_FILE
    state = load_file(path)
    with safe_open(path, "pt") as f:
        ties = json.loads((f.metadata() or {}).get("ties", "[]"))
    for first, *others in ties:
        state.update({key: state[first] for key in others})
    return state
