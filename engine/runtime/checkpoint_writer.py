"""A checkpoint off the step path: the step copies what its rank writes into host memory (HostSnapshot), and
a thread of its own (Writer) writes the file at the disk's speed, hashing as it writes, then (rank 0, once
every rank's file is written) publishes the checkpoint.

    snapshot = HostSnapshot()
    part = snapshot.take(weights, optimizer, rng)       # host copies, every copy landed; buffers reused
    writer.write(staged, rank, part, step, t0)          # this rank's file, in the background
    meta = run_meta(cfg, world_size, step, layout, model)   # the manifest's fields of the run
    writer.publish(run_dir, step, meta, keep, t0)       # rank 0: manifest, rename, keep N
    writer.wait()                                       # at most one write in flight: a later one waits
    writer.written, writer.failed, writer.take_published()
    tel.event("checkpoint", step, **published(path, stall_ms, write_ms, published_ms))   # rank 0, once published

run_meta and published serve the parameter server's coordinator too, which writes its checkpoints in step.

The writer makes no collective call: the step loop learns that every rank's file is written through the
exchange it makes at every boundary (engine/run/checkpointer.py). Imports torch and the checkpoint's modules.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.runtime import checkpoint as ckpt
from engine.runtime.checkpoint_files import rank_tensors, write_tensors
from engine.runtime.emulate import reached


def run_meta(cfg, world_size: int, step: int, layout: dict, model) -> dict:
    """The run's fields of the manifest of checkpoint `step` (finalize adds its files' and the index), whichever
    loop writes it. Batches are a function of (step, seed), so the step is the whole data position."""
    return {"name": cfg.run.name, "world_size": world_size,
            "data_position": {"step": step, "samples_seen": step * cfg.data.batch_size},
            "layout": layout, "config": cfg.to_dict(), "tied": ckpt.tied_keys(model)}


def published(path: Path, stall_ms: float, write_ms: float, published_ms: float) -> dict:
    """The checkpoint event's fields of the checkpoint published at `path` (docs/telemetry.md)."""
    return {"path": str(path), "stall_ms": round(stall_ms, 1), "write_ms": round(write_ms, 1),
            "published_ms": round(published_ms, 1),
            "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}


@dataclass
class Part:
    """One rank's part of a checkpoint, in host memory: rank_tensors' parts, and their bytes."""
    tensors: dict
    aliases: dict
    scalars: dict
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class HostSnapshot:
    """Host copies of a rank's checkpoint state, one buffer per name, reused from one checkpoint to the next
    while its shape and dtype hold (pinned where the tensor is on a GPU: the copy is a DMA). `take` returns
    once every copy has landed, not when it is queued: the next step may update the tensors in place."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, weights: dict, optimizer: dict, rng: dict, extra: dict | None = None) -> Part:
        tensors, aliases, scalars = rank_tensors(weights, optimizer, rng)
        copies, on_gpu = {}, False
        with torch.no_grad():
            for name, value in tensors.items():
                buffer = self.buffers.get(name)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                    self.buffers[name] = buffer
                buffer.copy_(value, non_blocking=value.is_cuda)
                on_gpu |= value.is_cuda
                copies[name] = buffer
        for gone in set(self.buffers) - set(copies):   # a layer that left this rank (a pipeline's migration)
            del self.buffers[gone]
        if on_gpu:
            torch.cuda.synchronize()   # every copy landed (they were queued on the streams that update them)
        return Part(copies, aliases, scalars, extra or {})

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class Writer:
    """One thread that runs this rank's checkpoint jobs in order: a file's write, rank 0's publication.

    written: the last step whose file this rank wrote (-1: none); write_s: how long it took (its snapshot's
    start to its fsync); failed: (step, errno) of a write or publication that failed (a full disk), until the
    loop has stopped the run for it; error: anything else a job raised, for the loop to raise."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.written, self.write_s = -1, 0.0
        self.failed: tuple[int, int] | None = None
        self.error: BaseException | None = None
        self._published: list[tuple[int, Path, float]] = []
        self.on_published = None   # called in the writer's thread after each publication

    # --- what the step loop asks ----------------------------------------------------------------
    def write(self, staged: Path, rank: int, part: Part, step: int, t0: float) -> None:
        self._submit(step, self._write, staged, rank, part, step, t0)

    def publish(self, run_dir: Path, step: int, meta: dict, keep: int, t0: float) -> None:
        self._submit(step, self._publish, run_dir, step, meta, keep, t0)

    @property
    def busy(self) -> bool:
        return self.jobs.unfinished_tasks > 0

    def wait(self, timeout: float | None = None) -> bool:
        """Every job submitted has run (False: `timeout` seconds went by first)."""
        with self.jobs.all_tasks_done:
            return self.jobs.all_tasks_done.wait_for(lambda: not self.jobs.unfinished_tasks, timeout)

    @property
    def has_published(self) -> bool:
        """Some checkpoint was published since the last take_published."""
        return bool(self._published)

    def take_published(self) -> list[tuple[int, Path, float]]:
        """(step, folder, seconds from its snapshot's start) of each checkpoint published since the last call."""
        done, self._published = self._published, []
        return done

    # --- the thread -----------------------------------------------------------------------------
    def _submit(self, step: int, job, *args) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="trainyard-checkpoint", daemon=True)
            self.thread.start()
        self.jobs.put((step, job, args))

    def _run(self) -> None:
        while True:
            step, job, args = self.jobs.get()
            try:
                # after a failure nothing more is written; an earlier checkpoint, whole, is still published
                if self.error is None and (self.failed is None or job == self._publish):
                    job(*args)
            except OSError as e:
                self.failed = (step, e.errno or -1)
            except BaseException as e:   # noqa: BLE001 - the loop raises it at its next boundary
                e.add_note(traceback.format_exc())
                self.error = e
            finally:
                self.jobs.task_done()

    def _write(self, staged: Path, rank: int, part: Part, step: int, t0: float) -> None:
        write_tensors(staged, rank, part.tensors, part.aliases, part.scalars, part.extra, step)
        reached("checkpoint", step)   # emulate.kill_at: this rank's file written, the checkpoint not published
        self.write_s = time.perf_counter() - t0
        self.written = step

    def _publish(self, run_dir: Path, step: int, meta: dict, keep: int, t0: float) -> None:
        path = ckpt.finalize(run_dir, step, meta, keep=keep)
        self._published.append((step, path, time.perf_counter() - t0))
        if self.on_published is not None:   # said at once, in this thread (rank 0's checkpoint event)
            self.on_published()
