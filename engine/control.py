"""The step boundary: every rank shares its figures, and rank 0 shares the operator's commands.

    table = exchange(topo, {"loss": 2.3, "stop": 0.0, ...}, command_bytes=len(payload))
    commands = share_commands(topo, payload, table)      # the same list on every rank

One all-gather of a small float vector per step carries loss, timings, ledger
figures, the stop flag and the length of rank 0's command payload; only when that
length is non-zero does a broadcast of the payload follow. Both run on the side
group, so every rank sees the same commands at the same step and applies them there.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from engine.topology import Topology

FIELDS = ("stop", "command_bytes", "loss", "step_ms", "fwd_ms", "bwd_ms", "optim_ms", "wait_ms", "gate_ms", "owned_bytes", "host_bytes", "host_busy_ms",
          "parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes",
          "swapped_bytes", "used_bytes", "peak_bytes", "capacity_bytes", "over_capacity",
          "rss_bytes", "cpu_percent", "migration_bytes", "migration_ms", "swap_layers", "recompute_layers",
          "plan_made", "plan_estimate_bytes", "min_capacity_bytes", "swapped_out_bytes")
COLUMN = {name: i for i, name in enumerate(FIELDS)}


def exchange(topo: Topology, values: dict) -> torch.Tensor:
    """All ranks' vectors, one row per rank (missing fields are 0)."""
    mine = torch.tensor([float(values.get(k, 0.0)) for k in FIELDS], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(rows, mine, group=topo.side)
    return torch.stack(rows)


def encode_commands(commands: list[dict]) -> bytes:
    return json.dumps(commands).encode() if commands else b""


def share_commands(topo: Topology, payload: bytes, table: torch.Tensor) -> list[dict]:
    nbytes = int(table[0, COLUMN["command_bytes"]])
    if nbytes == 0:
        return []
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if topo.is_first:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0, group=topo.side)
    return json.loads(bytes(buffer.tolist()).decode())


def rank_rows(table: torch.Tensor) -> list[dict]:
    """The table as one dict per rank (bytes as ints, the capacity flag as a bool)."""
    rows = []
    for rank, row in enumerate(table.tolist()):
        entry = {"rank": rank}
        for name, value in zip(FIELDS, row):
            if name in ("stop", "command_bytes", "plan_made", "plan_estimate_bytes", "min_capacity_bytes"):
                continue
            if name == "over_capacity":
                entry[name] = bool(value)
            elif name.endswith(("_bytes", "_layers")):
                entry[name] = int(value)
            else:
                entry[name] = round(value, 4) if name.endswith("_ms") else value
        rows.append(entry)
    return rows
