"""`trainyard bench hybrid`: where should each layer's optimizer update run?

One worker (world 1: on this 2-core machine the host executor needs the other core)
trains a 12-layer MLP with AdamW. A trial (`update.placement = "auto"`) measures every
layer on both sides; from that profile the bench builds the placements below at two
device capacities: a tight one, where all-device does not fit (it is reported as
infeasible and not run), and a roomy one, where everything fits:

    all-device   every update inline on the compute thread
    all-host     every update on the host executor (ZeRO-Offload's placement)
    auto-global  the exact plan of the cost model (engine/techniques/updates/plan.py)
    auto-local   the layer-by-layer rule
    brute-force  the best of all 2^12 placements under the cost model

Each placement then trains the same steps from the same weights, in rounds (one
placement after another, repeated) so drift hits all alike; the figure is each
placement's median step time, and its ratio to all-host and to brute-force. In the same
rounds all-host runs once more as the host step was before fused kernels and a thread
pool (foreach AdamW on one host thread): `host_step` holds the two and their ratio.

    trainyard bench hybrid [--json] [--rounds 3] [--steps 8] [--device cuda|cpu] [--precision fp32|bf16]
    trainyard bench hybrid --clip-grad-norm 1.0      # clipping's cost, waiting for the norm or speculating

With `--precision bf16` the whole bench runs in fp32 and in bf16 (compute, params and reduce "bf16",
"bf16", "fp32": engine/training/precision.py) side by side: each precision profiles, plans and measures its own
placements, in the same rounds (a placement's two precisions back to back). In bf16 the model is cast to
bf16 before the strategy is built and every step runs under autocast; each layer's fp32 master and
optimizer state live where its update runs, so the host link of a host-placed layer carries bf16
gradients down and bf16 weights up: half the bytes. Each placement gets its host link bytes per step
(what the step's host updates moved, both ways) and its step time in both precisions, with the
bf16/fp32 ratios. On a CPU bf16 matmuls may be slower than fp32: the bytes are the figure. The host step
before and now (`host_step`) is fp32's. `--precision fp32` (the default) runs as before.

With `--clip-grad-norm X` the bench runs instead all-device and all-host (no trial, no plans), each without
clipping, clipping at X after waiting for the norm, and clipping speculatively, a placement's three modes back
to back in each round, with the rollback and clipped rates of the clipping runs and the goals
(engine/bench/clip.py). all-host is where speculation can win: its host updates overlap backward, and wait
holds them until backward ends. fp32 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from engine.bench.clip import add_precision_and_clip, check_precision_and_clip
from engine.bench.hybrid_tables import case_rows, compare_row, print_cases, print_comparison


def _model_and_data(hidden: int, depth: int, batch: int, kind: str = "cpu", precision: str = "fp32"):
    """The model (its working weights in `precision`'s dtype: bf16 under "bf16") and one batch."""
    import torch

    from engine.bench.broadcast import precision_config
    from engine.config import ModelConfig
    from engine.models import build_model
    from engine.training.precision import param_dtype
    model = build_model(ModelConfig(name="mlp", hidden=hidden, depth=depth),
                        {"input_dim": hidden, "num_classes": 10}, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, hidden, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    where = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if precision != "fp32":   # cast before the strategy is built: its updates make fp32 masters of bf16 weights
        model = model.to(param_dtype(precision_config(precision)))
    return model.to(where), x.to(where), y.to(where)


def _runner(topo, model, placement, profile_steps: int = 6, kernel: str = "auto", host_threads: int = 0,
            precision: str = "fp32", optim_keys: dict | None = None):
    """A DDPStrategy of one rank; `optim_keys`: [optim] keys over the bench's AdamW (--clip-grad-norm's modes)."""
    from engine.bench.broadcast import precision_config
    from engine.config import OptimConfig, UpdateConfig
    from engine.training.precision import reduce_dtype
    from engine.strategies.ddp import DDPStrategy
    from engine.runtime.devices import CudaDevice, LedgerDevice
    device = CudaDevice(1 << 40, 0) if next(model.parameters()).is_cuda else LedgerDevice(1 << 40)
    runner = DDPStrategy(model, OptimConfig(name="adamw", lr=1e-3, kernel=kernel, **(optim_keys or {})), topo, device,
                         update_cfg=UpdateConfig(placement=placement, profile_steps=profile_steps,
                                                 host_threads=host_threads),
                         reduce_dtype=reduce_dtype(precision_config(precision)))
    device.ledger.track_module(model, runner.optimizer)
    return runner


def _stepper(runner, precision: str):
    """runner.train_step, under `precision`'s compute context (fp32: none)."""
    from engine.bench.broadcast import precision_config
    from engine.training.precision import compute_in
    prec, where = precision_config(precision), runner.device.torch_device

    def step(x, y):
        with compute_in(prec, where):
            return runner.train_step(x, y)
    return step


def profile_job(topo, hidden: int, depth: int, batch: int, trial: int, kind: str = "cpu",
                precision: str = "fp32") -> dict:
    model, x, y = _model_and_data(hidden, depth, batch, kind, precision)
    runner = _runner(topo, model, "auto", profile_steps=trial, precision=precision)
    step = _stepper(runner, precision)
    for _ in range(trial):
        step(x, y)
    # a trial its time budget cut makes its profile at the step after (a busy host: seen in CI); wait for it
    for _ in range(trial):
        if runner.updater.trial.profile is not None:
            break
        step(x, y)
    profile = runner.updater.trial.profile
    runner.close()
    if profile is None:
        raise RuntimeError(f"the auto trial made no profile in {2 * trial} steps")
    return {"layers": [dataclasses.asdict(c) for c in profile.layers], "peak_bytes": profile.peak_bytes,
            "host_threads": profile.host_threads}


def measure_job(topo, hidden: int, depth: int, batch: int, placement: dict | str, steps: int, warmup: int,
                kernel: str = "auto", host_threads: int = 0, kind: str = "cpu", precision: str = "fp32",
                optim_keys: dict | None = None) -> dict:
    """ms per step, and the host link's bytes per step (the host-placed layers' updates, both ways); with
    `optim_keys` (--clip-grad-norm) the timed steps' guard fields too (`guard`: engine/bench/clip.py)."""
    from engine.bench.clip import GuardTally
    model, x, y = _model_and_data(hidden, depth, batch, kind, precision)
    runner = _runner(topo, model, placement, kernel=kernel, host_threads=host_threads, precision=precision,
                     optim_keys=optim_keys)
    train_step = _stepper(runner, precision)
    import torch

    def settle() -> None:   # the last host updates, and on a GPU its queued kernels, are part of the steps
        runner.sync()
        if kind == "cuda":
            torch.cuda.synchronize()
    for _ in range(warmup):
        train_step(x, y)
    settle()
    links, guard = [], GuardTally() if optim_keys is not None else None
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(x, y)
        links.append(runner.timings.get("host_link_bytes", 0))   # the step's host updates, both ways
        if guard is not None:
            guard.add(runner)
    settle()
    elapsed = time.perf_counter() - t0
    runner.close()
    out = {"ms": elapsed / steps * 1000, "host_link_bytes": statistics.median(links) if links else 0}
    return out if guard is None else {**out, "guard": guard.figures()}


def host_updates_ms(hidden: int, depth: int, kernel: str, threads: int, repeats: int = 5) -> float:
    """Every layer's host update of one step (gradients down, AdamW, weights up) on the host executor,
    with nothing else running: the host side's own speed, ms per step (median of `repeats`)."""
    import torch

    from engine.config import OptimConfig
    from engine.techniques.updates.host import HostExecutor
    from engine.techniques.updates.layer import LayerUpdate
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


def _plan_cases(measured: dict) -> dict:
    """From a profile job's figures: the layer costs, the state they add, and each capacity's plans and the
    distinct placements that fit (`todo`: placement tuple -> {layer: side})."""
    from engine.techniques.updates.plan import UpdateCost, Profile, fixed, plan_brute_force, plan_global, plan_local
    layers = tuple(UpdateCost(**c) for c in measured["layers"])
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
    return {"measured": measured, "layers": layers, "total_state": total_state, "cases": cases, "todo": todo}


def run_bench(hidden: int, depth: int, batch: int, rounds: int, steps: int, warmup: int, trial: int,
              kind: str = "cpu", precision: str = "fp32") -> dict:
    """`precision` "bf16": the whole bench in fp32 and in bf16, side by side (the report's "bf16" and
    "bf16_vs_fp32"); "fp32": fp32 only."""
    from engine.processes.procpool import DistPool
    precisions = ("fp32", "bf16") if precision == "bf16" else ("fp32",)
    compare = len(precisions) > 1
    with DistPool(1, timeout_s=120) as pool:
        setups = {}
        for p in precisions:   # each precision's own trial, and its own plans from it
            setups[p] = _plan_cases(pool.run(profile_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                             trial=trial, kind=kind, precision=p)[0])
        keys = list(dict.fromkeys(key for p in precisions for key in setups[p]["todo"]))
        times = {p: {key: [] for key in setups[p]["todo"]} for p in precisions}
        links = {p: {key: [] for key in setups[p]["todo"]} for p in precisions}
        # the host step as it was (one thread, foreach AdamW) beside today's (fused, HOST_THREADS threads)
        all_host = dict.fromkeys(setups["fp32"]["cases"]["roomy"]["names"], "host")
        before = []
        for _ in range(rounds):
            for key in keys:
                for p in precisions:   # a placement's precisions back to back: drift hits both alike
                    if key not in setups[p]["todo"]:
                        continue
                    got = pool.run(measure_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                   placement=setups[p]["todo"][key], steps=steps, warmup=warmup, kind=kind,
                                   precision=p)[0]
                    times[p][key].append(got["ms"])
                    links[p][key].append(got["host_link_bytes"])
            before.append(pool.run(measure_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                   placement=all_host, steps=steps, warmup=warmup, kernel="foreach",
                                   host_threads=1, kind=kind)[0]["ms"])
    fp32 = setups["fp32"]
    layers, measured = fp32["layers"], fp32["measured"]
    report = {"bench": "hybrid", "world": 1, "device": kind, "layers_with_updates": len(layers), "optimizer": "adamw",
              "hidden": hidden, "batch": batch, "rounds": rounds, "steps_per_round": steps,
              "peak_bytes_without_state": measured["peak_bytes"], "optimizer_state_bytes": fp32["total_state"],
              "profile": measured["layers"], "cases": {}}
    from engine.techniques.updates.host import default_host_threads
    threads = default_host_threads()
    alone_before = host_updates_ms(hidden, depth, "foreach", 1)
    alone_now = host_updates_ms(hidden, depth, "auto", threads)
    now_ms = statistics.median(times["fp32"][tuple("host" for _ in layers)])
    device_ms = statistics.median(times["fp32"][tuple("device" for _ in layers)])
    report["host_step"] = {
        "before_foreach_1_thread_ms": round(statistics.median(before), 2), "now_fused_ms": round(now_ms, 2),
        "now_threads": threads, "speedup": round(statistics.median(before) / now_ms, 3),
        "host_updates_alone_before_ms": round(alone_before, 2), "host_updates_alone_now_ms": round(alone_now, 2),
        "host_updates_alone_speedup": round(alone_before / alone_now, 3),
        "all_device_ms": round(device_ms, 2), "all_host_over_all_device": round(now_ms / device_ms, 3)}
    report["cases"] = case_rows(fp32["cases"], times["fp32"], links["fp32"] if compare else None)
    if not compare:
        return report
    bf16 = setups["bf16"]
    report.update({
        "precision": "bf16",
        "precisions": {p: _precision_names(p) for p in precisions},
        "bf16": {"layers_with_updates": len(bf16["layers"]), "peak_bytes_without_state": bf16["measured"]["peak_bytes"],
                 "optimizer_state_bytes": bf16["total_state"], "profile": bf16["measured"]["layers"],
                 "cases": case_rows(bf16["cases"], times["bf16"], links["bf16"])},
        "host_link_bytes_is": "per step: what the host-placed layers' updates moved over the host link, "
                              "gradients down and weights up (the strategy's timings' host_link_bytes)",
        "note": _bf16_note()})
    report["bf16_vs_fp32"] = {label: {name: compare_row(row, report["bf16"]["cases"][label]["placements"][name])
                                      for name, row in case["placements"].items()}
                              for label, case in report["cases"].items()}
    return report


# --clip-grad-norm: where speculation can win (all-host: every update overlaps backward on the host executor)
# and where its copies cost the compute thread (all-device: kept and, on a clip, redone inline)
CLIP_PLACEMENTS = {"all-device": "device", "all-host": "host"}


def run_clip_bench(hidden: int, depth: int, batch: int, rounds: int, steps: int, warmup: int, clip: float,
                   kind: str = "cpu") -> dict:
    """Each of CLIP_PLACEMENTS without clipping, clipping after waiting for the norm and speculatively
    (engine/bench/clip.py), a placement's three modes back to back in every round."""
    from engine.bench.clip import MODES, optim_keys, variant_row
    from engine.processes.procpool import DistPool
    runs = {name: {mode: [] for mode in MODES} for name in CLIP_PLACEMENTS}
    with DistPool(1, timeout_s=120) as pool:
        for _ in range(rounds):
            for name, placement in CLIP_PLACEMENTS.items():
                for mode in MODES:
                    got = pool.run(measure_job, timeout=600, hidden=hidden, depth=depth, batch=batch,
                                   placement=placement, steps=steps, warmup=warmup, kind=kind,
                                   optim_keys=optim_keys(mode, clip))[0]
                    runs[name][mode].append({"step_ms": got["ms"], "guard": got["guard"]})
    return {"bench": "hybrid", "clip_grad_norm": clip, "world": 1, "device": kind, "layers_with_updates": depth + 1,
            "optimizer": "adamw", "hidden": hidden, "batch": batch, "rounds": rounds, "steps_per_round": steps,
            "modes": {mode: optim_keys(mode, clip) for mode in MODES},
            "variants": [variant_row(name, runs[name], overlap=placement == "host")
                         for name, placement in CLIP_PLACEMENTS.items()]}


def _precision_names(name: str) -> dict:
    from engine.bench.broadcast import PRECISIONS
    return dict(zip(("compute", "params", "reduce"), PRECISIONS[name]))


def _bf16_note() -> str:
    from engine.bench.broadcast import BF16_NOTE
    return BF16_NOTE


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
    add_precision_and_clip(parser, "each placement's host link bytes per step",
                           "all-device and all-host without clipping, clipping at X after waiting for the norm, "
                           "and clipping speculatively")
    args = parser.parse_args(argv)
    import torch
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.depth + 1 > 20:
        parser.error("--depth: at most 19 (the brute force tries 2^(depth+1) placements)")
    if args.clip_grad_norm is not None:
        return _main_clip(parser, args, kind)
    report = run_bench(args.hidden, args.depth, args.batch, args.rounds, args.steps, args.warmup, args.trial, kind,
                       args.precision)
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table
    console = Console()
    compare = args.precision == "bf16"
    for precision, figures in ((("fp32", report), ("bf16", report["bf16"])) if compare else ((None, report),)):
        print_cases(console, Table, report, figures, kind, precision)
    if compare:
        print_comparison(console, Table, report)
    h = report["host_step"]
    fp32 = "fp32 " if compare else ""
    console.print(f"{fp32}host updates alone (every layer's, one step): {h['host_updates_alone_before_ms']:.1f} ms "
                  f"before, {h['host_updates_alone_now_ms']:.1f} ms now: [b]{h['host_updates_alone_speedup']:.2f}x[/]")
    console.print(f"{fp32}all-host step: {h['before_foreach_1_thread_ms']:.1f} ms before (foreach AdamW, 1 host "
                  f"thread), {h['now_fused_ms']:.1f} ms now (fused AdamW, {h['now_threads']} host threads): "
                  f"[b]{h['speedup']:.2f}x[/]; all-device {h['all_device_ms']:.1f} ms, all-host/all-device "
                  f"{h['all_host_over_all_device']:.2f}")
    return 0


def _main_clip(parser, args, kind: str) -> int:
    check_precision_and_clip(parser, args)
    report = run_clip_bench(args.hidden, args.depth, args.batch, args.rounds, args.steps, args.warmup,
                            args.clip_grad_norm, kind)
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table

    from engine.bench.clip import print_rows
    title = (f"hybrid update, clipping at {report['clip_grad_norm']:g}: {report['layers_with_updates']} layers, "
             f"AdamW, 1 worker on {kind} (ms per step, median of {report['rounds']} rounds; rates over "
             f"{report['variants'][0]['timed_steps']} timed steps)")
    print_rows(Console(), Table, title, report["variants"])
    return 0


