"""`trainyard bench step`: a user's model trained by trainyard against the plain PyTorch loop they would write,
eager and compiled, side by side in turns.

Every variant trains the same model (a Llama built from a config, or `--hf-config DIR`: any family), on the
same random token file, batch, precision and optimizer (AdamW, fused, at lr 3e-4 with torch's defaults, weight
decay 0.01 among them), one worker, in a process of its own per turn, so one variant's state is alive at a time
(six variants of a 1B model do not fit one GPU together) and each turn starts from the same seeded weights.
Compile caches (inductor's, in the bench's folder) are kept between turns.

    plain                 engine/bench/step_plain.py: the loop a user writes
    plain-compiled        the same, each decoder block `block.compile()`d
    plain-compiled-nocache   the same with `use_cache=False`: a Hugging Face causal LM builds a KV cache in a
                          training forward too, and each block's compiled graph guards on its own layer of it, so
                          with the cache each block compiles a graph of its own and the blocks past dynamo's
                          recompile limit (8) run eager (the GPU size's 16 blocks: 8 compiled). Without it, every
                          block shares one graph, as trainyard's compiled blocks do (their inputs carry no cache).
                          In turns, each compiled plain loop's `graphs` is said beside its blocks
    trainyard             `trainyard run`, ddp, world 1, memory.policy "keep", update.placement "device"
    trainyard-compiled    the same with `[model] compile = true` (where this trainyard has it)
    trainyard-auto        memory.policy and update.placement "auto", device.memory "auto" (the device's own
                          capacity; on the CPU the ledger's default)
    trainyard-bf16w       bf16 working weights (precision.params "bf16"), fp32 masters: with bf16 compute only

A trainyard variant is timed as its user sees it: the run's own step loop (engine/run/worker.py) with its
default telemetry, the wall time between step records (the records' samples_per_s); the plain loop from one
`loss.item()` to the next. `--mode turns` (a GPU's default): a process per variant per round, one after
another, a turn's figure the median of the second half of its steps (the first half holds the warm-up:
allocations, compiles, plans). `--mode interleaved` (the CPU's): every variant's process alive at once, in
slices of half a second on one CPU, the others stopped, `--cycles` (20) cycles of slices a round, new processes
each round (engine/bench/step_interleave.py; `--steps` halved is each one's warm-up). A ratio is taken within
each round (the same minutes of the machine; interleaved, the median over the round's cycles of the two slices'
ratio) and judged over the rounds (engine/bench/verdict.py: median, spread, met/missed/undecided). Every process
the bench starts, plain or trainyard's, has the same fixed host allocator thresholds (engine/processes/children.py
steady_host_allocator).

Sizes: on a GPU the TinyLlama shape (hidden 2048, 16 blocks, 32 heads, 4 KV heads, vocab 32000, batch 4 x
2048, bf16 autocast). On the CPU two sizes, fp32: `host` (hidden 64, 2 blocks, batch 8 x 64), where the
host's per-operation cost dominates as it does on a GPU, and the goals are judged; and `compute` (hidden 256,
4 blocks, vocab 8000, batch 8 x 256), compute-bound, reported. MFU: the FLOPs of one step, counted once by
torch's FlopCounterMode on the plain loop's first step, over the device's peak (engine/training/throughput.py:
a datasheet table, or measured once by a bf16 matmul, and said which); none on the CPU.

A turn's steps (`--steps`) default by size: 300 at the host size (a 13 ms step: 20 timed steps, a quarter of a
second, moved with this machine's neighbours by up to 30% from turn to turn), 60 at the compute size, 40 on a GPU.

    trainyard bench step [--json] [--rounds 3] [--steps N] [--device cpu|cuda] [--size host|compute|gpu]
                         [--hf-config DIR] [--variants a,b,...] [--mode turns|interleaved] [--cycles 20]
                         [--trace DIR]

A variant whose turn fails is said, with the end of its error, and the others are measured on. `--trace DIR`:
after the rounds, one more turn of plain and of trainyard, untimed, whose last steps but one torch.profiler
records (engine/runtime/trace.py): DIR/SIZE/VARIANT.txt, the operators by their own time, and .json, a Chrome
trace.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.bench.step_interleave import CYCLES_PER_ROUND
from engine.bench.verdict import judge, judge_ratio

SIZES = {   # LlamaConfig keywords, and the batch
    "host": dict(config=dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512), batch=8, seq_len=64, precision="fp32",
                 steps=300),
    "compute": dict(config=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=8000), batch=8, seq_len=256, precision="fp32",
                    steps=60),
    "gpu": dict(config=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=4, vocab_size=32000), batch=4, seq_len=2048, precision="bf16",
                steps=40),
}
VARIANTS = ("plain", "plain-compiled", "plain-compiled-nocache", "trainyard", "trainyard-compiled", "trainyard-auto",
            "trainyard-bf16w")
# the goals ("As fast as the loop it replaces"): variant / baseline >= goal, per device
# (trainyard compiled is judged against both compiled plain loops: the one the issue names, and the one whose
# blocks all compile)
GOALS = {"cpu": {("trainyard", "plain"): 0.97, ("trainyard-compiled", "plain-compiled"): 0.95,
                 ("trainyard-compiled", "plain-compiled-nocache"): 0.95, ("trainyard-auto", "trainyard"): 0.97},
         "cuda": {("trainyard", "plain"): 0.98, ("trainyard-compiled", "plain-compiled"): 0.97,
                  ("trainyard-compiled", "plain-compiled-nocache"): 0.97, ("trainyard-auto", "trainyard"): 0.98}}
BASES = ("plain", "plain-compiled", "plain-compiled-nocache")   # the ratios every row carries
GRAPH_FIELDS = ("graphs", "blocks", "recompile_limit")   # what a compiled plain loop says of its graphs (step_plain)
TURN_TIMEOUT_S = 1800


def write_inputs(folder: Path, size: dict, hf_config: str | None) -> Path:
    """The model's config folder (built from `size`, or the user's), and a random token file of its vocabulary."""
    if hf_config:
        from transformers import AutoConfig
        vocab = int(AutoConfig.from_pretrained(hf_config).vocab_size)
        config = Path(hf_config)
    else:
        from transformers import LlamaConfig
        config = folder / "model"
        LlamaConfig(**size["config"], max_position_embeddings=max(2048, size["seq_len"] + 1),
                    tie_word_embeddings=False).save_pretrained(config)
        vocab = size["config"]["vocab_size"]
    tokens = folder / "train.bin"
    count = max(1_000_000, size["batch"] * (size["seq_len"] + 1) * 64)
    np.random.default_rng(0).integers(0, min(vocab, 65535), count, dtype=np.uint16).tofile(tokens)
    return config


def run_config(variant: str, folder: Path, config: Path, size: dict, device: str, steps: int, turn: int,
               trace: str = "") -> Path:
    """A trainyard variant's run config (TOML)."""
    precision = size["precision"]
    memory = {"policy": "auto"} if variant == "trainyard-auto" else {"policy": "keep"}
    placement = "auto" if variant == "trainyard-auto" else "device"
    lines = [
        "[run]", f'name = "step-{variant}-{turn}"', f"steps = {steps}", "overwrite = true",
        "[model]", 'name = "hf"', f'hf_config = "{config}"', *(["compile = true"] if variant == "trainyard-compiled" else []),
        "[data]", 'name = "tokens"', f'train = "{folder / "train.bin"}"', f"seq_len = {size['seq_len']}",
        f"batch_size = {size['batch']}",
        # the plain loop's optimizer (step_plain.py plain_optimizer): torch's AdamW defaults, weight decay 0.01 too
        "[optim]", 'name = "adamw"', "lr = 3e-4", "beta1 = 0.9", "beta2 = 0.999", "eps = 1e-8", "weight_decay = 0.01",
        "[parallel]", 'strategy = "ddp"', "world_size = 1",
        "[device]", f'kind = "{device}"',
        "[precision]", f'compute = "{precision}"', *(['params = "bf16"'] if variant == "trainyard-bf16w" else []),
        "[memory]", f'policy = "{memory["policy"]}"',
        "[update]", f'placement = "{placement}"',
        "[checkpoint]", "at_end = false",   # a 1B model's end: 10 GB of checkpoint and an export, not the bench's
        *(["[telemetry]", f'trace_steps = "{trace}"'] if trace else []),
    ]
    path = folder / f"{variant}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(folder: Path) -> dict:
    from engine.processes.children import steady_host_allocator
    from engine.processes.forkserver import SHARED
    env = steady_host_allocator(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                     TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor")))
    env.pop(SHARED, None)   # a variant as a user runs it, its workers in its own tree: paused, pinned, measured
    return env


def command(variant: str, folder: Path, config: Path, size: dict, device: str, steps: int, number: int,
            count_flops: bool = False, trace: str = "", stream: bool = False) -> tuple[list[str], Path | None]:
    """A variant's command line, and (trainyard) its telemetry log. `steps` 0 with `stream`: until stopped."""
    if variant.startswith("plain"):
        return [sys.executable, "-m", "engine.bench.step_plain", "--hf-config", str(config), "--tokens",
                str(folder / "train.bin"), "--batch", str(size["batch"]), "--seq-len", str(size["seq_len"]),
                "--steps", str(steps), "--device", device, "--precision", size["precision"],
                *(["--compile"] if variant.startswith("plain-compiled") else []),
                *(["--no-cache"] if variant == "plain-compiled-nocache" else []),
                *(["--count-flops"] if count_flops else []),
                *(["--trace", str(folder / "trace")] if trace else []), *(["--stream"] if stream else [])], None
    cfg = run_config(variant, folder, config, size, device, steps or 10 ** 8, number, trace=trace)
    log = folder / f"{variant}-{number}.jsonl"
    return [sys.executable, "-c", "from engine.cli import main; raise SystemExit(main())", "run", str(cfg),
            "--headless", "--telemetry-log", str(log)], log


def turn(variant: str, folder: Path, config: Path, size: dict, device: str, steps: int, number: int,
         count_flops: bool, trace: Path | None = None) -> dict:
    """One variant's turn: {"step_ms": median of the second half, "steps": every step's ms, "peak_bytes",
    "flops" (plain, when counted), "compile_s" (trainyard-compiled, when the run says)}. `trace`: the last steps
    but one recorded by torch.profiler, their tables and traces copied there as VARIANT.txt and VARIANT.json."""
    env = _env(folder)
    from engine.runtime.trace import last_steps_but_one
    cmd, log = command(variant, folder, config, size, device, steps, number, count_flops,
                       trace="{}-{}".format(*last_steps_but_one(steps)) if trace else "")
    if variant.startswith("plain"):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder, timeout=TURN_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        if trace:
            _keep_trace(folder / "trace", "plain", trace, variant)
        ms = out["step_ms"]
        return {"step_ms": statistics.median(ms[len(ms) // 2:]), "steps": ms, "peak_bytes": out["peak_bytes"],
                "flops": out["flops"], **{k: out[k] for k in GRAPH_FIELDS if k in out}}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder, timeout=TURN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if trace:
        _keep_trace(folder / "runs" / f"step-{variant}-{number}" / "trace", "rank0", trace, variant)
    shutil.rmtree(folder / "runs" / f"step-{variant}-{number}", ignore_errors=True)
    log.unlink()
    step_records = [r for r in records if r.get("type") == "step"]
    ms = [1000 * size["batch"] / r["samples_per_s"] for r in step_records]
    summary = next((r for r in records if r.get("type") == "summary"), {})
    peaks = summary.get("allocator_peak_bytes_per_rank") if device == "cuda" else None
    rss = [row["rss_bytes"] for r in step_records for row in r.get("ranks", []) if "rss_bytes" in row]
    return {"step_ms": statistics.median(ms[len(ms) // 2:]), "steps": ms,
            "peak_bytes": (max(peaks) if peaks else max(rss) if rss else None),
            "compile_s": summary.get("compile_s")}


def _keep_trace(where: Path, stem: str, to: Path, variant: str) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for ext in ("txt", "json"):
        if (where / f"{stem}.{ext}").exists():
            shutil.move(where / f"{stem}.{ext}", to / f"{variant}.{ext}")


def speedup(per_round: dict[str, list[dict]], variant: str, base: str, at_least: float) -> dict:
    """`variant`'s speed over `base`'s (base's step over variant's), round by round, judged (verdict.py).
    Interleaved turns: a round's ratio is the median over its cycles of the two slices' ratio within a cycle
    (seconds apart), which a change of the machine's speed between cycles moves less than the round's medians."""
    pairs = list(zip(per_round[base], per_round[variant]))
    if pairs and all("slices_ms" in b and "slices_ms" in v for b, v in pairs):
        return judge([statistics.median(x / y for x, y in zip(b["slices_ms"], v["slices_ms"]) if x and y)
                      for b, v in pairs], at_least=at_least)
    return judge_ratio([b["step_ms"] for b, _ in pairs], [v["step_ms"] for _, v in pairs], at_least=at_least)


def peak_flops(device: str, precision: str) -> tuple[float | None, str]:
    """The device's peak FLOP/s: the datasheet table, else measured once by a bf16 matmul; none on the CPU."""
    if device != "cuda":
        return None, "no peak on the CPU"
    import torch
    from engine.training.throughput import device_peak_flops
    peak, source = device_peak_flops(torch.cuda.get_device_name(), precision)
    if peak is not None:
        return peak, source
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0), f"measured: a {n}x{n} bf16 matmul"


def _turns(variants, folder, config, size, device, steps, rounds, log):
    """Every variant's turns of a process each, round by round: (per_round, failed, flops)."""
    per_round: dict[str, list[dict]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    flops = None
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]   # who goes first rotates
        for v in (v for v in order if v not in failed):
            log(f"  round {r + 1}/{rounds}: {v}")
            try:
                got = turn(v, folder, config, size, device, steps, r,
                           count_flops=(v == "plain" and flops is None and device == "cuda"))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed[v] = str(e)[-2000:]
                log(f"  {v} failed: {failed[v]}")
                continue
            flops = got.get("flops") or flops
            per_round[v].append(got)
            log(f"    {v}: {got['step_ms']:.2f} ms a step" + (f", compiled in {got['compile_s']} s"
                                                              if got.get("compile_s") else "")
                + (f", {got['graphs']} graphs for {got['blocks']} blocks" if "graphs" in got else ""))
    return {v: turns for v, turns in per_round.items() if v not in failed}, failed, flops


def _interleaved(variants, folder, config, size, device, steps, rounds, log, cycles):
    """Every variant's process alive at once, in slices (engine/bench/step_interleave.py): (per_round, failed,
    None); `steps` is each one's warm-up before the slices begin."""
    from engine.bench.step_interleave import Contender, interleaved

    def make(r: int) -> dict:   # round r's processes, each run in a folder of its own (step-VARIANT-r)
        contenders = {}
        for v in variants:
            cmd, telemetry = command(v, folder, config, size, device, 0, r, stream=True)
            contenders[v] = Contender(v, cmd, _env(folder), folder, size["batch"], telemetry)
        return contenders
    per_round, failed = interleaved(make, rounds, steps, log, cycles)
    return per_round, failed, None


def measure(size_name: str, device: str, rounds: int, steps: int | None, variants: list[str],
            hf_config: str | None, log=print, trace: Path | None = None, interleave: bool = False,
            cycles: int = CYCLES_PER_ROUND) -> dict:
    """Every variant's turns, round by round: a process each, one after another, or (`interleave`) all alive
    at once, in slices of half a second. A variant whose turn fails is said (`failed`, with the end of its error) and
    left out of the rounds after, the others measured on. `trace`: after the rounds, one more turn of the plain
    loops and trainyard's (not timed), their last steps but one recorded by torch.profiler."""
    size = dict(SIZES[size_name])
    steps = steps or size["steps"]
    folder = Path(tempfile.mkdtemp(prefix="trainyard-bench-step-"))
    try:
        config = write_inputs(folder, size, hf_config)
        if interleave:
            per_round, failed, flops = _interleaved(variants, folder, config, size, device, steps // 2, rounds, log,
                                                    cycles)
        else:
            per_round, failed, flops = _turns(variants, folder, config, size, device, steps, rounds, log)
        for v in (v for v in ("plain", "plain-compiled", "trainyard", "trainyard-compiled") if trace and v in per_round):
            log(f"  traced turn: {v}")
            turn(v, folder, config, size, device, min(steps, 12), rounds, count_flops=False, trace=trace)
        peak, peak_source = peak_flops(device, size["precision"])
        tokens = size["batch"] * size["seq_len"]
        rows = {}
        for v, turns in per_round.items():
            ms = [t["step_ms"] for t in turns]
            step_ms = statistics.median(ms)
            row = {"step_ms": round(step_ms, 3), "rounds_ms": [round(x, 3) for x in ms],
                   "tokens_per_s": round(tokens / step_ms * 1000, 1),
                   "peak_bytes": max((t["peak_bytes"] or 0) for t in turns) or None}
            if flops and peak:
                row["mfu"] = round(flops / (step_ms / 1000) / peak, 4)
            if turns and "slices_ms" in turns[0]:   # interleaved: each slice's median, round by round
                row["slices_ms"] = [t["slices_ms"] for t in turns]
            compile_s = [t["compile_s"] for t in turns if t.get("compile_s") is not None]
            if compile_s:
                row["compile_s"] = compile_s
            if turns and "graphs" in turns[-1]:   # a compiled plain loop, in turns: how many of its blocks compiled
                row.update({k: turns[-1][k] for k in GRAPH_FIELDS})
            for base in BASES:
                if base in per_round and v != base:
                    faster = speedup(per_round, v, base, at_least=0.0)
                    row[f"x_{base}"], row[f"x_{base}_spread"] = faster["median"], faster["spread"]
            rows[v] = row
        judged = {f"{v} / {base}": speedup(per_round, v, base, at_least=goal)
                  for (v, base), goal in GOALS[device].items() if v in per_round and base in per_round}
        return {"size": size_name, "device": device, "model": {**size["config"]} if not hf_config else hf_config,
                "batch": size["batch"], "seq_len": size["seq_len"], "precision": size["precision"],
                "rounds": rounds, "steps": steps, "interleaved": interleave, "flops_per_step": flops,
                "peak_flops": peak,
                "peak_source": peak_source, "variants": [{"variant": v, **rows[v]} for v in per_round],
                "failed": failed, "judged": judged}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainyard bench step")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant (ratios judged over them)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps a turn trains (its second half is timed); default by size: host 300, compute 60, "
                             "gpu 40")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")
    parser.add_argument("--size", choices=tuple(SIZES), action="append",
                        help="default: gpu on a GPU; host and compute on the CPU")
    parser.add_argument("--hf-config", default=None, help="a Hugging Face config folder: that model, any family")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument("--mode", choices=("turns", "interleaved"), default=None,
                        help="turns: a process per variant per round, one after another (a GPU's default: one "
                             "variant's state at a time); interleaved: every variant's process alive at once, "
                             "in slices of half a second (the CPU's default; engine/bench/step_interleave.py)")
    parser.add_argument("--cycles", type=int, default=CYCLES_PER_ROUND,
                        help="interleaved: cycles of slices a round (each variant's figure in a round is the median "
                             "of the steps its slices kept)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="after the rounds, one more turn of plain and trainyard each, its last steps but one "
                             "recorded by torch.profiler: DIR/VARIANT.txt (operators by their own time) and .json "
                             "(a Chrome trace)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cycles < 1 or (args.steps is not None and args.steps < 4):
        parser.error("--rounds and --cycles must be at least 1 and --steps at least 4")
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    sizes = args.size or (["gpu"] if device == "cuda" else ["host", "compute"])
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; the variants are {', '.join(VARIANTS)}")
    left_out = {}
    for name in sizes:
        if SIZES[name]["precision"] != "bf16" and "trainyard-bf16w" in variants:
            left_out["trainyard-bf16w"] = "bf16 working weights need bf16 compute; this size computes in fp32"
    variants = [v for v in variants if v not in left_out]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    interleave = (args.mode or ("turns" if device == "cuda" else "interleaved")) == "interleaved"
    reports = [measure(name, device, args.rounds, args.steps, variants, args.hf_config, log, interleave=interleave,
                       cycles=args.cycles, trace=Path(args.trace) / name if args.trace else None) for name in sizes]
    result = {"reports": reports, "left_out": left_out}
    if args.json:
        print(json.dumps(result))
        return 0
    from engine.bench.step_tables import print_reports
    print_reports(reports, left_out, BASES)
    return 0
