"""`trainyard bench memory`: what to do with each layer's saved activations under a memory limit.

One process trains one transformer stage (the whole character-level GPT of the model
zoo, as a pipeline's single stage would run it) with AdamW. The capacity is 50% of
the peak the ledger measures when every layer keeps its activations. Side by side:

    keep              everything on the device: over the capacity, for reference
    recompute         every layer recomputed (Megatron's "full" recompute)
    swap              every layer's activations copied to the host and back
    auto-ratio        the plan (engine/memory.py): by swap/recompute cost ratio
    auto-reverse      the same rule in the opposite order
    auto-exhaustive   the cheapest assignment under the cost model (every one tried)

Each variant trains the same steps from the same weights, in rounds (one variant after
another, repeated) so drift hits all alike. The figures: each variant's median step
time as samples/s, its ratio to full recompute, the ledger's peak over the timed steps
against the capacity, and the bytes copied to the host per step.

On the CPU a "device" is this process, counted by the ledger; a swap is a memcpy on the
link thread (paced to --host-link-gbps when given, an emulated PCIe link).

    trainyard bench memory [--json] [--rounds 8] [--steps 3] [--host-link-gbps G]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

VARIANTS = ("keep", "recompute", "swap", "auto-ratio", "auto-reverse", "auto-exhaustive")


class _Trainer:
    """One variant: its own model (same seed), optimizer, ledger and policy."""

    def __init__(self, variant: str, data, model_cfg, capacity: int, link_gbps: float, batch: int):
        import torch

        from engine.config import MemoryConfig, OptimConfig
        from engine.devices import LedgerDevice
        from engine.memory import ActivationPolicy
        from engine.models import build_model
        from engine.optim import make_optimizer
        self.torch = torch
        self.variant, self.data, self.batch = variant, data, batch
        self.model = build_model(model_cfg, data.meta, 0)
        self.device = LedgerDevice(capacity)
        self.opt = make_optimizer(OptimConfig(name="adamw", lr=1e-3), self.model.parameters())
        self.device.ledger.track_module(self.model, self.opt)
        policy = variant.split("-")[0]
        planner = variant.split("-")[1] if policy == "auto" else "ratio"
        self.policy = ActivationPolicy(self.model, self.device,
                                       MemoryConfig(policy=policy, host_link_gbps=link_gbps, planner=planner))
        self.step_index = 0
        self.times: list[float] = []
        self.peak = 0
        self.swapped: list[int] = []

    def step(self, timed: bool) -> None:
        from engine.data import batch_for
        from engine.ddp import cross_entropy
        x, y = batch_for(self.data, self.step_index % 50, self.batch, 0)
        ledger = self.device.ledger
        self.policy.before_step(self.step_index)
        out_before = self.policy.swapped_out_bytes()
        t0 = time.perf_counter()
        with ledger.saved_activations():
            self.opt.zero_grad()
            cross_entropy(self.model(x), y).backward()
        self.opt.step()
        elapsed = time.perf_counter() - t0
        ledger.refresh()
        self.policy.after_step(self.step_index)
        if timed:
            self.times.append(elapsed)
            self.peak = max(self.peak, ledger.peak_bytes)
            self.swapped.append(self.policy.swapped_out_bytes() - out_before)
        ledger.reset_peak()
        self.step_index += 1

    def close(self) -> None:
        self.policy.close()


def measure(rounds: int, steps: int, link_gbps: float, d_model: int, depth: int, seq_len: int, batch: int) -> dict:
    import torch

    from engine.config import load_config
    from engine.data import load_dataset
    from engine.memory import measure_link_gbps
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.name=transformer", "data.name=text", f"data.seq_len={seq_len}",
                             "data.text_chars=60000", f"model.d_model={d_model}", f"model.depth={depth}",
                             "model.heads=4"])
    data = load_dataset(cfg.data, 0)
    probe = _Trainer("keep", data, cfg.model, 1 << 40, link_gbps, batch)
    for _ in range(3):
        probe.step(timed=True)
    keep_peak = probe.peak
    probe.close()
    capacity = keep_peak // 2
    trainers = {v: _Trainer(v, data, cfg.model, capacity, link_gbps, batch) for v in VARIANTS}
    for t in trainers.values():   # warm-up; auto measures its second step and plans after it
        for _ in range(3):
            t.step(timed=False)
    for _ in range(rounds):
        for t in trainers.values():
            for _ in range(steps):
                t.step(timed=True)
    rows = {}
    for v, t in trainers.items():
        median_s = statistics.median(t.times)
        policies = t.policy.policies()
        rows[v] = {"samples_per_s": batch / median_s, "median_step_ms": median_s * 1000, "peak_bytes": t.peak,
                   "fits": t.peak <= capacity, "swapped_per_step_bytes": int(statistics.median(t.swapped)),
                   "swap_layers": sum(p == "swap" for p in policies.values()),
                   "recompute_layers": sum(p == "recompute" for p in policies.values()),
                   "plan": policies if v.startswith("auto") else None,
                   "note": t.policy.plan.note if t.policy.plan else ""}
        t.close()
    base = rows["recompute"]["samples_per_s"]
    for row in rows.values():
        row["vs_recompute"] = row["samples_per_s"] / base
    return {"capacity_bytes": capacity, "keep_peak_bytes": keep_peak, "layers": len(probe.model.names),
            "host_link_gbps": link_gbps or round(measure_link_gbps(torch.device("cpu")), 2),
            "link": "paced (emulated)" if link_gbps else "measured memcpy", "variants": rows,
            "model": {"d_model": d_model, "depth": depth, "seq_len": seq_len, "batch": batch},
            "rounds": rounds, "steps": steps}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of every variant (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--host-link-gbps", type=float, default=0.0,
                        help="pace the CPU's host link to this many GB/s (default: unpaced memcpy, measured)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3, help="transformer blocks (3: 9 layers, exhaustive runs)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "d_model", "depth", "seq_len", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.host_link_gbps < 0:
        parser.error("--host-link-gbps must be positive (0: unpaced)")
    out = measure(args.rounds, args.steps, args.host_link_gbps, args.d_model, args.depth, args.seq_len, args.batch)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    from engine.config import format_size
    table = Table(title=f"bench memory: transformer stage ({out['layers']} layers), capacity "
                        f"{format_size(out['capacity_bytes'])} = 50% of keep's peak; CPU ledger (simulated device), "
                        f"host link {out['host_link_gbps']} GB/s ({out['link']})")
    for col in ("variant", "samples/s", "x full recompute", "ledger peak", "fits", "swapped/step", "swap", "recompute"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, row in out["variants"].items():
        table.add_row(v, f"{row['samples_per_s']:.1f}", f"{row['vs_recompute']:.2f}", format_size(row["peak_bytes"]),
                      "yes" if row["fits"] else "[red]no[/]", format_size(row["swapped_per_step_bytes"]),
                      str(row["swap_layers"]), str(row["recompute_layers"]))
    console = Console()
    console.print(table)
    for v, row in out["variants"].items():
        if row["plan"]:
            chosen = ", ".join(f"{n}={p}" for n, p in row["plan"].items() if p != "keep") or "all keep"
            console.print(f"{v}: {chosen}" + (f" ({row['note']})" if row["note"] else ""))
    return 0
