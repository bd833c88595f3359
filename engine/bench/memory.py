"""`trainyard bench memory`: what to do with each layer's saved activations under a memory limit.

One process trains one transformer stage (the whole character-level GPT of the model
zoo, as a pipeline's single stage would run it) with AdamW. The capacity is 50% of
the peak the ledger measures when every layer keeps its activations. Side by side:

    keep              everything on the device: over the capacity, for reference (a plain torch loop)
    recompute         every layer recomputed (Megatron's "full" recompute)
    swap              every layer's activations copied to the host and back
    auto-ratio        the plan (engine/techniques/memory/planner.py): by swap/recompute cost ratio
    auto-reverse      the same rule in the opposite order
    auto-exhaustive   the cheapest assignment under the cost model (every one tried)
    torch-checkpoint  torch.utils.checkpoint on every layer, torch's own (no ledger inside)
    torch-save-on-cpu torch.autograd.graph.save_on_cpu: every saved tensor to the host (pinned on a GPU)

Each variant trains the same steps from the same weights, in rounds (one variant after
another, repeated) so drift hits all alike. The figures: each variant's median step
time as samples/s, its ratio to full recompute, the ledger's peak over the timed steps
against the capacity, and the bytes copied to the host per step.

On the CPU a "device" is this process, counted by the ledger; a swap is a memcpy on the
link thread (paced to --host-link-gbps when given, an emulated PCIe link). With `--device cuda`
(the default where a GPU is visible) the stage trains on GPU 0 and every variant reports the
allocator's peak beside the ledger's; "fits" is then the allocator's peak within the capacity.
torch's own variants save through their own hooks, which the ledger cannot see.

    trainyard bench memory [--json] [--rounds 8] [--steps 3] [--host-link-gbps G] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

VARIANTS = ("keep", "recompute", "swap", "auto-ratio", "auto-reverse", "auto-exhaustive")
# torch's own, for comparison: checkpoint on every layer, and every saved tensor to the host
TORCH_VARIANTS = ("torch-checkpoint", "torch-save-on-cpu")


class _Trainer:
    """One variant: its own model (same seed), optimizer, ledger and policy."""

    def __init__(self, variant: str, data, model_cfg, capacity: int, link_gbps: float, batch: int, kind: str):
        import torch

        from engine.config import MemoryConfig, OptimConfig
        from engine.runtime.devices import CudaDevice, LedgerDevice
        from engine.techniques.memory import ActivationPolicy
        from engine.models import build_model
        from engine.optim import make_optimizer
        self.torch = torch
        self.variant, self.data, self.batch = variant, data, batch
        self.device = CudaDevice(capacity, 0) if kind == "cuda" else LedgerDevice(capacity)
        self.model = build_model(model_cfg, data.meta, 0).to(self.device.torch_device)
        self.opt = make_optimizer(OptimConfig(name="adamw", lr=1e-3), self.model.parameters())
        self.device.ledger.track_module(self.model, self.opt)
        self.allocator_peak = 0
        policy = "keep" if variant in TORCH_VARIANTS else variant.split("-")[0]
        planner = variant.split("-")[1] if policy == "auto" else "ratio"
        self.policy = ActivationPolicy(self.model, self.device,
                                       MemoryConfig(policy=policy, host_link_gbps=link_gbps, planner=planner))
        self.step_index = 0
        self.times: list[float] = []
        self.peak = 0
        self.swapped: list[int] = []

    def step(self, timed: bool) -> None:
        from engine.data import batch_for
        from engine.strategies.ddp import cross_entropy
        torch, cuda = self.torch, self.device.kind == "cuda"
        x, y = (t.to(self.device.torch_device) for t in batch_for(self.data, self.step_index % 50, self.batch, 0))
        ledger = self.device.ledger
        self.policy.before_step(self.step_index)
        out_before = self.policy.swapped_out_bytes()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with ledger.saved_activations():
            self.opt.zero_grad()
            if self.variant == "torch-checkpoint":
                from torch.utils.checkpoint import checkpoint
                out = x
                for layer in self.model.layers:
                    out = checkpoint(layer, out, use_reentrant=False)
                cross_entropy(out, y).backward()
            elif self.variant == "torch-save-on-cpu":   # its hooks, inside the ledger's: the ledger sees none
                with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
                    loss = cross_entropy(self.model(x), y)
                loss.backward()
            else:
                cross_entropy(self.model(x), y).backward()
        self.opt.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        ledger.refresh()
        self.policy.after_step(self.step_index)
        if timed:
            self.times.append(elapsed)
            self.peak = max(self.peak, ledger.peak_bytes)
            if cuda:
                self.allocator_peak = max(self.allocator_peak, torch.cuda.max_memory_allocated())
            self.swapped.append(self.policy.swapped_out_bytes() - out_before)
        ledger.reset_peak()
        self.step_index += 1

    def close(self) -> None:
        self.policy.close()


def measure(rounds: int, steps: int, link_gbps: float, d_model: int, depth: int, seq_len: int, batch: int,
            kind: str = "cpu") -> dict:
    import torch

    from engine.config import load_config
    from engine.data import load_dataset
    from engine.techniques.memory import measure_link_gbps
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.name=transformer", "data.name=text", f"data.seq_len={seq_len}",
                             "data.text_chars=60000", f"model.d_model={d_model}", f"model.depth={depth}",
                             "model.heads=4"])
    data = load_dataset(cfg.data, 0)
    probe = _Trainer("keep", data, cfg.model, 1 << 40, link_gbps, batch, kind)
    for _ in range(3):
        probe.step(timed=True)
    keep_peak = probe.peak
    probe.close()
    capacity = keep_peak // 2
    trainers = {v: _Trainer(v, data, cfg.model, capacity, link_gbps, batch, kind) for v in VARIANTS + TORCH_VARIANTS}
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
        torch_own = v in TORCH_VARIANTS   # the ledger does not see inside torch's own hooks
        peak = t.allocator_peak if kind == "cuda" else None if torch_own else t.peak
        rows[v] = {"samples_per_s": batch / median_s, "median_step_ms": median_s * 1000,
                   "peak_bytes": None if torch_own else t.peak, "allocator_peak_bytes": t.allocator_peak or None,
                   "fits": None if peak is None else peak <= capacity,
                   "swapped_per_step_bytes": int(statistics.median(t.swapped)),
                   "swap_layers": sum(p == "swap" for p in policies.values()),
                   "recompute_layers": sum(p == "recompute" for p in policies.values()),
                   "plan": policies if v.startswith("auto") else None,
                   "note": t.policy.plan.note if t.policy.plan else ""}
        t.close()
    base = rows["recompute"]["samples_per_s"]
    for row in rows.values():
        row["vs_recompute"] = row["samples_per_s"] / base
    return {"capacity_bytes": capacity, "keep_peak_bytes": keep_peak, "layers": len(probe.model.names),
            "device": kind, "host_link_gbps": link_gbps or round(measure_link_gbps(torch.device(kind)), 2),
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
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where the stage trains (default: cuda when a GPU is there, else cpu)")
    args = parser.parse_args(argv)
    import torch
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    for name in ("rounds", "steps", "d_model", "depth", "seq_len", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.host_link_gbps < 0:
        parser.error("--host-link-gbps must be positive (0: unpaced)")
    out = measure(args.rounds, args.steps, args.host_link_gbps, args.d_model, args.depth, args.seq_len, args.batch,
                  kind)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    from engine.config import format_size
    where = "GPU (fits: the allocator's peak)" if kind == "cuda" else "CPU ledger (simulated device)"
    table = Table(title=f"bench memory: transformer stage ({out['layers']} layers), capacity "
                        f"{format_size(out['capacity_bytes'])} = 50% of keep's peak; {where}, "
                        f"host link {out['host_link_gbps']} GB/s ({out['link']})")
    for col in ("variant", "samples/s", "x full recompute", "ledger peak", "allocator peak", "fits", "swapped/step",
                "swap", "recompute"):
        table.add_column(col, justify="left" if col == "variant" else "right")

    def size(n):
        return "—" if n is None else format_size(n)
    for v, row in out["variants"].items():
        fits = "—" if row["fits"] is None else "yes" if row["fits"] else "[red]no[/]"
        table.add_row(v, f"{row['samples_per_s']:.1f}", f"{row['vs_recompute']:.2f}", size(row["peak_bytes"]),
                      size(row["allocator_peak_bytes"]), fits, format_size(row["swapped_per_step_bytes"]),
                      str(row["swap_layers"]), str(row["recompute_layers"]))
    console = Console()
    console.print(table)
    for v, row in out["variants"].items():
        if row["plan"]:
            chosen = ", ".join(f"{n}={p}" for n, p in row["plan"].items() if p != "keep") or "all keep"
            console.print(f"{v}: {chosen}" + (f" ({row['note']})" if row["note"] else ""))
    return 0
