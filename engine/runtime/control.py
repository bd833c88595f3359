"""The step boundary: every rank shares its figures, and rank 0 shares the operator's commands.

    table = exchange(topo, {"loss": 2.3, "stop": 0.0, ...}, command_bytes=len(payload))
    commands = share_commands(topo, payload, table)      # the same list on every rank

One all-gather of a small float vector per step carries loss, timings, ledger
figures (and a GPU's allocator and NVML figures), the stop flag and the length of
rank 0's command payload; only when that
length is non-zero does a broadcast of the payload follow. Both run on the side
group, so every rank sees the same commands at the same step and applies them there.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from engine.runtime.topology import Topology

# A CUDA device's own figures (engine/runtime/devices.py CudaProbe): absent on the CPU, so sent as NaN and left out
GPU_FIELDS = ("allocated_bytes", "reserved_bytes", "allocator_peak_bytes", "nvml_used_bytes", "nvml_total_bytes",
              "gpu_util_percent")
# each rank's checkpoint writer (engine/run/checkpointer.py): the last step whose file it wrote, a failed write's
# step + 1 and errno, and its last checkpoint's stall and write times; rank 0 publishes from them
CHECKPOINT_FIELDS = ("ckpt_written", "ckpt_failed", "ckpt_errno", "ckpt_stall_ms", "ckpt_write_ms")
FIELDS = ("stop", "command_bytes", "loss", "step_ms", "fwd_ms", "bwd_ms", "optim_ms", "compute_ms", "wait_ms", "gate_ms", "owned_bytes", "host_bytes", "host_busy_ms",
          "parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "master_bytes", "activations_bytes",
          "inputs_bytes", "swapped_bytes", "used_bytes", "peak_bytes", "capacity_bytes", "over_capacity",
          "rss_bytes", "cpu_percent", "sent_bytes", "migration_bytes", "migration_ms", "swap_layers", "recompute_layers",
          "plan_made", "plan_estimate_bytes", "min_capacity_bytes", "swapped_out_bytes", "link_wait_ms", "host_link_bytes",
          "flops", "compile_ms", "recompiles", *GPU_FIELDS, *CHECKPOINT_FIELDS)
COLUMN = {name: i for i, name in enumerate(FIELDS)}


_ABSENT = float("nan")


def row_values(values: dict) -> list[float]:
    """`values` as one row of FIELDS: a missing field is 0, a missing GPU figure NaN (left out of rank_rows)."""
    return [float(values.get(k, _ABSENT if k in GPU_FIELDS else 0.0)) for k in FIELDS]


def exchange(topo: Topology, values: dict) -> torch.Tensor:
    """All ranks' vectors, one row per rank (see row_values)."""
    mine = torch.tensor(row_values(values), dtype=torch.float64)
    if topo.world_size == 1:   # no peer to hear from: no collective
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(rows, mine, group=topo.side)
    return torch.stack(rows)


def encode_commands(commands: list[dict]) -> bytes:
    return json.dumps(commands).encode() if commands else b""


def share_commands(topo: Topology, payload: bytes, table: torch.Tensor) -> list[dict]:
    nbytes = int(table[0, COLUMN["command_bytes"]])
    if nbytes == 0:
        return []
    if topo.world_size == 1:
        return json.loads(payload.decode())
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
            if name in ("stop", "command_bytes", "plan_made", "plan_estimate_bytes", "min_capacity_bytes", "flops") \
                    or name in CHECKPOINT_FIELDS or value != value:   # NaN: a GPU figure this rank does not have
                continue
            if name in ("compile_ms", "recompiles") and not value:   # `[model] compile` only
                continue
            if name == "over_capacity":
                entry[name] = bool(value)
            elif name.endswith(("_bytes", "_layers")):
                entry[name] = int(value)
            else:
                entry[name] = round(value, 4) if name.endswith("_ms") else value
        # the rank's own work (forward + backward, on the device's clock, less its waits for peers): a straggler
        # shows here, while its peers' wall step times equal its own (they wait for it). A strategy whose
        # backward holds a wait for peers (ddp's all-reduce) reports its own; the others' is fwd + bwd - gate.
        if not entry.get("compute_ms"):
            entry["compute_ms"] = round(max(entry["fwd_ms"] + entry["bwd_ms"] - entry["gate_ms"], 0.0), 4)
        rows.append(entry)
    return rows


class Peaks:
    """Rank 0: each rank's highest ledger peak over the run, and a GPU's allocator peak, for the summary."""

    def __init__(self, world_size: int):
        self.ledger = [0] * world_size
        self.allocator: dict[int, int] = {}
        self.compile: dict[int, tuple[float, int]] = {}   # rank -> (compile ms, recompiles): `[model] compile`

    def note(self, ranks: list[dict]) -> None:
        for entry in ranks:
            r = entry["rank"]
            self.ledger[r] = max(self.ledger[r], entry.get("peak_bytes", 0))
            if "allocator_peak_bytes" in entry:
                self.allocator[r] = max(self.allocator.get(r, 0), entry["allocator_peak_bytes"])
            if "compile_ms" in entry:   # cumulative, per process (engine/models/compile.py)
                ms, n = self.compile.get(r, (0.0, 0))
                self.compile[r] = (max(ms, entry["compile_ms"]), max(n, int(entry.get("recompiles", 0))))

    def summary(self) -> dict:
        out = {"peak_bytes_per_rank": list(self.ledger)}
        if self.allocator:   # CUDA ranks: what the GPU's allocator really held at most (0: a CPU rank)
            out["allocator_peak_bytes_per_rank"] = [self.allocator.get(r, 0) for r in range(len(self.ledger))]
        if self.compile:   # the ranks compile side by side: the slowest one's is what the run waited
            per_rank = [round(self.compile.get(r, (0.0, 0))[0] / 1000, 3) for r in range(len(self.ledger))]
            out.update(compile_s=max(per_rank), compile_s_per_rank=per_rank,
                       recompiles=sum(n for _, n in self.compile.values()))
        return out
