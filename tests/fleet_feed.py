"""Feeds of many ranks on several hosts, grown from the recorded two-rank fixtures, for the console's
tests at the size of real jobs.

    messages = gpu_feed_64()                 # hello + every record of gpu_feed.jsonl but the summary,
                                             # at 64 ranks on 8 hosts; rank 41 is full and slow
    path = write_feed(messages, tmp_path / "feed.jsonl")
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
