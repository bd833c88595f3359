"""The plain PyTorch loop `trainyard bench step` compares trainyard with: what a user writes for a Hugging Face
model, in a process of its own (one turn of engine/bench/step.py).

    python -m engine.bench.step_plain --hf-config DIR --tokens FILE --batch 8 --seq-len 64 --steps 30 \
        --device cpu --precision fp32 [--compile [--backend inductor]] [--no-cache] [--count-flops]

Per step: a random batch of batch x (seq_len + 1) ids from the token file, `model(input_ids=x).logits` (under
`torch.autocast(bfloat16)` where --precision is bf16), fp32 cross-entropy, backward, `AdamW(fused=True).step()`,
`zero_grad(set_to_none=True)`, `loss.item()`. `--compile`: each decoder block `block.compile()`d, as
torchtitan's regional compilation. `--no-cache`: `model(input_ids=x, use_cache=False)`. A Hugging Face causal LM
builds a KV cache in a training forward too unless told not to (its config's `use_cache`), and each block's
compiled graph guards on its own layer of that cache: every block compiles a graph of its own, and the blocks past
dynamo's recompile limit (8) run eager. With `--compile`, the printed object says `graphs` (the graphs dynamo
compiled), `blocks` and `recompile_limit`. The weights are built from the config with torch.manual_seed(0), the same in
every turn. `--stream`: each step's end and ms as it ends, a JSON line each (bench step's interleaved
turns, engine/bench/step_interleave.py). `--trace DIR`: the last steps but one recorded by torch.profiler
(engine/runtime/trace.py), as `trainyard run`'s `[telemetry] trace_steps` records its own. Prints one JSON
object: every step's wall time (ms, from one `loss.item()` to the next), the peak
memory (the CUDA allocator's, or the process's peak RSS on the CPU) and, with --count-flops, the FLOPs of one
step (torch's FlopCounterMode, on the first step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from engine.bench.checkpoint import peak_rss
from engine.bench.step import GRAPH_FIELDS


def plain_optimizer(params) -> torch.optim.Optimizer:
    """The plain loop's optimizer, as a user writes it: torch's AdamW defaults (weight decay 0.01 among them) but
    the learning rate. bench step's trainyard variants set the same in their `[optim]` (step.py `run_config`)."""
    return torch.optim.AdamW(params, lr=3e-4, fused=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.step_plain")
    parser.add_argument("--hf-config", required=True)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--backend", default="inductor",
                        help="--compile's torch.compile backend (the tests count graphs with `eager`, which compiles none)")
    parser.add_argument("--no-cache", action="store_true", help="use_cache=False: no KV cache built in training")
    parser.add_argument("--count-flops", action="store_true")
    parser.add_argument("--stream", action="store_true",
                        help="print each step's end (Unix time) and ms as a line of JSON as it ends "
                             "(bench step's interleaved turns); --steps 0: until killed")
    parser.add_argument("--trace", metavar="DIR", help="record the last steps but one (3 at most) with torch.profiler: "
                                                       "DIR/plain.txt and DIR/plain.json (engine/runtime/trace.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # trainyard's worker runs one thread: the same cores for both
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_config)).to(args.device)
    if args.compile:
        for block in model.model.layers:
            block.compile(backend=args.backend)
    forward_kwargs = {"use_cache": False} if args.no_cache else {}
    opt = plain_optimizer(model.parameters())
    data = torch.from_numpy(np.fromfile(args.tokens, dtype=np.uint16).astype(np.int64))
    window = args.seq_len + 1
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        starts = torch.randint(0, len(data) - window, (args.batch,), generator=generator)
        xy = torch.stack([data[s:s + window] for s in starts.tolist()]).to(args.device)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast(args.device, torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(input_ids=x, **forward_kwargs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    flops = None
    trace = None
    if args.trace:
        from pathlib import Path
        from engine.runtime.trace import StepTrace, last_steps_but_one
        trace = StepTrace(*last_steps_but_one(args.steps), Path(args.trace), "plain", torch.device(args.device))
    times, last = [], time.perf_counter()
    for k in range(args.steps) if args.steps else itertools.count():
        if trace:
            trace.before(k)
        if k == 0 and args.count_flops:
            from engine.training.throughput import counted_flops
            _, flops, _ = counted_flops(step)
        else:
            step()
        now = time.perf_counter()
        if args.stream:
            print(json.dumps({"end": time.time(), "ms": (now - last) * 1000}), flush=True)
        else:
            times.append((now - last) * 1000)
        if trace:
            trace.after(k + 1)
        last = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else peak_rss()
    graphs = {}
    if args.compile:
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.utils import counters
        graphs = dict(zip(GRAPH_FIELDS, (counters["stats"]["unique_graphs"], len(model.model.layers),
                                         getattr(dynamo_config, "recompile_limit", None)
                                         or getattr(dynamo_config, "cache_size_limit", None))))
    print(json.dumps({"step_ms": times, "peak_bytes": peak, "flops": flops, **graphs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
