"""The step loop's checkpoints (engine/run/worker.py), off the step path.

    checkpoints = Checkpointer(cfg, topo, strategy, model, device, core)   # the run core: what rank 0 says
    exchange(topo, {..., **checkpoints.columns()})    # what this rank's writer has done, at every boundary
    checkpoints.boundary(table)                       # rank 0 publishes what every rank wrote; a failure stops all
    checkpoints.take(step)                            # the step waits for a host snapshot, a thread writes it
    checkpoints.drain()                               # a stop, a restart, a resize: the write in flight lands

A checkpoint of step N: every rank copies what it writes into host memory once the strategy has synced (host
updates and overlapped broadcasts landed), with its RNG, and its writer thread writes its file
(engine/runtime/checkpoint_writer.py). No collective call: each rank's column of the boundary's exchange says
the last step whose file it wrote, or that a write failed; once every rank's says N, rank 0's writer publishes
N (manifest, atomic rename, keep N). A write that failed anywhere stops every rank at the same boundary with
the full-disk error (CheckpointWriteError). At most one write is in flight: a checkpoint due while this rank's
writer is busy waits for it, and says so. `checkpoint.background = false`: the step waits for the whole
write, as a drain does.

Imports engine.runtime (checkpoint, checkpoint_writer, control) and torch.distributed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from engine.runtime import checkpoint as ckpt
from engine.runtime.checkpoint_writer import HostSnapshot, Writer, run_meta
from engine.runtime.control import COLUMN, Table, table_rows


class Checkpointer:
    def __init__(self, cfg, topo, strategy, model, device, core):
        self.cfg, self.topo, self.strategy, self.model, self.device = cfg, topo, strategy, model, device
        self.core, self.tel = core, core.tel
        self.run_dir = cfg.run_dir
        self._columns = [COLUMN[name] for name in ("ckpt_written", "ckpt_failed", "ckpt_errno", "ckpt_stall_ms",
                                                   "ckpt_write_ms")]
        self.snapshot = HostSnapshot()
        self.writer = Writer()
        self._lock = threading.Lock()   # `unpublished`: the step loop's and the writer's thread (on_published)
        if topo.is_first:   # a checkpoint's event as soon as it is published (a kill after it must not lose it)
            self.writer.on_published = self._report
        self.stall_ms = 0.0          # what the step loop waited at this rank's last checkpoint
        self.taken: int | None = None   # the last step snapshotted
        # rank 0: step -> (manifest fields, snapshot start, the step's figures once every file is written)
        self.unpublished: dict[int, list] = {}

    # --- the boundary ---------------------------------------------------------------------------
    def columns(self) -> dict:
        """This rank's figures for the boundary's exchange (engine/runtime/control.py)."""
        failed = self.writer.failed
        return {"ckpt_written": self.writer.written, "ckpt_failed": failed[0] + 1 if failed else 0,
                "ckpt_errno": failed[1] if failed else 0, "ckpt_stall_ms": self.stall_ms,
                "ckpt_write_ms": self.writer.write_s * 1000}

    def boundary(self, table: Table) -> None:
        """Every rank, after the exchange: rank 0 publishes each checkpoint whose files every rank has written;
        a write that failed on any rank stops the run on every rank (the table is the same everywhere)."""
        if self.writer.error is not None:
            raise self.writer.error
        # every rank's row of the checkpoint columns, read once (a step's boundary: no tensor op per figure)
        rows = [[row[i] for i in self._columns] for row in table_rows(table)]
        written = int(min(row[0] for row in rows))
        if self.topo.is_first:
            with self._lock:   # the writer's thread says what it published (_report) as it publishes
                due = sorted(s for s, entry in self.unpublished.items() if s <= written and len(entry) == 2)
            for step in due:
                self.unpublished[step].append({"stall_ms": max(row[3] for row in rows),
                                               "write_ms": max(row[4] for row in rows)})
                meta, t0 = self.unpublished[step][:2]
                self.writer.publish(self.run_dir, step, meta, self.cfg.checkpoint.keep, t0)
        failed = [row[1] for row in rows]
        if max(failed) > 0:
            rank = failed.index(max(failed))
            self._stop(int(failed[rank]) - 1, int(rows[rank][2]), rank)
        if self.unpublished or self.writer.has_published:
            self._report()

    # --- a checkpoint ---------------------------------------------------------------------------
    def take(self, step: int, background: bool | None = None) -> None:
        """Checkpoint `step`: the step loop waits for a host snapshot (and for a write still in flight), a thread
        writes it; `background=False` (checkpoint.background false, a run's final checkpoint): every rank waits
        until it is published (drain: collective)."""
        background = self.cfg.checkpoint.background if background is None else background
        t0 = time.perf_counter()
        if self.writer.busy:   # at most one write in flight
            self.writer.wait()
            waited_ms = (time.perf_counter() - t0) * 1000
            if self.topo.is_first:
                self.tel.event("checkpoint_waited", step, waited_ms=round(waited_ms, 1), previous=self.taken)
                self.tel.note(f"[yellow]checkpoint of step {step} waited {waited_ms:.0f} ms for the write of step "
                              f"{self.taken}[/] (checkpoint.every is shorter than a write)")
        if self.writer.error is not None:
            raise self.writer.error
        self._report()   # what the writer published meanwhile is said before this checkpoint
        t_snap = time.perf_counter()   # the write's time runs from here (write_ms)
        rng = {"torch": torch.get_rng_state()}
        if self.device.kind == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        self.strategy.sync()   # host updates and overlapped broadcasts landed (checkpoint_state syncs too)
        part = self.snapshot.take(*self.strategy.checkpoint_state(), rng)
        if self.topo.is_first:
            meta = run_meta(self.cfg, self.topo.world_size, step, self.strategy.layout(), self.model)
            with self._lock:
                self.unpublished[step] = [meta, t_snap]
        self.taken = step
        self.writer.write(ckpt.staging_dir(self.run_dir, step), self.topo.rank, part, step, t_snap)
        self.stall_ms = (time.perf_counter() - t0) * 1000
        if not background:
            self.drain(whole=True)
            self.stall_ms = (time.perf_counter() - t0) * 1000

    def drain(self, whole: bool = False) -> int | None:
        """Every rank (collective): the write in flight lands and, if every rank's file is whole, is published;
        returns the last step published (None: none was taken). A stop, a restart, a resize and the run's end
        wait here, within the stop's grace (the process is killed at its end). `whole`: the step waited for
        all of it (a synchronous checkpoint: its stall is its time to publication)."""
        self.writer.wait()
        self._agree()
        if self.topo.is_first:
            with self._lock:
                pending = sorted(self.unpublished.items())
            for step, entry in pending:
                if len(entry) == 2:
                    entry.append({"stall_ms": None if whole else self.stall_ms, "write_ms": self.agreed_write_ms})
                    self.writer.publish(self.run_dir, step, entry[0], self.cfg.checkpoint.keep, entry[1])
            self.writer.wait()
        self._agree()   # rank 0's publication failed: every rank stops together
        self._report()
        return self.taken

    def write_s(self) -> float | None:
        """The last write's time, its snapshot's start to its file on disk (a stop's final checkpoint fits?)."""
        return self.writer.write_s if self.writer.written >= 0 else None

    # --- what goes wrong, and what is said ----------------------------------------------------------
    def _agree(self) -> None:
        """Every rank: whether any rank's write failed, and the slowest rank's write time."""
        failed = self.writer.failed
        mine = torch.tensor([failed[0] + 1 if failed else 0, failed[1] if failed else 0,
                             self.topo.rank if failed else -1, self.writer.write_s * 1000], dtype=torch.float64)
        if self.topo.world_size > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.topo.side)
        self.agreed_write_ms = float(mine[3])
        if mine[0] > 0:
            self._stop(int(mine[0]) - 1, int(mine[1]), int(mine[2]), agreed=True)

    def _stop(self, step: int, errno: int, rank: int, agreed: bool = False) -> None:
        """Rank `rank`'s write of checkpoint `step` failed (a full disk): every rank's writer stops, the staged
        folders go (rank 0, once every rank has stopped writing into them), and every rank raises
        CheckpointWriteError naming the disk and the previous checkpoint (exit status 2, no restart)."""
        self.writer.wait()
        if not agreed and self.topo.world_size > 1:
            dist.barrier(group=self.topo.side)   # an error's path: no rank is still writing into a staged folder
        if self.topo.is_first:
            self._report()
            ckpt.remove_staged(self.run_dir)
        why = os.strerror(errno) if errno > 0 else "the write failed"
        raise ckpt.write_failed(self.run_dir, step, f"{why} (rank {rank})")

    def _report(self) -> None:
        """Rank 0: the checkpoint event of each checkpoint its writer has published."""
        if not self.topo.is_first:
            return
        for step, path, published_s in self.writer.take_published():
            with self._lock:
                meta, _, figures = self.unpublished.pop(step)
            stall = published_s * 1000 if figures["stall_ms"] is None else figures["stall_ms"]
            self.core.checkpointed(step, path, stall, figures["write_ms"], published_s * 1000)
        if self.writer.failed is None and self.writer.error is not None:
            print(f"trainyard: the checkpoint writer failed: {self.writer.error!r}", file=sys.stderr, flush=True)
