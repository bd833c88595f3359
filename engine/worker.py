"""One training worker: process setup, resume, the step loop, checkpoints, telemetry.

The launcher (engine/launch.py) starts `world_size` of these through torch's
elastic agent; `torchrun --nproc-per-node N -m engine.worker CONFIG.toml` starts
them the same way on any number of hosts.

Every step ends at a boundary where the ranks exchange one small vector on the
side group: loss, timings, ledger figures and a stop flag. So every rank agrees on
when to stop, and rank 0 has what it logs and draws.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from engine import checkpoint as ckpt
from engine.config import Config
from engine.control import COLUMN, Peaks, encode_commands, exchange, rank_rows, share_commands
from engine.data import Dataset, batch_for, load_dataset
from engine.ddp import DDPStrategy
from engine.devices import open_device
from engine.emulate import SlowLayer
from engine.memory import ActivationPolicy
from engine.models import LayerList, build_model
from engine.pipeline import PipelineStage, configured_stages
from engine.profiler import LayerProfiler
from engine.refusal import is_refusal, refuse
from engine.sharded import ShardedStrategy
from engine.telemetry import Telemetry
from engine.topology import Topology

PAUSED_POLL_S = 0.1   # how often paused ranks meet at the boundary to hear "resume" or "stop"


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
    # several hosts, our launcher: (this host's first global rank, the workers' store host, its port)
    placement: tuple[int, str, int] | None = None
    # our launcher: its pid and the file a worker writes a refusal to before signalling it (engine/refusal.py)
    launcher_pid: int | None = None
    refusal_path: str | None = None
    # (kind, capacity_bytes, local_rank, local_world_size) -> device; None: engine.devices.open_device.
    # Tests give one whose probe returns a GPU's figures, so the CUDA telemetry path runs on the CPU.
    open_device: Callable | None = None

    def log_path(self) -> Path:
        if self.telemetry_log:
            return Path(self.telemetry_log)
        log = self.config.telemetry.log
        return Path(log) if log else self.config.run_dir / "telemetry.jsonl"


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


def place_on_host(job: Job) -> None:
    """Before the process group starts: the network interface, and (several hosts under our launcher)
    global ranks by host number instead of the rendezvous's order of hosts, with the store on host 0."""
    interface = job.config.cluster.interface
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    if job.placement is not None:
        first, host, port = job.placement
        os.environ.update(RANK=str(first + int(os.environ["LOCAL_RANK"])), MASTER_ADDR=host, MASTER_PORT=str(port),
                          GROUP_RANK=str(job.config.cluster.node_rank))


def worker_main(job: Job) -> dict | None:
    torch.set_num_threads(1)   # one thread per worker: on a few cores the pools would thrash
    cfg = job.config
    place_on_host(job)
    param_server = cfg.parallel.strategy == "param_server"
    if param_server and int(os.environ["RANK"]) >= cfg.parallel.servers:
        from engine.param_server import supervise
        return supervise(job)   # a parameter-server worker: its death does not end the run
    stop = StopRequest()
    topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
    worker = None
    try:
        if param_server:
            from engine.param_server import run_server
            return run_server(job, topo, stop)
        worker = Worker(job, topo, stop)
        return worker.run()
    except Exception as e:
        refused = is_refusal(e) and job.launcher_pid is not None and not stop.requested
        if worker is not None:   # consoles hear why, and the socket and registry entry go away
            worker.tel.close(f"run {'refused' if refused else 'failed'} ({type(e).__name__}: {e})")
        if refused:   # a restart would fail the same way: the launcher ends the run (exit 2)
            refuse(job.refusal_path, job.launcher_pid, topo.rank, e, lambda: stop.requested)
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


def build_rank(job: Job, topo: Topology):
    """What every rank builds alike: its pid file, device, data and model (the same weights on every
    rank, from the seed). Returns (restart count, device, data, model)."""
    cfg = job.config
    pid_dir = cfg.run_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{topo.rank}.pid").write_text(str(os.getpid()))
    device = (job.open_device or open_device)(cfg.device.kind, cfg.capacity_bytes, topo.local_rank,
                                              topo.local_world_size)
    data = job.data if job.data is not None else load_dataset(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = job.model if job.model is not None else build_model(cfg.model, data.meta, cfg.run.seed)
    restart, device.rank_names = meet(topo, device.name)
    return restart, device, data, model.to(device.torch_device)


def meet(topo: Topology, device_name: str) -> tuple[int, list[str]]:
    """Every rank's word at start: how many times the group has restarted (the largest count of any
    host's agent: a host that was lost and started again has a fresh agent, count 0, while the others
    count on, and its ranks must resume too), and every rank's device name (run_start's `devices`)."""
    mine = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), device_name)
    everyone: list = [None] * topo.world_size
    dist.all_gather_object(everyone, mine, group=topo.side)
    return max(count for count, _ in everyone), [name for _, name in everyone]


class Worker:
    def __init__(self, job: Job, topo: Topology, stop: StopRequest):
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.run_dir = cfg.run_dir
        self.restart, self.device, self.data, self.model = build_rank(job, topo)
        self.slow_layer = SlowLayer.install(self.model, cfg.emulate)   # before any timing hook, so timed with it
        self.strategy = make_strategy(cfg, self.model, topo, self.device)
        # a pipeline stage counts only its own layers (and follows them when they migrate)
        self.device.ledger.track_module(getattr(self.strategy, "ledger_module", self.model), self.strategy.optimizer)
        # every layer's saved activations: keep, swap or recompute (a pipeline stage plans for its own layers)
        self.memory = ActivationPolicy(self.model, self.device, cfg.memory,
                                       owned=getattr(self.strategy, "owned_layers", None),
                                       in_flight=getattr(self.strategy, "in_flight", None))
        self.resumed_from = None
        self.first_step = self._resume()
        if self.first_step == 0:   # dropout streams differ per rank, reproducible from the seed
            torch.manual_seed(cfg.run.seed + 1000 * topo.rank)
        self.profiler = LayerProfiler(self.model, self.device.ledger) if cfg.telemetry.layer_every else None

        self.tel = Telemetry.open(job, self._hello(), topo.is_first, self.first_step)
        self.peaks = Peaks(topo.world_size)
        self.over_reported: set[int] = set()
        self.paused = False
        self.stop_reason: str | None = None
        self.wait_ms = 0.0
        self.rebalance_requested, self.rebalance_command = False, None
        self.last_layers: list[dict] | None = None   # the last layer rows reported (rank 0)
        # a pipeline stage holds only its own layers: each stage measures them and rank 0 gathers the rows
        self.stage_rows = hasattr(self.strategy, "layer_stages")
        self.own_rows: list[dict] = []               # this stage's last rows (pipeline)
        self.rows_layout: list[list[str]] | None = None   # the layout of the last gathered rows
        self.rows_stale = False                      # a command changed a policy or placement since

    def _hello(self) -> dict:
        cfg = self.cfg
        return {"run": cfg.run.name, "mode": cfg.parallel.strategy, "world_size": self.topo.world_size,
                "backend": self.topo.backend, **device_fields(self.device),
                "layers": list(getattr(self.model, "names", [])), "layout": self.strategy.layout(),
                "updated_layers": [n for n, layer in zip(self.model.names, self.model.layers)
                                   if any(True for _ in layer.parameters())],
                "capabilities": list(self.strategy.commands) + ["set-policy"], "steps": cfg.run.steps, "config": cfg.to_dict()}

    # --- resume -----------------------------------------------------------------
    def _resume(self) -> int:
        source = ckpt.resume_source(self.run_dir, self.job.resume, self.restart)
        if source is None:
            return 0
        manifest = ckpt.verify(source)
        ckpt.check_world_size(source, manifest, self.topo.world_size)
        self.strategy.load(source, manifest)
        rng = ckpt.load_file(source, f"rank{self.topo.rank}.pt")
        torch.set_rng_state(rng["torch"])
        if self.device.kind == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
        self.device.ledger.refresh()
        self.resumed_from = source
        return int(manifest["step"])

    # --- the loop ---------------------------------------------------------------
    def run(self) -> dict | None:
        cfg, rank, world = self.cfg, self.topo.rank, self.topo.world_size
        self._announce()
        step, loss = self.first_step, None
        last = time.perf_counter()
        while True:
            trained, local_loss, layers, memory_plan, swapped_out = False, 0.0, None, None, 0
            if not self.paused and step < cfg.run.steps:
                share = (0, 1) if getattr(self.strategy, "global_batch", False) else (rank, world)
                x, y = batch_for(self.data, step, cfg.data.batch_size, cfg.run.seed, *share)
                profile = self._profile_due(step)
                if profile:
                    self.profiler.arm()
                self.memory.before_step(step)
                if self.slow_layer:
                    self.slow_layer.step = step
                out_before = self.memory.swapped_out_bytes()
                t0 = time.perf_counter()
                local_loss = self.strategy.train_step(x, y) or 0.0   # None: a pipeline stage before the last
                step_ms = (time.perf_counter() - t0) * 1000
                memory_plan = self.memory.after_step(step)
                swapped_out = self.memory.swapped_out_bytes() - out_before
                layers = self.profiler.finish() if profile else None
                step, trained = step + 1, True
                if self.strategy.updater.new_plan:
                    self._report_plan(step)
            payload = encode_commands(self.tel.take_commands())
            t_wait = time.perf_counter()
            table = exchange(self.topo, {"stop": float(self.stop.requested), "command_bytes": len(payload),
                                         "loss": local_loss, "step_ms": step_ms if trained else 0.0,
                                         "wait_ms": self.wait_ms, **self.strategy.timings,
                                         **self._memory_fields(memory_plan, swapped_out),
                                         **self.device.stats()})
            commands = share_commands(self.topo, payload, table)
            self.wait_ms = (time.perf_counter() - t_wait) * 1000
            refusal = self._check_memory(step, table) if trained else None
            if refusal:
                return self._refuse(step, refusal)
            if trained:
                now = time.perf_counter()
                losses = table[:, COLUMN["loss"]]
                loss = float(losses[self.strategy.loss_rank] if hasattr(self.strategy, "loss_rank") else losses.mean())
                layers = self._gather_stage_rows(layers, table) if self.stage_rows else layers
                self._report(step, loss, table, cfg.data.batch_size / max(now - last, 1e-9), layers)
                last = now
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.run.steps:
                    self._save(step)
                if cfg.run.eval_every and step % cfg.run.eval_every == 0:
                    self._prepare_eval()
                    if self.topo.is_first:
                        self.tel.event("eval", step, test_accuracy=self.evaluate())
            if trained and hasattr(self.strategy, "take_migration"):
                self._report_migration(step, table)
            self.rebalance_requested = False
            for command in commands:
                self._apply(command, step)
            if hasattr(self.strategy, "boundary") and (trained or self.rebalance_requested):
                self._rebalance(step)
            if table[:, COLUMN["stop"]].max() > 0 and self.stop_reason is None:
                self.stop_reason = f"signal {self.stop.signal or 'on another rank'}"
            if self.stop_reason or step >= cfg.run.steps:
                return self._finish(step, loss)
            if self.paused:
                time.sleep(PAUSED_POLL_S)
                last = time.perf_counter()
            elif cfg.run.step_pause_ms:
                time.sleep(cfg.run.step_pause_ms / 1000)

    def _rebalance(self, step: int) -> None:
        """Every rank: the pipeline's check, when due; rank 0 reports the decision."""
        decision = self.strategy.boundary(step, self.rebalance_requested)
        if decision is None:
            return
        command = self.rebalance_command if decision.reason == "command" else None
        if not decision.changed:
            self.rebalance_command = None
            if command:
                self.tel.reply(command, "applied", step=step, reason=decision.summary())
            return
        if not self.topo.is_first:
            return
        self.tel.rebalancing = f"decided at step {step}"
        self.tel.event("rebalance", step, reason=decision.reason, stages=decision.stages,
                       stage_ms=[round(t, 4) for t in decision.stage_ms],
                       predicted_ms=[round(t, 4) for t in decision.predicted_ms],
                       threshold_ms=round(decision.threshold_ms, 4),
                       layer_ms={k: round(v, 4) for k, v in decision.layer_ms.items()})
        self.tel.note(f"rebalance ({decision.reason}) at step {step}: {decision.summary()}; "
                      f"layers migrate during step {step + 1}")

    def _report_migration(self, step: int, table: torch.Tensor) -> None:
        """Every rank, after the step: if layers migrated during it, rank 0 logs what moved and answers
        the operator's rebalance."""
        move = self.strategy.take_migration()
        if move is None:
            return
        command, self.rebalance_command = self.rebalance_command, None
        if not self.topo.is_first:
            return
        self.tel.rebalancing = None
        nbytes = int(table[:, COLUMN["migration_bytes"]].sum())
        duration = float(table[:, COLUMN["migration_ms"]].max())
        self.tel.event("migration", step, moves=[{"layer": n, "from_stage": a, "to_stage": b} for n, a, b in move.moves],
                       stages=move.new, bytes=nbytes, duration_ms=round(duration, 3), cutover_micro_batch=move.cutover)
        self.tel.update_state(layout=move.new)
        self.tel.note(f"migrated {len(move.moves)} layer(s) during step {step} ({nbytes} bytes, {duration:.1f} ms): "
                      f"stages now {move.new}")
        if command:
            self.tel.reply(command, "applied", step=step, reason=f"new layout took effect in step {step}: {move.new}")

    def _profile_due(self, step: int) -> bool:
        every = self.cfg.telemetry.layer_every
        return (bool(self.profiler) and (self.topo.is_first or self.stage_rows)
                and (step == self.first_step or (step + 1) % every == 0))

    def _apply(self, command: dict, step: int) -> None:
        """Every rank runs this for the same commands at the same boundary."""
        name = command["name"]
        if name in ("pause", "resume"):
            self.paused = name == "pause"
            self.tel.update_state(paused=self.paused)
        elif name == "checkpoint":
            self._save(step)
        elif name == "stop":
            self.stop_reason = "command"
        elif name == "rebalance" and hasattr(self.strategy, "boundary"):
            if self.rebalance_requested or self.rebalance_command or self.strategy.pending is not None:
                self.tel.reply(command, "rejected", reason="a rebalance is already in flight")
            else:   # answered once the check has run, or once the new layout has taken effect
                self.rebalance_requested, self.rebalance_command = True, command
            return
        elif name == "set-policy":
            self.memory.set(*command["args"])
            self.rows_stale = True
            self.tel.event("policy", step, layer=command["args"][0], policy=command["args"][1], source="command")
        elif name == "set-placement":
            self.strategy.sync()
            self.strategy.updater.set_placement(*command["args"])
            self.rows_stale = True
            self.tel.event("placement", step, layer=command["args"][0], placement=command["args"][1],
                           source="command")
        else:   # the hub rejects these in this mode; a command from elsewhere gets the same answer
            self.tel.reply(command, "rejected", reason=f"{name} is not available in mode {self.cfg.parallel.strategy}")
            return
        if name != "stop":   # a stop is answered once its final checkpoint is written
            self.tel.reply(command, "applied", step=step)
        else:
            self.stop_command = command

    def _memory_fields(self, plan, swapped_out: int) -> dict:
        """This rank's policy figures for the step's exchange."""
        policies = self.memory.policies()
        error = self.memory.last_error
        return {"swap_layers": sum(p == "swap" for p in policies.values()),
                "recompute_layers": sum(p == "recompute" for p in policies.values()),
                "plan_made": float(plan is not None), "plan_estimate_bytes": plan.estimate_bytes if plan else 0,
                "min_capacity_bytes": error.min_capacity_bytes if error else 0, "swapped_out_bytes": swapped_out}

    def _check_memory(self, step: int, table: torch.Tensor) -> str | None:
        """Every rank, after the exchange: the reason to refuse the run when a stage's plan cannot fit
        (every rank sees it in the same step); rank 0 logs the plans made in this step."""
        need = table[:, COLUMN["min_capacity_bytes"]]
        if need.max() > 0:
            worst = int(need.argmax())
            error = self.memory.last_error if worst == self.topo.rank else None
            return (f"memory.policy = \"auto\": rank {worst} cannot fit its device capacity "
                    f"(device.memory = \"{self.cfg.device.memory}\"): "
                    + (str(error) if error else f"the smallest capacity that fits is {int(need.max()) // 2**20}MiB "
                       f"(device.memory = \"{int(need.max()) // 2**20}MiB\")"))
        made = table[:, COLUMN["plan_made"]]
        if not self.topo.is_first or made.max() == 0:
            return None
        ranks = [{"rank": r, "swap_layers": int(table[r, COLUMN["swap_layers"]]),
                  "recompute_layers": int(table[r, COLUMN["recompute_layers"]]),
                  "estimate_bytes": int(table[r, COLUMN["plan_estimate_bytes"]])}
                 for r in range(self.topo.world_size) if made[r] > 0]
        plan = self.memory.plan
        self.tel.event("memory_plan", step, planner=self.cfg.memory.planner, ranks=ranks,
                       policies=self.memory.policies(), capacity_bytes=self.device.ledger.capacity_bytes,
                       host_link_gbps=round(self.memory.link_gbps, 3), note=plan.note if plan else "")
        self.tel.update_state(policies=self.memory.policies())
        summary = ", ".join(f"rank {e['rank']}: {e['swap_layers']} swap, {e['recompute_layers']} recompute"
                            for e in ranks)
        self.tel.note(f"memory plan ({self.cfg.memory.planner}) at step {step}: {summary}")
        return None

    def _refuse(self, step: int, reason: str) -> dict | None:
        """End a run whose memory plan cannot fit: no checkpoint, no restart (it would fail the same way)."""
        self.memory.close()
        if not self.topo.is_first:
            return None
        self.tel.event("stop", step, reason=f"refused: {reason}")
        self.tel.close(f"run refused ({reason})")
        return {"type": "refused", "error": reason}

    def _report(self, step: int, loss: float, table: torch.Tensor, samples_per_s: float, layers) -> None:
        if not self.topo.is_first:
            return
        ranks = rank_rows(table)
        self.peaks.note(ranks)
        for entry in ranks:
            r = entry["rank"]
            if entry["over_capacity"] and r not in self.over_reported:
                self.over_reported.add(r)
                self.tel.event("memory_over_capacity", step, rank=r, peak_bytes=entry["peak_bytes"],
                               capacity_bytes=entry["capacity_bytes"])
                self.tel.note(f"[yellow]warning:[/] rank {r} went over its device capacity "
                              f"({entry['peak_bytes']} > {entry['capacity_bytes']} bytes)")
        me = ranks[0]
        step_ms = max(e["step_ms"] for e in ranks)
        record = {"step": step, "loss": loss, "samples_per_s": samples_per_s, "step_ms": step_ms, "ranks": ranks,
                  "time_split": {"compute_ms": round(me["fwd_ms"] + me["bwd_ms"] + me["optim_ms"], 4),
                                 "comm_ms": 0.0, "wait_ms": me["wait_ms"]},
                  "streams": self.strategy.stream_stats(me["step_ms"])}
        record["time_split"]["comm_ms"] = sum(s["busy_ms"] for s in record["streams"])
        if hasattr(self.strategy, "stage_rows"):
            record.update(self.strategy.stage_rows(ranks))
        if layers is not None:
            layers = layers if self.stage_rows else self._layer_rows(layers)
        elif not self.stage_rows and self.last_layers and any(row.get("policy") != self.memory.policy[row["name"]]
                                      for row in self.last_layers):
            # a policy changed (set-policy, a plan): the last measured rows, with the policies now in force
            layers = [{**row, "policy": self.memory.policy[row["name"]]} for row in self.last_layers]
        if layers is not None:
            self.last_layers = layers
            record["layers"] = layers
            self.tel.update_state(layers=layers)
        self.tel.update_state(step=step)
        self.tel.step(record)

    def _layer_rows(self, layers: list[dict]) -> list[dict]:
        """The profiler's rows (a pipeline stage: of its own layers) with what this rank knows of each
        layer: its policy, owner or stage, update placement, and the update's measured time on that side."""
        owners = self.strategy.layer_owners() if hasattr(self.strategy, "layer_owners") else {}
        stages = self.strategy.layer_stages() if self.stage_rows else {}
        updates = self.strategy.updater.by_name
        rows = []
        for entry in layers:
            name, row = entry["name"], dict(entry)
            if stages and stages[name] != self.topo.rank:
                continue   # a stage measures its own layers only
            row["policy"] = self.memory.policy[name]
            if name in stages:
                row["stage"] = stages[name]
            if name in owners:
                row["owner_rank"] = owners[name]
            if name in updates:
                u = updates[name]
                row["placement"] = u.side
                row["update_ms"] = round(u.device_ms if u.side == "device" else u.host_ms + u.copy_ms, 4)
            rows.append(row)
        return rows

    def _gather_stage_rows(self, measured: list[dict] | None, table: torch.Tensor) -> list[dict] | None:
        """Pipeline, every rank: every stage's layer rows, gathered on rank 0 (None elsewhere, and when
        nothing changed). Due on the same steps everywhere: a measured step, a plan made on any stage, a
        policy or placement command, a new layout. Between measurements a stage sends its last rows with
        the policies and placements in force now."""
        layout = self.strategy.stage_layers
        changed = table[:, COLUMN["plan_made"]].max() > 0 or self.rows_layout != layout or self.rows_stale
        if measured is None and not changed:
            return None
        self.rows_layout, self.rows_stale = [list(s) for s in layout], False
        self.own_rows = self._layer_rows(measured if measured is not None else self.own_rows)
        gathered = [None] * self.topo.world_size if self.topo.is_first else None
        dist.gather_object(self.own_rows, gathered, dst=dist.get_global_rank(self.topo.side, 0),
                           group=self.topo.side)
        return [row for rows in gathered for row in rows] if self.topo.is_first else None

    def _report_plan(self, step: int) -> None:
        """A placement plan was just made (after the trial of `update.placement = "auto"`)."""
        updater = self.strategy.updater
        updater.new_plan = False
        if not self.topo.is_first:
            return
        plan, profile = updater.plan, updater.profile
        others = {side: round(updater.predicted(side).makespan_ms, 3) for side in ("device", "host")}
        saved = self.run_dir / "update_profile.json"
        saved.write_text(json.dumps({
            "step": step, "planner": self.cfg.update.planner, "capacity_bytes": profile.capacity_bytes,
            "peak_bytes_without_state": profile.peak_bytes, "layers_backward_order": [
                dataclasses.asdict(c) for c in profile.layers],
            "placement": updater.placement(), "predicted_makespan_ms": round(plan.makespan_ms, 3),
            "predicted_all_device_ms": others["device"], "predicted_all_host_ms": others["host"]}, indent=2))
        on_host = sorted(n for n, side in updater.placement().items() if side == "host")
        self.tel.event("update_plan", step, planner=self.cfg.update.planner, placement=updater.placement(),
                       predicted_ms=round(plan.makespan_ms, 3), all_device_ms=others["device"],
                       all_host_ms=others["host"], profile=str(saved))
        self.tel.note(f"update plan ({self.cfg.update.planner}): {len(on_host)} of {len(updater.by_name)} layers "
                      f"on the host; modelled step {plan.makespan_ms:.1f} ms (all device {others['device']:.1f}, "
                      f"all host {others['host']:.1f}); profile in {saved}")

    def _announce(self) -> None:
        self.tel.update_state(step=self.first_step, steps=self.cfg.run.steps, paused=False)
        announce(self.tel, self.cfg, self.topo, self.device, self.model.names, self.first_step, self.restart,
                 self.resumed_from)

    # --- checkpoints, evaluation, the end ----------------------------------------
    def _save(self, step: int) -> None:
        staged = ckpt.staging_dir(self.run_dir, step)
        rng = {"torch": torch.get_rng_state()}
        if self.device.kind == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        ckpt.write_file(staged, f"rank{self.topo.rank}.pt", rng)
        self.strategy.save(staged)
        dist.barrier(group=self.topo.side)
        if self.topo.is_first:
            # Batches are a function of (step, seed), so the step is the whole data position.
            meta = {"name": self.cfg.run.name, "world_size": self.topo.world_size,
                    "data_position": {"step": step, "samples_seen": step * self.cfg.data.batch_size},
                    "layout": self.strategy.layout(), "config": self.cfg.to_dict()}
            path = ckpt.finalize(self.run_dir, step, meta, keep=self.cfg.checkpoint.keep)
            self.tel.event("checkpoint", step, path=str(path))
        dist.barrier(group=self.topo.side)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        ds = self.data
        if ds.x_test is None or len(ds.x_test) == 0:
            return None
        self.strategy.sync()   # every parameter's latest broadcast has landed
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

    def _prepare_eval(self) -> None:
        """Every rank: a pipeline gathers every stage's weights so that rank 0 can evaluate the model."""
        if hasattr(self.strategy, "gather_weights"):
            self.strategy.gather_weights()

    def _finish(self, step: int, loss: float | None) -> dict | None:
        self.memory.close()
        stopped_early = step < self.cfg.run.steps
        if step > self.first_step or stopped_early:
            self._save(step)
        self._prepare_eval()
        if not self.topo.is_first:
            return None
        if stopped_early:
            self.tel.event("stop", step, reason=self.stop_reason)
        if getattr(self, "stop_command", None):
            self.tel.reply(self.stop_command, "applied", step=step)
        summary = {"name": self.cfg.run.name, "final_loss": loss, "test_accuracy": self.evaluate(), "steps": step,
                   "wall_s": time.time() - (self.job.launched_at or time.time()),
                   **self.peaks.summary(), "capacity_bytes": self.device.ledger.capacity_bytes,
                   "simulated": self.device.simulated, "restarts": self.restart, "stopped_early": stopped_early}
        self.tel.summary(summary)
        self.tel.close("run stopped" if stopped_early else "run finished")
        return {"type": "summary", **summary}


def announce(tel: Telemetry, cfg: Config, topo: Topology, device, names, first_step: int, restart: int,
             resumed_from, layout: dict | None = None) -> None:
    """Rank 0: the run_start record, and the restart and resume events."""
    if not topo.is_first:
        return
    start = {"type": "run_start", "name": cfg.run.name, "strategy": cfg.parallel.strategy,
             "world_size": topo.world_size, "hosts": topo.hosts(), "backend": topo.backend, **device_fields(device),
             "layers": list(names), "first_step": first_step,
             "restart": restart, "config": cfg.to_dict()}
    if layout is not None:
        start["layout"] = layout
    tel._write(start)
    if restart:
        tel.event("restart", first_step, restart=restart, max_restarts=cfg.parallel.max_restarts)
        tel.note(f"[yellow]restart {restart} of {cfg.parallel.max_restarts}:[/] a worker failed; "
                 f"resumed from step {first_step}")
    if first_step:
        tel.event("resume", first_step, checkpoint=str(resumed_from))
        if not restart:
            tel.note(f"resumed from {resumed_from} at step {first_step}")


def device_fields(device) -> dict:
    """What hello and run_start say of the devices: rank 0's name, whether simulated, every rank's
    name, and which device the run uses and why."""
    return {"device": device.name, "simulated": device.simulated,
            "devices": list(device.rank_names or [device.name]), "device_note": device.note}


def make_strategy(cfg: Config, model: LayerList, topo: Topology, device):
    p = cfg.parallel
    if p.strategy == "pipeline":
        stages = configured_stages(model, p.partition, topo.world_size)
        return PipelineStage(model, stages, topo, device, cfg.optim, micro_batches=p.micro_batches,
                             schedule=p.schedule, update_cfg=cfg.update, rebalance=p.rebalance,
                             threshold=p.imbalance_threshold, check_every=p.rebalance_check_every)
    if p.strategy == "sharded":
        return ShardedStrategy(model, cfg.optim, topo, device, streams=p.streams, slices=p.slices,
                               assignment=p.slice_assignment, overlap_forward=p.overlap_forward,
                               main_stream_communicates=p.main_stream_communicates, seed=cfg.run.seed,
                               update_cfg=cfg.update, hierarchical=p.hierarchical)
    return DDPStrategy(model, cfg.optim, topo, device, update_cfg=cfg.update)


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
