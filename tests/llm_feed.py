"""Synthetic LLM-sized telemetry for the console's tests: a 32-block transformer's 195 layers on a
16-stage pipeline, or sharded over 8 ranks with 8 communication streams.

    names = transformer_names()                   # embed, blocks.0.ln1, blocks.0.attn, ..., ln_f, head
    rows = layer_rows(names, stages=16)           # a step's `layers`, each with its `stage`
    stages = stage_rows(names, 16)                # a step's `stages`
    write_feed(path, pipeline_records(16))        # a telemetry log for ReplaySource

Deterministic: every figure comes from the layer's name, its position and the step, never a clock
or a random generator, so snapshots of the console drawn from these feeds never change.
"""

from __future__ import annotations

import json
from pathlib import Path

MIB = 2**20
BLOCK = ("ln1", "attn", "ln2", "mlp.fc", "mlp.act", "mlp.proj")   # one transformer block's layers, in order
# per kind: (fwd ms, activation MiB); backward costs twice the forward
COST = {"embed": (0.4, 8), "ln1": (0.05, 4), "attn": (1.6, 24), "ln2": (0.05, 4), "mlp.fc": (0.9, 16),
        "mlp.act": (0.1, 16), "mlp.proj": (0.9, 4), "ln_f": (0.05, 4), "head": (1.2, 32)}
PARAMETERS = {"embed", "attn", "mlp.fc", "mlp.proj", "head"}   # kinds with weights (an owner, a placement)
T0 = 1795400000.0   # the log's first time stamp


def transformer_names(blocks: int = 32) -> list[str]:
    """The model's layers in forward order: 6 per block and 3 more (195 for 32 blocks)."""
    return ["embed", *(f"blocks.{b}.{kind}" for b in range(blocks) for kind in BLOCK), "ln_f", "head"]


def kind(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def split(names: list[str], stages: int) -> list[list[str]]:
    """Contiguous stages of near-equal size, earlier stages one more when it does not divide."""
    size, extra = divmod(len(names), stages)
    out, at = [], 0
    for s in range(stages):
        n = size + (s < extra)
        out.append(names[at:at + n])
        at += n
    return out


def layer_row(name: str, index: int, step: int) -> dict:
    fwd, act_mib = COST[kind(name)]
    fwd *= 1 + 0.01 * ((index * 7 + step * 3) % 11)   # a little spread, different every step
    row = {"name": name, "fwd_ms": round(fwd, 4), "bwd_ms": round(2 * fwd, 4), "activation_bytes": act_mib * MIB,
           "policy": ("keep", "swap", "recompute")[index % 3]}
    if kind(name) in PARAMETERS:
        row |= {"placement": "host" if index % 5 == 0 else "device", "update_ms": round(0.2 + 0.01 * index, 4)}
    return row


def layer_rows(names: list[str], *, stages: int | None = None, owners: int | None = None,
               step: int = 1) -> list[dict]:
    """A step's `layers`, in model order; with `stages` (pipeline) each row has its `stage`, with
    `owners` (sharded) each layer with parameters its `owner_rank`."""
    rows = [layer_row(name, i, step) for i, name in enumerate(names)]
    if stages:
        for s, part in enumerate(split(names, stages)):
            for row in rows[names.index(part[0]):names.index(part[-1]) + 1]:
                row["stage"] = s
    if owners:
        weighted = [row for row in rows if kind(row["name"]) in PARAMETERS]
        for i, row in enumerate(weighted):
            row["owner_rank"] = i % owners
    return rows


def stage_rows(names: list[str], stages: int, step: int = 1) -> list[dict]:
    """A pipeline step's `stages`: each stage's layers and the sums of their times."""
    rows = {row["name"]: row for row in layer_rows(names, step=step)}
    parts = split(names, stages)
    busy = [(sum(rows[n]["fwd_ms"] for n in part), sum(rows[n]["bwd_ms"] for n in part)) for part in parts]
    step_ms = 1.1 * max(fwd + bwd for fwd, bwd in busy)   # every stage waits out the slowest one's step
    return [{"stage": s, "rank": s, "layers": part, "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3),
             "idle_ms": round(step_ms - fwd - bwd, 3), "micro_batches": 8}
            for s, (part, (fwd, bwd)) in enumerate(zip(parts, busy))]


def stream_entries(streams: int, step: int = 1) -> list[dict]:
    """A step's `streams`: stream i carries (i + 1) MiB, more on some steps."""
    return [{"stream": i, "bytes": (i + 1) * MIB * (1 + (step + i) % 4), "busy_ms": 1.0 + i,
             "busy_fraction": round(min(0.99, 0.1 + 0.12 * i), 3), "in_flight": i % 3} for i in range(streams)]


def rank_entries(ranks: int) -> list[dict]:
    out = []
    for r in range(ranks):
        params = (20 + r) * MIB
        out.append({"rank": r, "loss": 3.2, "step_ms": 120.0, "fwd_ms": 30.0, "bwd_ms": 60.0, "optim_ms": 2.0,
                    "wait_ms": 8.0, "parameters_bytes": params, "gradients_bytes": params,
                    "optimizer_state_bytes": 2 * params, "activations_bytes": 40 * MIB, "swapped_bytes": 0,
                    "used_bytes": 4 * params + 40 * MIB, "peak_bytes": 4 * params + 48 * MIB,
                    "capacity_bytes": 1024 * MIB, "over_capacity": False, "rss_bytes": 600 * MIB,
                    "cpu_percent": 80.0})
    return out


def run_start(name: str, strategy: str, world_size: int, names: list[str]) -> dict:
    return {"schema": 1, "time": T0, "type": "run_start", "name": name, "strategy": strategy,
            "world_size": world_size, "backend": "gloo", "simulated": True,
            "device": "cpu (simulated device: memory from the engine's ledger)", "layers": names,
            "first_step": 0, "restart": 0, "config": {"run": {"name": name, "steps": 1000}}}


def step_record(step: int, ranks: int, **fields) -> dict:
    return {"schema": 1, "time": T0 + step * 0.12, "type": "step", "step": step, "loss": round(4.0 - 0.01 * step, 4),
            "samples_per_s": 1000.0 + step, "step_ms": 120.0, "ranks": rank_entries(ranks), **fields}


def pipeline_records(stages: int = 16, steps: int = 12, blocks: int = 32) -> list[dict]:
    """A pipeline run's log: run_start, then `steps` step records with `stages` and `layers`."""
    names = transformer_names(blocks)
    records = [run_start("llm-pipe", "pipeline", stages, names)]
    for step in range(1, steps + 1):
        parts = stage_rows(names, stages, step)
        busy = [s["fwd_ms"] + s["bwd_ms"] for s in parts]
        records.append(step_record(step, stages, stages=parts, imbalance_ms=round(max(busy) - min(busy), 3),
                                   threshold_ms=8.0, migrating=False,
                                   layers=layer_rows(names, stages=stages, step=step)))
    return records


def sharded_records(ranks: int = 8, streams: int = 8, steps: int = 12, blocks: int = 32) -> list[dict]:
    """A sharded run's log: `streams` streams a step, `layers` with their owners."""
    names = transformer_names(blocks)
    records = [run_start("llm-shard", "sharded", ranks, names)]
    for step in range(1, steps + 1):
        records.append(step_record(step, ranks, streams=stream_entries(streams, step),
                                   layers=layer_rows(names, owners=ranks, step=step)))
    return records


def write_feed(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
