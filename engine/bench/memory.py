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
another, repeated) so drift hits all alike. In each round a variant is built afresh (same seed), warmed up
(auto plans after its second step) and timed, then freed before the next is built: one variant's model
is alive at a time, so on a GPU each allocator peak is its own. The figures: each variant's median step
time as samples/s, its ratio to full recompute, the ledger's peak over the timed steps
against the capacity, and the bytes copied to the host per step; in the JSON also what swapping waited for
per step: `host_wait_ms_per_step` (the host held by backpressure, and on the CPU by a fetch) and
`stalls_per_step` (unpacks that found their storage not back: on a GPU the compute stream waited for a copy in).

On the CPU a "device" is this process, counted by the ledger; a swap is a memcpy on the
link thread (paced to --host-link-gbps when given, an emulated PCIe link). With `--device cuda`
(the default where a GPU is visible) the stage trains on GPU 0 and every variant reports the
allocator's peak beside the ledger's; "fits" is then the allocator's peak within the capacity, taken
with only that variant's model on the GPU (less what the allocator still held from before its step, which
`_Trainer.resident_bytes` tells apart from its own).
torch's own variants save through their own hooks, which the ledger cannot see.

    trainyard bench memory [--json] [--rounds 8] [--steps 3] [--host-link-gbps G] [--device cuda|cpu]
    trainyard bench memory --precision bf16        # every variant in fp32 and in bf16, side by side

With `--precision bf16` every variant runs in fp32 and in bf16 (compute, params and reduce "bf16", "bf16",
"fp32": engine/training/precision.py) in the same rounds, each precision at 50% of its own keep's peak. In bf16 the
model is cast to bf16 before anything is built on it, each step runs under autocast, and AdamW steps an
fp32 master of each layer's weights on the device (engine/techniques/updates/layer.py; the ledger's
`master`). Beside each precision's table the bench gives the bytes keep holds (parameters, gradients,
optimizer state, masters, the activations saved by the end of the forward, the peak) in both with the
bf16/fp32 ratios, and each variant's peak, swapped bytes and step time in both. Parameters and gradients
halve exactly; activations about halve (what autocast leaves fp32, a transformer's residual stream, stays
fp32); optimizer state and masters are fp32, so a peak halves only as far as activations dominate it. On a
CPU bf16 matmuls may be slower than fp32: the bytes are the figure. `--precision fp32` (the default) runs
as before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

VARIANTS = ("keep", "recompute", "swap", "auto-ratio", "auto-reverse", "auto-exhaustive")
# torch's own, for comparison: checkpoint on every layer, and every saved tensor to the host
TORCH_VARIANTS = ("torch-checkpoint", "torch-save-on-cpu")


class _MasterUpdates:
    """AdamW over bf16 working weights, as the engine steps them: one LayerUpdate per layer with parameters
    (engine/techniques/updates/layer.py), each widening the gradient, stepping an fp32 master on the device
    and writing it back narrowed; one optimizer's math over the model. `state` and `master_bytes()` are what
    the ledger counts (optimizer state and masters)."""

    def __init__(self, model, cfg):
        from engine.models.layers import params_by_layer
        from engine.techniques.updates.layer import LayerUpdate
        self.params = list(model.parameters())
        self.updates = [LayerUpdate(model.names[i], i, ps, cfg) for i, ps in params_by_layer(model).items() if ps]

    @property
    def state(self) -> dict:
        return {k: v for u in self.updates for k, v in u.optimizer.state.items()}

    def master_bytes(self) -> int:
        return sum(u.master_bytes() for u in self.updates)

    def zero_grad(self) -> None:   # as a torch optimizer's (set_to_none)
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for u in self.updates:
            u.step_device()


class _Trainer:
    """One variant in one precision: its own model (same seed), optimizer, ledger and policy."""

    alive = 0   # trainers built and not yet closed: one at a time (tests/test_bench.py asserts it)

    def __init__(self, variant: str, data, model_cfg, capacity: int, link_gbps: float, batch: int, kind: str,
                 precision: str = "fp32"):
        import torch

        from engine.bench.broadcast import precision_config
        from engine.config import MemoryConfig, OptimConfig
        from engine.training.precision import compute_in, param_dtype
        from engine.runtime.devices import CudaDevice, LedgerDevice
        from engine.techniques.memory import ActivationPolicy
        from engine.models import build_model
        from engine.training.optim import make_optimizer
        _Trainer.alive += 1
        self.torch = torch
        self.variant, self.data, self.batch = variant, data, batch
        self.device = CudaDevice(capacity, 0) if kind == "cuda" else LedgerDevice(capacity)
        self.model = build_model(model_cfg, data.meta, 0).to(self.device.torch_device)
        prec = precision_config(precision)
        self.compute = lambda: compute_in(prec, self.device.torch_device)   # fp32: no context at all
        optim = OptimConfig(name="adamw", lr=1e-3)
        if precision == "fp32":
            self.opt = make_optimizer(optim, self.model.parameters())
        else:   # the working weights in bf16 before anything is built on them; fp32 masters beside them
            self.model = self.model.to(param_dtype(prec))
            self.opt = _MasterUpdates(self.model, optim)
        self.device.ledger.track_module(self.model, self.opt)
        self.saved = 0   # the most activation bytes saved on the device by the end of a timed forward
        self.allocator_peak = 0
        policy = "keep" if variant in TORCH_VARIANTS else variant.split("-")[0]
        planner = variant.split("-")[1] if policy == "auto" else "ratio"
        self.policy = ActivationPolicy(self.model, self.device,
                                       MemoryConfig(policy=policy, host_link_gbps=link_gbps, planner=planner))
        self.step_index = 0
        self.times: list[float] = []
        self.peak = 0
        self.swapped: list[int] = []
        self.host_waits: list[float] = []   # ms a step's host waited for the link (backpressure; a fetch on the CPU)
        self.stalls: list[int] = []         # a step's unpacks that found their storage not back yet

    def resident_bytes(self) -> int:
        """What this variant keeps on the device between steps, as the caching allocator counts it (each
        storage rounded up to its 512-byte blocks): weights, gradients, optimizer state and masters. A
        variant's allocator peak is its step's peak less anything else still allocated (`other_bytes`: with one
        variant alive at a time, what a probe or the last variant left to the allocator, normally nothing)."""
        torch = self.torch
        tensors = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters()]
        tensors += [v for state in self.opt.state.values() for v in state.values()]
        if isinstance(self.opt, _MasterUpdates):
            tensors += [m for u in self.opt.updates for m in (u.master or ())]
        seen, total = set(), 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += -(-max(storage.nbytes(), 1) // 512) * 512
        return total

    def step(self, timed: bool) -> None:
        from engine.training.data import batch_for
        from engine.training.loss import cross_entropy
        torch, cuda = self.torch, self.device.kind == "cuda"
        if cuda:   # the bytes the other variants hold, and the cache's own, are not this variant's peak
            torch.cuda.synchronize()
            other_bytes = torch.cuda.memory_allocated() - self.resident_bytes()
            torch.cuda.reset_peak_memory_stats()
        x, y = (t.to(self.device.torch_device) for t in batch_for(self.data, self.step_index % 50, self.batch, 0))
        ledger = self.device.ledger
        self.policy.before_step(self.step_index)
        out_before = self.policy.swapped_out_bytes()
        wait_before, stalls_before = self.policy.link_wait_s(), self.policy.swap_stalls()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        saved = 0
        with ledger.saved_activations(), self.compute():
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
                loss = cross_entropy(self.model(x), y)
                saved = ledger.bytes["activations"]   # what the forward left on the device for backward
                loss.backward()
        self.opt.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        ledger.refresh()
        self.policy.after_step(self.step_index)
        if timed:
            self.times.append(elapsed)
            self.peak = max(self.peak, ledger.peak_bytes)
            self.saved = max(self.saved, saved)
            if cuda:
                self.allocator_peak = max(self.allocator_peak, torch.cuda.max_memory_allocated() - other_bytes)
            self.swapped.append(self.policy.swapped_out_bytes() - out_before)
            self.host_waits.append((self.policy.link_wait_s() - wait_before) * 1000)
            self.stalls.append(self.policy.swap_stalls() - stalls_before)
        ledger.reset_peak()
        self.step_index += 1

    def close(self) -> None:
        self.policy.close()
        _Trainer.alive -= 1



class _Tally:
    """A variant's figures over the rounds, each round's trainer built afresh and freed after it."""

    def __init__(self):
        self.times, self.swapped, self.host_waits, self.stalls = [], [], [], []
        self.peak = self.saved = self.allocator_peak = 0
        self.policies, self.note = {}, ""

    def add(self, t: _Trainer) -> None:
        self.times += t.times
        self.swapped += t.swapped
        self.host_waits += t.host_waits
        self.stalls += t.stalls
        self.peak, self.saved = max(self.peak, t.peak), max(self.saved, t.saved)
        self.allocator_peak = max(self.allocator_peak, t.allocator_peak)
        self.policies, self.note = t.policy.policies(), t.policy.plan.note if t.policy.plan else ""


def _free(t: _Trainer) -> None:
    """Close a round's trainer and give its device memory back before the next variant is built."""
    t.close()
    torch = t.torch
    del t
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


HELD = ("parameters", "gradients", "optimizer_state", "master")   # the ledger's categories keep holds all step


def measure(rounds: int, steps: int, link_gbps: float, d_model: int, depth: int, seq_len: int, batch: int,
            kind: str = "cpu", precision: str = "fp32") -> dict:
    """`precision` "bf16": every variant in fp32 and in bf16, side by side (the report's "bf16", "bytes" and
    "bf16_vs_fp32"); "fp32": fp32 only."""
    import torch

    from engine.config import load_config
    from engine.training.data import load_dataset
    from engine.techniques.memory import measure_link_gbps
    torch.set_num_threads(1)
    precisions = ("fp32", "bf16") if precision == "bf16" else ("fp32",)
    cfg = load_config(None, ["model.name=transformer", "data.name=text", f"data.seq_len={seq_len}",
                             "data.text_chars=60000", f"model.d_model={d_model}", f"model.depth={depth}",
                             "model.heads=4"])
    data = load_dataset(cfg.data, 0)
    capacity, keep_peak, held = {}, {}, {}
    for p in precisions:   # each precision's capacity: 50% of its own keep's peak
        probe = _Trainer("keep", data, cfg.model, 1 << 40, link_gbps, batch, kind, p)
        for _ in range(3):
            probe.step(timed=True)
        keep_peak[p] = probe.peak
        ledger = probe.device.ledger
        ledger.refresh()
        held[p] = {**{k: ledger.bytes[k] for k in HELD}, "activations": probe.saved, "keep_peak": probe.peak}
        layers = len(probe.model.names)
        _free(probe)
        capacity[p] = keep_peak[p] // 2
    # a variant's precisions back to back in each round: drift hits both alike; one variant alive at a time
    tallies = {(p, v): _Tally() for v in VARIANTS + TORCH_VARIANTS for p in precisions}
    for _ in range(rounds):
        for (p, v), tally in tallies.items():
            t = _Trainer(v, data, cfg.model, capacity[p], link_gbps, batch, kind, p)
            for _ in range(3):   # warm-up; auto measures its second step and plans after it
                t.step(timed=False)
            for _ in range(steps):
                t.step(timed=True)
            tally.add(t)
            _free(t)
    compare = len(precisions) > 1
    rows = {prec: {} for prec in precisions}
    for (prec, v), t in tallies.items():
        median_s = statistics.median(t.times)
        policies = t.policies
        torch_own = v in TORCH_VARIANTS   # the ledger does not see inside torch's own hooks
        peak = t.allocator_peak if kind == "cuda" else None if torch_own else t.peak
        rows[prec][v] = {"samples_per_s": batch / median_s, "median_step_ms": median_s * 1000,
                         "peak_bytes": None if torch_own else t.peak, "allocator_peak_bytes": t.allocator_peak or None,
                         "fits": None if peak is None else peak <= capacity[prec],
                         "swapped_per_step_bytes": int(statistics.median(t.swapped)),
                         "host_wait_ms_per_step": round(statistics.median(t.host_waits), 3),
                         "stalls_per_step": statistics.median(t.stalls),
                         "swap_layers": sum(p == "swap" for p in policies.values()),
                         "recompute_layers": sum(p == "recompute" for p in policies.values()),
                         "plan": policies if v.startswith("auto") else None,
                         "note": t.note}
        if compare:   # the activations the forward left on the device (the ledger's; not inside torch's hooks)
            rows[prec][v]["activation_bytes"] = None if torch_own else t.saved
    for by_variant in rows.values():
        base = by_variant["recompute"]["samples_per_s"]
        for row in by_variant.values():
            row["vs_recompute"] = row["samples_per_s"] / base
    out = {"capacity_bytes": capacity["fp32"], "keep_peak_bytes": keep_peak["fp32"], "layers": layers,
           "device": kind, "host_link_gbps": link_gbps or round(measure_link_gbps(torch.device(kind)), 2),
           "link": "paced (emulated)" if link_gbps else "measured memcpy", "variants": rows["fp32"],
           "model": {"d_model": d_model, "depth": depth, "seq_len": seq_len, "batch": batch},
           "rounds": rounds, "steps": steps}
    if not compare:
        return out
    from engine.bench.broadcast import BF16_NOTE, PRECISIONS, ratio
    out.update({
        "precision": "bf16",
        "precisions": {p: dict(zip(("compute", "params", "reduce"), PRECISIONS[p])) for p in precisions},
        "bf16": {"capacity_bytes": capacity["bf16"], "keep_peak_bytes": keep_peak["bf16"], "variants": rows["bf16"]},
        # what keep holds (the ledger's bytes after its probe's steps; activations: saved by the end of a forward)
        "bytes": held,
        "bf16_vs_fp32": {
            "bytes": {k: ratio(held["bf16"][k], held["fp32"][k], 4) for k in held["fp32"]},
            "variants": {v: {"peak_ratio": ratio(row["peak_bytes"], rows["fp32"][v]["peak_bytes"], 4),
                             "activation_ratio": ratio(row["activation_bytes"], rows["fp32"][v]["activation_bytes"], 4),
                             "swapped_ratio": ratio(row["swapped_per_step_bytes"],
                                                    rows["fp32"][v]["swapped_per_step_bytes"], 4),
                             "step_ratio": ratio(row["median_step_ms"], rows["fp32"][v]["median_step_ms"])}
                         for v, row in rows["bf16"].items()}},
        "note": BF16_NOTE})
    return out


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
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: every variant in fp32 and in bf16 side by side, with the bytes keep holds and "
                             "the bf16/fp32 ratios (default fp32: fp32 only)")
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
                  kind, args.precision)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    from engine.bench.memory_tables import print_comparison, print_variants
    console = Console()
    compare = args.precision == "bf16"
    for precision, figures in ((("fp32", out), ("bf16", out["bf16"])) if compare else ((None, out),)):
        print_variants(console, Table, out, figures, kind, precision)
    if compare:
        print_comparison(console, Table, out)
    return 0
