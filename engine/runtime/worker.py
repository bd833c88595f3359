"""One training worker: process setup, resume, the step loop, checkpoints, telemetry.

The launcher (engine/runtime/launch.py) starts `world_size` of these through torch's
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
import sys
import time

import torch
import torch.distributed as dist

from engine.data import batch_for, global_count
from engine.loss import cross_entropy, test_accuracy
from engine.optim import lr_at
from engine.runtime import checkpoint as ckpt
from engine.runtime.control import COLUMN, Peaks, encode_commands, exchange, rank_rows, share_commands
from engine.precision import compute_in
from engine.runtime.emulate import Fault, NonFinite, SlowLayer, SlowRank
from engine.runtime.layer_rows import LayerRows
from engine.runtime.profiler import LayerProfiler
from engine.runtime.rank import Job, StopRequest, announce, build_rank, device_fields, place_on_host
from engine.runtime.refusal import is_refusal, refuse
from engine.runtime.topology import Topology
from engine.strategies.interface import make_strategy
from engine.techniques.memory import ActivationPolicy
from engine.telemetry.outlets import Telemetry
from engine.timing import Clock

PAUSED_POLL_S = 0.1   # how often paused ranks meet at the boundary to hear "resume" or "stop"


def worker_main(job: Job) -> dict | None:
    torch.set_num_threads(1)   # one thread per worker: on a few cores the pools would thrash
    cfg = job.config
    place_on_host(job)
    param_server = cfg.parallel.strategy == "param_server"
    if param_server and int(os.environ["RANK"]) >= cfg.parallel.servers:
        from engine.strategies.param_server import supervise
        return supervise(job)   # a parameter-server worker: its death does not end the run
    stop = StopRequest()
    topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
    worker = None
    try:
        if param_server:
            from engine.strategies.param_server import run_server
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


class Worker:
    def __init__(self, job: Job, topo: Topology, stop: StopRequest):
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.run_dir = cfg.run_dir
        self.restart, self.device, self.data, self.model = build_rank(job, topo)
        self.slow_layer = SlowLayer.install(self.model, cfg.emulate)   # before any timing hook, so timed with it
        self.slow_rank = SlowRank.install(self.model, cfg.emulate, self.topo.rank)
        self.nonfinite = NonFinite.install(self.model, cfg.emulate, self.topo.rank)
        self.fault = Fault.install(cfg.emulate, self.topo.rank, self.restart)   # emulate.kill_rank: first attempt
        self.loss_fn = job.loss_fn or cross_entropy
        self.strategy = make_strategy(cfg, self.model, topo, self.device, self.loss_fn)
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
        self.profiler = LayerProfiler(self.model, self.device.ledger, Clock(self.device.torch_device)) if cfg.telemetry.layer_every else None

        self.tel = Telemetry.open(job, self._hello(), topo.is_first, self.first_step)
        self.peaks = Peaks(topo.world_size)
        self.over_reported: set[int] = set()
        self.paused = False
        self.stop_reason: str | None = None
        self.wait_ms = 0.0
        self.lr = self.cfg.optim.lr   # the last step's learning rate (engine/optim.py lr_at)
        self.rebalance_requested, self.rebalance_command = False, None
        self.layer_rows = LayerRows(self.strategy, self.memory, self.topo)   # the console's layer table

    def _hello(self) -> dict:
        cfg = self.cfg
        return {"run": cfg.run.name, "mode": cfg.parallel.strategy, "world_size": self.topo.world_size,
                "hosts": self.topo.hosts(), "backend": self.topo.backend, **device_fields(self.device),
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
            trained, local_loss, layers, memory_plan, swapped_out, link_wait_s = False, 0.0, None, None, 0, 0.0
            rows_due = False
            if not self.paused and step < cfg.run.steps:
                share = (0, 1) if getattr(self.strategy, "global_batch", False) else (rank, world)
                x, y = batch_for(self.data, step, cfg.data.batch_size, cfg.run.seed, *share)
                if hasattr(self.strategy, "global_counted"):   # shares that count their targets differently
                    self.strategy.global_counted = global_count(self.data, step, cfg.data.batch_size, cfg.run.seed,
                                                                self.loss_fn)
                self.lr = lr_at(cfg.optim, step, cfg.run.steps)
                self.strategy.updater.lr = self.lr   # each layer's update takes it as it goes
                rows_due = self._rows_due(step)
                profile = rows_due and (self.topo.is_first or self.layer_rows.by_stage)
                if profile:
                    self.profiler.arm()
                self.memory.before_step(step)
                if self.slow_layer:
                    self.slow_layer.step = step
                for emulated in (self.slow_rank, self.nonfinite):
                    if emulated:
                        emulated.step = step
                if self.fault:
                    self.fault.step = step
                out_before, wait_before = self.memory.swapped_out_bytes(), self.memory.link_wait_s()
                t0 = time.perf_counter()
                with compute_in(cfg.precision, self.device.torch_device):   # bf16: under autocast
                    local_loss = self.strategy.train_step(x, y) or 0.0   # None: a pipeline stage before the last
                step_ms = (time.perf_counter() - t0) * 1000
                memory_plan = self.memory.after_step(step)
                swapped_out = self.memory.swapped_out_bytes() - out_before
                link_wait_s = self.memory.link_wait_s() - wait_before
                layers = self.profiler.finish() if profile else None
                step, trained = step + 1, True
                if self.strategy.updater.new_plan:
                    self._report_plan(step)
            payload = encode_commands(self.tel.take_commands())
            t_wait = time.perf_counter()
            table = exchange(self.topo, {"stop": float(self.stop.requested), "command_bytes": len(payload),
                                         "loss": local_loss, "step_ms": step_ms if trained else 0.0,
                                         "wait_ms": self.wait_ms, **self.strategy.timings,
                                         **self._memory_fields(memory_plan, swapped_out, link_wait_s),
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
                layers = self.layer_rows.gather(layers, table, rows_due)
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
        ahead = self._plan_ahead(decision)
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
        if ahead is not None:
            held = ", ".join(f"{n} {p}" for n, p in ahead.policies.items() if p != "keep") or "every layer kept"
            self.tel.note(f"memory planned ahead of the migration (rank 0): {held}")

    def _plan_ahead(self, decision):
        """Every rank, once a new layout is decided (`memory.policy = "auto"`): the policies of the layers it
        will hold in the migration step, planned before they move, from the costs measured where each ran
        and the bytes each brings (engine/techniques/memory/policy.py: plan_ahead). So no stage goes over
        its capacity while layers move (the plan after the move came a step late before)."""
        if not self.memory.auto:
            return None
        mine = {"costs": self.memory.own_costs(), "static": self.strategy.layer_static_bytes()}
        everyone: list = [None] * self.topo.world_size
        dist.all_gather_object(everyone, mine, group=self.topo.side)
        costs = {n: c for part in everyone for n, c in part["costs"].items()}
        static = {n: b for part in everyone for n, b in part["static"].items()}
        now = set(self.strategy.owned_layers())
        after = decision.stages[self.topo.rank]
        held = [n for n in self.model.names if n in now or n in after]
        return self.memory.plan_ahead(held, costs, sum(static[n] for n in after if n not in now))

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

    def _rows_due(self, step: int) -> bool:
        """Layer rows are due after this step (the same on every rank; rank 0 or each stage measures it)."""
        every = self.cfg.telemetry.layer_every
        return bool(self.profiler) and (step == self.first_step or (step + 1) % every == 0)

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
            self.layer_rows.stale = True
            self.tel.event("policy", step, layer=command["args"][0], policy=command["args"][1], source="command")
        elif name == "set-placement":
            self.strategy.sync()
            self.strategy.updater.set_placement(*command["args"])
            self.layer_rows.stale = True
            self.tel.event("placement", step, layer=command["args"][0], placement=command["args"][1],
                           source="command")
        else:   # the hub rejects these in this mode; a command from elsewhere gets the same answer
            self.tel.reply(command, "rejected", reason=f"{name} is not available in mode {self.cfg.parallel.strategy}")
            return
        if name != "stop":   # a stop is answered once its final checkpoint is written
            self.tel.reply(command, "applied", step=step)
        else:
            self.stop_command = command

    def _memory_fields(self, plan, swapped_out: int, link_wait_s: float) -> dict:
        """This rank's policy figures for the step's exchange."""
        policies = self.memory.policies()
        error = self.memory.last_error
        return {"swap_layers": sum(p == "swap" for p in policies.values()),
                "recompute_layers": sum(p == "recompute" for p in policies.values()),
                "plan_made": float(plan is not None), "plan_estimate_bytes": plan.estimate_bytes if plan else 0,
                "min_capacity_bytes": error.min_capacity_bytes if error else 0, "swapped_out_bytes": swapped_out,
                "link_wait_ms": link_wait_s * 1000}

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
                  "streams": self.strategy.stream_stats(me["step_ms"]),
                  "lr": self.lr, **self.strategy.updater.decision.fields()}
        record["time_split"]["comm_ms"] = sum(s["busy_ms"] for s in record["streams"])
        if hasattr(self.strategy, "stage_rows"):
            record.update(self.strategy.stage_rows(ranks))
        layers = self.layer_rows.report(layers)
        if layers is not None:
            record["layers"] = layers
            self.tel.update_state(layers=layers)
        self.tel.update_state(step=step)
        self.tel.step(record)
        decision = self.strategy.updater.decision   # a rollback is rare: the steps after it wait
        if decision.skipped:
            self.tel.event("step_skipped", step, grad_norm=record["grad_norm"], redone_layers=decision.redone_layers)
        elif decision.redone_layers:
            self.tel.event("step_rolled_back", step, grad_norm=decision.grad_norm, clip=self.cfg.optim.clip_grad_norm,
                           redone_layers=decision.redone_layers)

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
            "peak_bytes_without_state": profile.peak_bytes, "host_threads": profile.host_threads,
            "plan_optimal": plan.optimal, "layers_backward_order": [
                dataclasses.asdict(c) for c in profile.layers],
            "placement": updater.placement(), "predicted_makespan_ms": round(plan.makespan_ms, 3),
            "predicted_all_device_ms": others["device"], "predicted_all_host_ms": others["host"]}, indent=2))
        on_host = sorted(n for n, side in updater.placement().items() if side == "host")
        self.tel.event("update_plan", step, planner=self.cfg.update.planner, placement=updater.placement(),
                       predicted_ms=round(plan.makespan_ms, 3), all_device_ms=others["device"],
                       all_host_ms=others["host"], host_threads=profile.host_threads, optimal=plan.optimal,
                       profile=str(saved))
        self.tel.note(f"update plan ({self.cfg.update.planner}): {len(on_host)} of {len(updater.by_name)} layers "
                      f"on the host; modelled step {plan.makespan_ms:.1f} ms (all device {others['device']:.1f}, "
                      f"all host {others['host']:.1f}); profile in {saved}")

    def _announce(self) -> None:
        self.tel.update_state(step=self.first_step, steps=self.cfg.run.steps, paused=False)
        announce(self.tel, self.cfg, self.topo, self.device, self.model.names, self.first_step, self.restart,
                 self.resumed_from)

    # --- checkpoints, evaluation, the end ----------------------------------------
    def _save(self, step: int) -> None:
        """Every rank writes its files, rank 0 publishes the checkpoint. A write that fails on any rank (a full
        disk) stops the run on every rank with CheckpointWriteError, the staged files removed and the previous
        checkpoint untouched: the ranks agree on it first, so none waits at a barrier for one that gave up."""
        staged = ckpt.staging_dir(self.run_dir, step)
        rng = {"torch": torch.get_rng_state()}
        if self.device.kind == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        failed = None
        try:
            ckpt.write_file(staged, f"rank{self.topo.rank}.pt", rng)
            self.strategy.save(staged)
        except OSError as e:
            failed = e
        ckpt.agree_written(self.topo.side, self.topo.rank, self.run_dir, step, failed)
        path, failed = None, None
        if self.topo.is_first:
            # Batches are a function of (step, seed), so the step is the whole data position.
            meta = {"name": self.cfg.run.name, "world_size": self.topo.world_size,
                    "data_position": {"step": step, "samples_seen": step * self.cfg.data.batch_size},
                    "layout": self.strategy.layout(), "config": self.cfg.to_dict(),
                    "tied": ckpt.tied_keys(self.model)}
            try:
                path = ckpt.finalize(self.run_dir, step, meta, keep=self.cfg.checkpoint.keep)
            except OSError as e:
                failed = e
        ckpt.agree_written(self.topo.side, self.topo.rank, self.run_dir, step, failed)
        if path is not None:
            self.tel.event("checkpoint", step, path=str(path))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        self.strategy.sync()   # every parameter's latest broadcast has landed
        return test_accuracy(self.model, self.data, self.device.torch_device, self.cfg.precision,
                             self.cfg.data.eval_samples)

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
