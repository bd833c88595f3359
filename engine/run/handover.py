"""A user's model and data, handed to the workers without sharing the caller's memory, and the run's
final weights handed back.

    hand_over(job)                       # the launcher, before any worker starts
    model = received_model(job)          # each worker: a model of its own, on the CPU
    load_final_weights(model, run_dir)   # engine.train, after the run: the caller's model holds its result

Why not pickle the model to the workers: the launcher spawns them, and multiprocessing pickles their
arguments with torch's reductions, which move every CPU tensor's storage into shared memory (and send
a CUDA tensor as an IPC handle to the same GPU memory). The caller's parameters then became the
workers' parameters: two data-parallel ranks updating "their" copy in place updated one tensor twice,
and the caller's model changed under it during the run.

So the launcher saves the model (torch.save: its structure and weights, a parameter shared by two
layers saved once) to a file in the run directory, and each worker loads its own copy from it, on
the CPU, before moving it to its device; a restarted worker reads the same file. The data, which
workers only read, goes as one private copy in shared memory that every worker on this host maps:
the caller's tensors are never moved or written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine.training.data import Dataset
from engine.models import LayerList
from engine.runtime import checkpoint as ckpt


class HandoverError(RuntimeError):
    """The user's model cannot be handed to the workers (it does not pickle), or the file the workers
    read it from is not a LayerList."""


def model_file(run_dir: Path, node_rank: int) -> Path:
    """Where host `node_rank`'s launcher leaves the user's model for its workers (removed when the run ends)."""
    return Path(run_dir) / f"user_model.node{node_rank}.pt"


def hand_over(job) -> None:
    """Once per launch, before the workers start: the user's model to a file they load (job.model_file),
    and the user's data to a private copy in shared memory (job.data). `job.model` stays the caller's
    object, for the launcher alone: a Job that is pickled leaves it out (engine/run/rank.py,
    Job.__getstate__)."""
    if job.model is not None:
        path = model_file(job.config.run_dir, job.config.cluster.node_rank)
        try:
            ckpt.write_file(path.parent, path.name, job.model)
        except Exception as e:
            raise HandoverError(f"the model cannot be handed to the workers: torch.save failed with "
                                f"{type(e).__name__}: {e} (define your layers' classes at module level, "
                                f"and give them no lambdas or open files)") from None
        job.model_file = path
    if job.data is not None:
        job.data = shared_copy(job.data)


def shared_copy(data: Dataset) -> Dataset:
    """`data` with each tensor copied, on the CPU, into shared memory: the workers map that one copy
    (read-only; engine/training/data.py), and the caller's tensors are neither moved nor written."""
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            fields[name] = value.detach().to("cpu", copy=True).share_memory_()
    return Dataset(**fields)


def received_model(job) -> LayerList:
    """In a worker: the user's model, loaded from the launcher's file into tensors of this process's own."""
    try:
        model = torch.load(job.model_file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise HandoverError(f"{job.model_file}: the user's model, which the launcher writes before any worker "
                            f"starts, is missing (was the run directory removed while the run started?)") from None
    if not isinstance(model, LayerList):
        raise HandoverError(f"{job.model_file} holds a {type(model).__name__}, not an engine.LayerList")
    return model


def release(job) -> None:
    """The run ended: remove the model file this launcher wrote."""
    if job.model_file is not None:
        Path(job.model_file).unlink(missing_ok=True)
        job.model_file = None


def load_final_weights(model: torch.nn.Module, run_dir: Path) -> Path:
    """Load the run's final checkpoint (its latest: every run ends by writing one) into `model`, in place,
    on whatever devices its parameters are. Returns the checkpoint's folder."""
    saved = ckpt.list_checkpoints(run_dir)
    if not saved:
        raise ckpt.CheckpointError(f"{run_dir}: the run wrote no checkpoint to load the final weights from")
    # copied in place: the caller's tensors, their devices and any weight two layers share stay theirs
    ckpt.load_into(model, saved[-1])
    return saved[-1]
