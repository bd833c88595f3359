"""`trainyard bench hybrid`: where should each layer's optimizer update run?

One worker (world 1: on this 2-core machine the host executor needs the other core)
trains a 12-layer MLP with AdamW. A trial (`update.placement = "auto"`) measures every
layer on both sides; from that profile the bench builds the placements below at two
device capacities: a tight one, where all-device does not fit (it is reported as
infeasible and not run), and a roomy one, where everything fits:

    all-device   every update inline on the compute thread
    all-host     every update on the host executor (ZeRO-Offload's placement)
    auto-global  the exact plan of the cost model (engine/techniques/update_plan.py)
    auto-local   the layer-by-layer rule
    brute-force  the best of all 2^12 placements under the cost model

Each placement then trains the same steps from the same weights, in rounds (one
placement after another, repeated) so drift hits all alike; the figure is each
placement's median step time, and its ratio to all-host and to brute-force. In the same
rounds all-host runs once more as the host step was before fused kernels and a thread
pool (foreach AdamW on one host thread): `host_step` holds the two and their ratio.

    trainyard bench hybrid [--json] [--rounds 3] [--steps 8] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


def _model_and_data(hidden: int, depth: int, batch: int, kind: str = "cpu"):
    import torch

    from engine.config import ModelConfig
    from engine.models import build_model
    model = build_model(ModelConfig(name="mlp", hidden=hidden, depth=depth),
                        {"input_dim": hidden, "num_classes": 10}, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, hidden, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    where = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    return model.to(where), x.to(where), y.to(where)


def _runner(topo, model, placement, profile_steps: int = 6, kernel: str = "auto", host_threads: int = 0):
    from engine.config import OptimConfig, UpdateConfig
    from engine.strategies.ddp import DDPStrategy
    from engine.runtime.devices import CudaDevice, LedgerDevice
    device = CudaDevice(1 << 40, 0) if next(model.parameters()).is_cuda else LedgerDevice(1 << 40)
    runner = DDPStrategy(model, OptimConfig(name="adamw", lr=1e-3, kernel=kernel), topo, device,
                         update_cfg=UpdateConfig(placement=placement, profile_steps=profile_steps,
                                                 host_threads=host_threads))
    device.ledger.track_module(model, runner.optimizer)
    return runner


def profile_job(topo, hidden: int, depth: int, batch: int, trial: int, kind: str = "cpu") -> dict:
    model, x, y = _model_and_data(hidden, depth, batch, kind)
    runner = _runner(topo, model, "auto", profile_steps=trial)
    for _ in range(trial):
        runner.train_step(x, y)
    profile = runner.updater.profile
    runner.close()
    return {"layers": [dataclasses.asdict(c) for c in profile.layers], "peak_bytes": profile.peak_bytes,
            "host_threads": profile.host_threads}


def measure_job(topo, hidden: int, depth: int, batch: int, placement: dict, steps: int, warmup: int,
                kernel: str = "auto", host_threads: int = 0, kind: str = "cpu") -> float:
    model, x, y = _model_and_data(hidden, depth, batch, kind)
    runner = _runner(topo, model, placement, kernel=kernel, host_threads=host_threads)
    import torch

    def settle() -> None:   # the last host updates, and on a GPU its queued kernels, are part of the steps
        runner.sync()
        if kind == "cuda":
            torch.cuda.synchronize()
    for _ in range(warmup):
        runner.train_step(x, y)
    settle()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.train_step(x, y)
    settle()
    elapsed = time.perf_counter() - t0
    runner.close()
    return elapsed / steps * 1000


def host_updates_ms(hidden: int, depth: int, kernel: str, threads: int, repeats: int = 5) -> float:
    """Every layer's host update of one step (gradients down, AdamW, weights up) on the host executor,
    with nothing else running: the host side's own speed, ms per step (median of `repeats`)."""
    import torch

    from engine.config import OptimConfig
    from engine.techniques.layer_update import HostExecutor, LayerUpdate
    model, _, _ = _model_and_data(hidden, depth, 1)
    cfg = OptimConfig(name="adamw", lr=1e-3, kernel=kernel)
    updates = [LayerUpdate(name, i, list(layer.parameters()), cfg)
               for i, (name, layer) in enumerate(model) if any(True for _ in layer.parameters())]
    executor = HostExecutor(threads)
    times = []
    for u in updates:
        u.move("host")
    for _ in range(repeats + 1):   # the first step makes the optimizer state: not timed
        for u in updates:
            for p in u.params:
                p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        for u in updates:
            executor.submit(u)
        for u in updates:
            u.done.wait()
        times.append(time.perf_counter() - t0)
    executor.close()
    return statistics.median(times[1:]) * 1000


def run_bench(hidden: int, depth: int, batch: int, rounds: int, steps: int, warmup: int, trial: int,
              kind: str = "cpu") -> dict:
    from engine.runtime.procpool import DistPool
    from engine.techniques.update_plan import LayerCost, Profile, fixed, plan_brute_force, plan_global, plan_local
    with DistPool(1, timeout_s=120) as pool:
        measured = pool.run(profile_job, timeout=600, hidden=hidden, depth=depth, batch=batch, trial=trial,
                            kind=kind)[0]
        layers = tuple(LayerCost(**c) for c in measured["layers"])
        total_state = sum(c.state_bytes for c in layers)
        capacities = {"tight": measured["peak_bytes"] + total_state // 2,
                      "roomy": measured["peak_bytes"] + total_state + (1 << 20)}
        cases = {}
        for label, capacity in capacities.items():
            profile = Profile(layers, peak_bytes=measured["peak_bytes"], capacity_bytes=capacity,
                              host_threads=measured["host_threads"])   # the executor the placements run on
            plans = {"all-device": fixed(profile, "device"), "all-host": fixed(profile, "host"),
                     "auto-global": plan_global(profile), "auto-local": plan_local(profile),
                     "brute-force": plan_brute_force(profile)}
            cases[label] = {"capacity_bytes": capacity, "plans": plans, "names": profile.names, "times": {}}
        # every distinct placement runs once per round; the same placement at both capacities runs once
        todo = {}
        for case in cases.values():
            for plan in case["plans"].values():
                if plan.fits:
                    todo[plan.placement] = dict(zip(case["names"], plan.placement))
        times = {key: [] for key in todo}
        # the host step as it was (one thread, foreach AdamW) beside today's (fused, HOST_THREADS threads)
        all_host = dict.fromkeys(cases["roomy"]["names"], "host")
        before = []
        for _ in range(rounds):
            for key, placement in todo.items():
                times[key].append(pool.run(measure_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                           placement=placement, steps=steps, warmup=warmup, kind=kind)[0])
            before.append(pool.run(measure_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                   placement=all_host, steps=steps, warmup=warmup, kernel="foreach",
                                   host_threads=1, kind=kind)[0])
    report = {"bench": "hybrid", "world": 1, "device": kind, "layers_with_updates": len(layers), "optimizer": "adamw",
              "hidden": hidden, "batch": batch, "rounds": rounds, "steps_per_round": steps,
              "peak_bytes_without_state": measured["peak_bytes"], "optimizer_state_bytes": total_state,
              "profile": measured["layers"], "cases": {}}
    from engine.techniques.layer_update import default_host_threads
    threads = default_host_threads()
    alone_before = host_updates_ms(hidden, depth, "foreach", 1)
    alone_now = host_updates_ms(hidden, depth, "auto", threads)
    now_ms = statistics.median(times[tuple("host" for _ in layers)])
    device_ms = statistics.median(times[tuple("device" for _ in layers)])
    report["host_step"] = {
        "before_foreach_1_thread_ms": round(statistics.median(before), 2), "now_fused_ms": round(now_ms, 2),
        "now_threads": threads, "speedup": round(statistics.median(before) / now_ms, 3),
        "host_updates_alone_before_ms": round(alone_before, 2), "host_updates_alone_now_ms": round(alone_now, 2),
        "host_updates_alone_speedup": round(alone_before / alone_now, 3),
        "all_device_ms": round(device_ms, 2), "all_host_over_all_device": round(now_ms / device_ms, 3)}
    for label, case in cases.items():
        rows = {}
        for name, plan in case["plans"].items():
            ms = statistics.median(times[plan.placement]) if plan.fits else None
            rows[name] = {"fits": plan.fits, "host_layers": plan.host_layers, "modelled_ms": round(plan.makespan_ms, 2),
                          "measured_ms": None if ms is None else round(ms, 2),
                          "device_bytes": plan.device_bytes}
        host, best = rows["all-host"]["measured_ms"], rows["brute-force"]["measured_ms"]
        for row in rows.values():
            if row["measured_ms"] is not None:
                row["ratio_to_all_host"] = round(row["measured_ms"] / host, 3)
                row["ratio_to_brute_force"] = round(row["measured_ms"] / best, 3)
        auto = rows["auto-global"]
        report["cases"][label] = {
            "capacity_bytes": case["capacity_bytes"], "placements": rows,
            "meets_goals": {"auto_at_most_0.85x_all_host": auto["ratio_to_all_host"] <= 0.85,
                            "auto_within_5pct_of_brute_force": auto["ratio_to_brute_force"] <= 1.05}}
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench hybrid")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per placement and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trial", type=int, default=6, help="trial steps of the profile (alternating sides)")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--depth", type=int, default=11, help="hidden layers (default 11: 12 layers with updates)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where the worker computes (default: cuda when a GPU is there, else cpu)")
    args = parser.parse_args(argv)
    import torch
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.depth + 1 > 20:
        parser.error("--depth: at most 19 (the brute force tries 2^(depth+1) placements)")
    report = run_bench(args.hidden, args.depth, args.batch, args.rounds, args.steps, args.warmup, args.trial, kind)
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    for label, case in report["cases"].items():
        table = Table(title=f"hybrid update, {label} capacity {case['capacity_bytes'] / 2**20:.1f} MiB: "
                            f"{report['layers_with_updates']} layers, AdamW, 1 worker on {kind} (ms per step, median of "
                            f"{report['rounds']} rounds)")
        for col in ("placement", "host layers", "modelled", "measured", "x all-host", "x brute-force"):
            table.add_column(col, justify="left" if col == "placement" else "right")
        for name, row in case["placements"].items():
            if not row["fits"]:
                table.add_row(name, str(row["host_layers"]), f"{row['modelled_ms']:.1f}",
                              "[red]infeasible[/]", "—", "—")
                continue
            table.add_row(name, str(row["host_layers"]), f"{row['modelled_ms']:.1f}", f"{row['measured_ms']:.1f}",
                          f"{row['ratio_to_all_host']:.3f}", f"{row['ratio_to_brute_force']:.3f}")
        console.print(table)
        console.print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in case["meets_goals"].items()))
    h = report["host_step"]
    console.print(f"host updates alone (every layer's, one step): {h['host_updates_alone_before_ms']:.1f} ms "
                  f"before, {h['host_updates_alone_now_ms']:.1f} ms now: [b]{h['host_updates_alone_speedup']:.2f}x[/]")
    console.print(f"all-host step: {h['before_foreach_1_thread_ms']:.1f} ms before (foreach AdamW, 1 host thread), "
                  f"{h['now_fused_ms']:.1f} ms now (fused AdamW, {h['now_threads']} host threads): "
                  f"[b]{h['speedup']:.2f}x[/]; all-device {h['all_device_ms']:.1f} ms, all-host/all-device "
                  f"{h['all_host_over_all_device']:.2f}")
    return 0
