"""Feeds of many ranks on several hosts, grown from the recorded two-rank fixtures, for the console's
tests at the size of real jobs.

    messages = gpu_feed_64()                 # hello + every record of gpu_feed.jsonl but the summary,
                                             # at 64 ranks on 8 hosts; rank 41 is full and slow
    path = write_feed(messages, tmp_path / "feed.jsonl")
    grid = pipeline_grid_feed(stages=16, replicas=4)   # hello's layout.grid: 64 ranks, 16 stages x 4 replicas
    ConsoleApp(ReplaySource(path, paused=True, preload=len(messages)))

Rank r copies the fixture's rank r % 2, with small steady differences (memory by rank, compute by a
percent or two) so that sorting means something; it runs on host r // per_host. The slow rank's
forward and backward take `slow_factor` times as long and its memory is `memory_fraction` full (NVML's
on a GPU, the ledger's on the CPU); in a synchronous job every other rank then waits for it, so their
`wait_ms` grows by the difference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from console.client import replay_messages

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 2**20


def fleet_feed(fixture: str, ranks: int, per_host: int, slow_rank: int | None, slow_factor: float = 1.6,
               memory_fraction: float = 0.98) -> list[dict]:
    """hello (with `hosts` and `devices` for `ranks` ranks), then the fixture's records but its summary,
    each step's `ranks` grown to `ranks` rows."""
    records = [json.loads(line) for line in open(FIXTURES / fixture) if line.strip()]
    records = [record for record in records if record.get("type") != "summary"]
    hosts = [rank // per_host for rank in range(ranks)]
    for record in records:
        if record.get("type") == "run_start":
            record["world_size"], record["hosts"] = ranks, hosts
            if "devices" in record:
                record["devices"] = [record["devices"][rank % len(record["devices"])] for rank in range(ranks)]
        elif record.get("type") == "step":
            record["ranks"] = grown(record["ranks"], ranks, slow_rank, slow_factor, memory_fraction)
            record["step_ms"] = max(row["step_ms"] for row in record["ranks"])
    messages = replay_messages(records)
    messages[0]["hosts"] = hosts   # hello, whether or not the replay copies run_start's hosts
    return messages


def grown(rows: list[dict], ranks: int, slow_rank: int | None, slow_factor: float,
          memory_fraction: float) -> list[dict]:
    out = []
    for rank in range(ranks):
        row = copy.deepcopy(rows[rank % len(rows)])
        row["rank"] = rank
        jitter = 1 + (rank * 7 % 5) / 100        # 1.00 .. 1.04: a steady order, no outlier
        row["fwd_ms"], row["bwd_ms"] = row["fwd_ms"] * jitter, row["bwd_ms"] * jitter
        if "nvml_used_bytes" in row:
            row["nvml_used_bytes"] += (rank % 8) * 512 * MIB + (rank // 8) * 128 * MIB
        else:
            row["used_bytes"] += (rank % 8) * MIB
            row["peak_bytes"] = max(row["peak_bytes"], row["used_bytes"])
        if rank == slow_rank:   # the last to reach the boundary waits for no one
            row["fwd_ms"], row["bwd_ms"] = row["fwd_ms"] * slow_factor, row["bwd_ms"] * slow_factor
            row["wait_ms"] = 0.0
            if "nvml_used_bytes" in row:
                row["nvml_used_bytes"] = int(memory_fraction * row["nvml_total_bytes"])
            else:
                row["used_bytes"] = int(memory_fraction * row["capacity_bytes"])
                row["peak_bytes"] = max(row["peak_bytes"], row["used_bytes"])
        row["step_ms"] = row["fwd_ms"] + row["bwd_ms"] + row.get("optim_ms", 0.0)
        out.append(row)
    if slow_rank is not None and 0 <= slow_rank < ranks:   # the others wait at the boundary for the slow one
        slowest = out[slow_rank]["fwd_ms"] + out[slow_rank]["bwd_ms"]
        for row in out:
            if row["rank"] != slow_rank:
                row["wait_ms"] = row.get("wait_ms", 0.0) + max(0.0, slowest - row["fwd_ms"] - row["bwd_ms"])
    return out


def gpu_feed_64(ranks: int = 64, per_host: int = 8, slow_rank: int | None = 41, slow_factor: float = 1.6,
                memory_fraction: float = 0.98) -> list[dict]:
    """gpu_feed.jsonl (H100s, NVML figures) at 64 ranks on 8 hosts; rank 41 98% full and 1.6x slow."""
    return fleet_feed("gpu_feed.jsonl", ranks, per_host, slow_rank, slow_factor, memory_fraction)


def ddp_feed_8(slow_rank: int | None = 5) -> list[dict]:
    """ddp_feed.jsonl (simulated CPU devices, the ledger's memory) at 8 ranks on 2 hosts; rank 5 slow and full."""
    return fleet_feed("ddp_feed.jsonl", 8, 4, slow_rank, memory_fraction=0.95)


def write_feed(messages: list[dict], path: Path) -> Path:
    """The messages as a log a ReplaySource plays back as they are (a hello goes out as a hello)."""
    path.write_text("".join(json.dumps(message) + "\n" for message in messages))
    return path


def pipeline_grid_feed(stages: int = 16, replicas: int = 4, order: str = "stage", per_host: int = 8,
                       slow: tuple[int, int] | None = None, slow_factor: float = 1.6) -> list[dict]:
    """pipeline_feed.jsonl (4 simulated CPU stages) grown to a pipeline of `stages` x `replicas` ranks on
    hosts of `per_host`, placed in `order` by the engine's own Grid (engine/strategies/pipeline/grid.py),
    whose said() is hello's layout.grid (none with one replica, as the engine says it). Stage s holds two
    layers of `embed, blocks.0-…, head` and the fixture's stage s % 4's figures; its replica p's rank the
    fixture's row of that stage, a percent or two apart by replica. `slow`: (stage, replica) whose compute
    takes `slow_factor` times as long: its stage's other replicas wait for it (their gradients' all-reduce)."""
    from engine.strategies.pipeline.grid import Grid
    grid = Grid.of(stages, stages * replicas, order)
    names = ["embed", *(f"blocks.{i}" for i in range(2 * stages - 2)), "head"]
    layout = [names[2 * s:2 * s + 2] for s in range(stages)]
    records = [json.loads(line) for line in open(FIXTURES / "pipeline_feed.jsonl") if line.strip()]
    # not the summary, nor a command on one of the fixture's own layers (this model has others)
    records = [record for record in records if record.get("type") != "summary" and not record.get("args")]
    world = stages * replicas
    hosts = [rank // per_host for rank in range(world)]
    slow_rank = grid.rank(*slow) if slow else None
    for record in records:
        if record.get("type") == "run_start":
            record.update(world_size=world, hosts=hosts, layers=names, layout={
                "strategy": "pipeline", "stages": layout, "schedule": "1f1b", "micro_batches": 4,
                **({"grid": grid.said()} if replicas > 1 else {})})
            record["config"]["parallel"] = {"strategy": "pipeline", "world_size": world,
                                            "pipeline": {"stages": stages, "order": order}}
        elif record.get("type") == "step":
            by_stage = {row["rank"]: row for row in record["ranks"]}   # the fixture's rank r holds stage r
            rows = []
            for rank in range(world):
                stage, replica = grid.stage_of(rank), grid.replica_of(rank)
                row = copy.deepcopy(by_stage[stage % len(by_stage)])
                jitter = (1 + replica / 100) * (slow_factor if rank == slow_rank else 1)
                row.update(rank=rank, fwd_ms=row["fwd_ms"] * jitter, bwd_ms=row["bwd_ms"] * jitter,
                           used_bytes=row["used_bytes"] + replica * MIB)
                row["peak_bytes"] = max(row["peak_bytes"], row["used_bytes"])
                rows.append(row)
            for row in rows:   # a stage's replicas wait for its slowest at their all-reduce
                peers = [other for other in rows if grid.stage_of(other["rank"]) == grid.stage_of(row["rank"])]
                row["wait_ms"] = max(p["fwd_ms"] + p["bwd_ms"] for p in peers) - row["fwd_ms"] - row["bwd_ms"] + 0.2
                row["step_ms"] = row["fwd_ms"] + row["bwd_ms"] + row.get("optim_ms", 0.0) + row["wait_ms"]
            record["ranks"], record["step_ms"] = rows, max(row["step_ms"] for row in rows)
            record["stages"] = [grid_stage(record["stages"][s % len(record["stages"])], s, layout[s], grid, rows)
                                for s in range(stages)]
            if "layers" in record:
                fixture = record["layers"]
                record["layers"] = [{**fixture[i % len(fixture)], "name": name, "stage": i // 2}
                                    for i, name in enumerate(names)]
    messages = replay_messages(records)
    messages[0]["hosts"] = hosts
    return messages


def grid_stage(base: dict, stage: int, layers: list[str], grid, rows: list[dict]) -> dict:
    """A step's entry for `stage`: its slowest replica's figures (the fixture's stage's, scaled), each
    replica's fwd + bwd in `replicas_ms`, replica 0 first (docs/telemetry.md, `stages`)."""
    ranks = grid.group_of(stage)
    by_rank = {row["rank"]: row for row in rows}
    spent = [by_rank[rank]["fwd_ms"] + by_rank[rank]["bwd_ms"] for rank in ranks]
    slowest = ranks[spent.index(max(spent))]
    entry = {**base, "stage": stage, "rank": slowest, "layers": layers, "fwd_ms": by_rank[slowest]["fwd_ms"],
             "bwd_ms": by_rank[slowest]["bwd_ms"]}
    if grid.replicas > 1:
        entry["replicas_ms"] = [round(ms, 3) for ms in spent]
    return entry
