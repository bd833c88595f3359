"""One training worker: process setup, resume, the step loop, checkpoints, telemetry.

The launcher (engine/launch.py) starts `world_size` of these through torch's
elastic agent; `torchrun --nproc-per-node N -m engine.worker CONFIG.toml` starts
them the same way on any number of hosts.

Every step ends at a boundary where the ranks exchange one small vector on the
side group: loss, timings, ledger figures and a stop flag. So every rank agrees on
when to stop, and rank 0 has what it logs and draws.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine import checkpoint as ckpt
from engine.config import Config
from engine.data import Dataset, batch_for, load_dataset
from engine.ddp import DDPStrategy, cross_entropy
from engine.devices import open_device
from engine.headless import HeadlessProgress
from engine.models import LayerList, build_model
from engine.optim import make_optimizer
from engine.telemetry_log import TelemetryLog
from engine.topology import Topology

# The boundary vector: one float64 per field, gathered from every rank each step.
FIELDS = ("stop", "loss", "step_ms", "parameters_bytes", "gradients_bytes", "optimizer_state_bytes",
          "activations_bytes", "swapped_bytes", "used_bytes", "peak_bytes", "capacity_bytes",
          "over_capacity", "rss_bytes", "cpu_percent")


@dataclass
class Job:
    """Everything a worker needs; pickled to each worker process."""
    config: Config
    model: LayerList | None = None       # a user's model (None: build cfg.model)
    data: Dataset | None = None          # a user's data (None: load cfg.data)
    resume: Path | None = None           # a verified checkpoint folder
    telemetry_log: Path | None = None
    headless: bool = True
    launched_at: float = 0.0


class StopRequest:
    """SIGINT/SIGTERM set a flag; the step loop acts on it at the next boundary."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


def worker_main(job: Job) -> dict | None:
    torch.set_num_threads(1)   # one thread per worker: on a few cores the pools would thrash
    stop = StopRequest()
    cfg = job.config
    topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
    try:
        return Worker(job, topo, stop).run()
    except Exception as e:
        if stop.requested:   # being shut down and a peer already left: nothing more to save
            print(f"trainyard: rank {topo.rank} stopped ({type(e).__name__} after a peer left)",
                  file=sys.stderr, flush=True)
            os._exit(1)
        raise
    finally:
        if stop.requested:
            sys.stdout.flush()
            # The elastic agent is shutting the group down and will not collect a return
            # value; leave now rather than wait for its SIGKILL.
            os._exit(0)
        topo.shutdown()


class Worker:
    def __init__(self, job: Job, topo: Topology, stop: StopRequest):
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.run_dir = cfg.run_dir
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        pid_dir = self.run_dir / "pids"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank{topo.rank}.pid").write_text(str(os.getpid()))

        self.device = open_device(cfg.device.kind, cfg.capacity_bytes, topo.local_rank, topo.local_world_size)
        self.data = job.data if job.data is not None else load_dataset(cfg.data, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model = job.model if job.model is not None else build_model(cfg.model, self.data.meta, cfg.run.seed)
        self.model = model.to(self.device.torch_device)
        self.optimizer = make_optimizer(cfg.optim, self.model.parameters())
        self.device.ledger.track_module(self.model, self.optimizer)
        self.first_step = self._resume()
        if self.first_step == 0:   # dropout streams differ per rank, reproducible from the seed
            torch.manual_seed(cfg.run.seed + 1000 * topo.rank)
        self.strategy = DDPStrategy(self.model, self.optimizer, topo, self.device)

        self.log = TelemetryLog(self._log_path() if topo.is_first else None)
        self.progress = None
        self.peak_bytes = [0] * topo.world_size
        self.over_reported: set[int] = set()

    def _log_path(self) -> Path:
        if self.job.telemetry_log:
            return Path(self.job.telemetry_log)
        return Path(self.cfg.telemetry.log) if self.cfg.telemetry.log else self.run_dir / "telemetry.jsonl"

    # --- resume -----------------------------------------------------------------
    def _resume(self) -> int:
        source, note = self.job.resume, None
        if self.restart > 0:
            source, note = self._latest_valid_checkpoint() or (self.job.resume, None)
        if source is None:
            return 0
        manifest = ckpt.verify(source)
        if manifest["world_size"] != self.topo.world_size:
            raise ckpt.CheckpointError(
                f"{source}: written by {manifest['world_size']} workers; this run has "
                f"{self.topo.world_size} (parallel.world_size must match to resume)")
        self.model.load_state_dict(ckpt.load_file(source, "model.pt"))
        self.optimizer.load_state_dict(ckpt.load_file(source, "optimizer.pt"))
        rng = ckpt.load_file(source, f"rank{self.topo.rank}.pt")
        torch.set_rng_state(rng["torch"])
        if self.device.kind == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
        self.device.ledger.refresh()
        self.resumed_from, self.resume_note = source, note
        return int(manifest["step"])

    def _latest_valid_checkpoint(self):
        for candidate in reversed(ckpt.list_checkpoints(self.run_dir)):
            try:
                ckpt.verify(candidate)
                return candidate, None
            except ckpt.CheckpointError as e:
                print(f"trainyard: skipping a damaged checkpoint: {e}", file=sys.stderr, flush=True)
        return None

    # --- the loop ---------------------------------------------------------------
    def run(self) -> dict | None:
        cfg, rank = self.cfg, self.topo.rank
        self._announce()
        step, loss = self.first_step, None
        last = time.perf_counter()
        while step < cfg.run.steps:
            x, y = batch_for(self.data, step, cfg.data.batch_size, cfg.run.seed, rank, self.topo.world_size)
            t0 = time.perf_counter()
            local_loss = self.strategy.train_step(x, y)
            step_ms = (time.perf_counter() - t0) * 1000
            step += 1
            table = self._boundary(local_loss, step_ms)
            now = time.perf_counter()
            loss = float(table[:, FIELDS.index("loss")].mean())
            self._report(step, loss, table, cfg.data.batch_size / max(now - last, 1e-9))
            last = now
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.run.steps:
                self._save(step)
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and self.topo.is_first:
                self.log.event("eval", step, test_accuracy=self.evaluate())
            if table[:, 0].max() > 0:
                return self._finish(step, loss, stopped_early=True)
            if cfg.run.step_pause_ms:
                time.sleep(cfg.run.step_pause_ms / 1000)
        return self._finish(step, loss, stopped_early=False)

    def _boundary(self, local_loss: float, step_ms: float) -> torch.Tensor:
        stats = self.device.stats()
        mine = torch.tensor([float(self.stop.requested), local_loss, step_ms] +
                            [float(stats[k]) for k in FIELDS[3:]], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.topo.world_size)]
        dist.all_gather(gathered, mine, group=self.topo.side)
        return torch.stack(gathered)

    def _report(self, step: int, loss: float, table: torch.Tensor, samples_per_s: float) -> None:
        if not self.topo.is_first:
            return
        ranks = []
        for r, row in enumerate(table.tolist()):
            entry = {"rank": r, **{k: (bool(v) if k == "over_capacity" else v) for k, v in zip(FIELDS[1:], row[1:])}}
            for k in entry:
                if k.endswith("_bytes"):
                    entry[k] = int(entry[k])
            self.peak_bytes[r] = max(self.peak_bytes[r], entry["peak_bytes"])
            if entry["over_capacity"] and r not in self.over_reported:
                self.over_reported.add(r)
                self.log.event("memory_over_capacity", step, rank=r, peak_bytes=entry["peak_bytes"],
                               capacity_bytes=entry["capacity_bytes"])
                self._note(f"[yellow]warning:[/] rank {r} went over its device capacity "
                           f"({entry['peak_bytes']} > {entry['capacity_bytes']} bytes)")
            ranks.append(entry)
        self.log.write({"type": "step", "step": step, "loss": loss, "samples_per_s": samples_per_s,
                        "step_ms": float(table[:, 2].max()), "ranks": ranks})
        if self.progress:
            self.progress.update(step, loss, samples_per_s)

    def _announce(self) -> None:
        if not self.topo.is_first:
            return
        cfg = self.cfg
        self.log.write({"type": "run_start", "name": cfg.run.name, "strategy": cfg.parallel.strategy,
                        "world_size": self.topo.world_size, "backend": self.topo.backend,
                        "device": self.device.name, "simulated": self.device.simulated,
                        "layers": list(getattr(self.model, "names", [])), "first_step": self.first_step,
                        "restart": self.restart, "config": cfg.to_dict()})
        if self.restart:
            self.log.event("restart", self.first_step, restart=self.restart, max_restarts=cfg.parallel.max_restarts)
        if self.first_step:
            self.log.event("resume", self.first_step, checkpoint=str(self.resumed_from))
        if self.job.headless:
            self.progress = HeadlessProgress(cfg.run.name, cfg.run.steps, self.first_step)
            if self.restart:
                self._note(f"[yellow]restart {self.restart} of {cfg.parallel.max_restarts}:[/] a worker failed; "
                           f"resumed from step {self.first_step}")
            elif self.first_step:
                self._note(f"resumed from {self.resumed_from} at step {self.first_step}")

    def _note(self, text: str) -> None:
        if self.progress:
            self.progress.note(text)

    # --- checkpoints, evaluation, the end ----------------------------------------
    def _save(self, step: int) -> None:
        staged = ckpt.staging_dir(self.run_dir, step)
        rng = {"torch": torch.get_rng_state()}
        if self.device.kind == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        ckpt.write_file(staged, f"rank{self.topo.rank}.pt", rng)
        if self.topo.is_first:
            ckpt.write_file(staged, "model.pt", self.model.state_dict())
            ckpt.write_file(staged, "optimizer.pt", self.optimizer.state_dict())
        dist.barrier(group=self.topo.side)
        if self.topo.is_first:
            # Batches are a function of (step, seed), so the step is the whole data position.
            meta = {"name": self.cfg.run.name, "world_size": self.topo.world_size,
                    "data_position": {"step": step, "samples_seen": step * self.cfg.data.batch_size},
                    "layout": self.strategy.layout(), "config": self.cfg.to_dict()}
            path = ckpt.finalize(self.run_dir, step, meta, keep=self.cfg.checkpoint.keep)
            self.log.event("checkpoint", step, path=str(path))
        dist.barrier(group=self.topo.side)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        ds = self.data
        if ds.x_test is None or len(ds.x_test) == 0:
            return None
        self.model.eval()
        correct = total = 0
        for i in range(0, len(ds.x_test), 1024):
            x = ds.x_test[i:i + 1024].to(self.device.torch_device)
            y = ds.y_test[i:i + 1024].to(self.device.torch_device)
            pred = self.model(x).argmax(dim=-1)
            correct += int((pred == y).sum())
            total += y.numel()
        self.model.train()
        return correct / total

    def _finish(self, step: int, loss: float | None, stopped_early: bool) -> dict | None:
        if step > self.first_step or stopped_early:
            self._save(step)
        if not self.topo.is_first:
            return None
        summary = {"type": "summary", "name": self.cfg.run.name, "final_loss": loss,
                   "test_accuracy": self.evaluate(), "steps": step,
                   "wall_s": time.time() - (self.job.launched_at or time.time()),
                   "peak_bytes_per_rank": self.peak_bytes, "capacity_bytes": self.cfg.capacity_bytes,
                   "simulated": self.device.simulated, "restarts": self.restart, "stopped_early": stopped_early}
        if stopped_early:
            self.log.event("stop", step, reason=f"signal {self.stop.signal}" if self.stop.requested else "command")
        self.log.write(summary)
        self.log.close()
        if self.progress:
            self.progress.finish(summary)
        return summary


def main(argv: list[str] | None = None) -> None:
    """`torchrun ... -m engine.worker CONFIG.toml [--set k=v ...]`: a worker started by any elastic agent."""
    import argparse

    from engine.config import load_config
    parser = argparse.ArgumentParser(prog="python -m engine.worker")
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    worker_main(Job(config=load_config(args.config, args.overrides), launched_at=time.time()))


if __name__ == "__main__":
    main()
