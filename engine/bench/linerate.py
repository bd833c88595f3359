"""The line-rate ideal of a step's communication over an emulated cluster (`bench broadcast --hosts`).

    rate = probe_link(topo, hosts)["bytes_per_s"]            # on every rank of the pool, at once
    ideal = ideal_bytes("sharded-4-gated", owned_per_rank, parameter_bytes, hosts)
    ideal["total"] / rate * 1000                              # ms, if every phase ran at the line's rate

The probe runs at the start of every round, beside the variants, and the ideal takes the best rate any round
measured, capped at the shaped rate (best_rate). The probe is iperf's idea with the job's own transport: the first rank of every host sends 32 MiB to the
next host's first rank while it receives as much from the previous host's (two hosts: both ways over the
one pair), five times after a warm-up, and the fastest gives the bytes per second each link carries each
way when both ways are busy, as they are in a step. Not the nominal rate: tbf, the veth pair, TCP and gloo
all take their share. The fastest, not the median: a transfer now and then stalls on a dropped segment
(tbf drops what overflows its queue; TCP waits out its retransmission timer), which takes 2x as long
and is no property of the line; the spread is printed beside it.

The bytes each phase must move over the most loaded host link, each way (H hosts of k ranks, P_h the
parameter bytes owned on host h, P their sum, W = H k):
- sharded, two-level (k > 1) or one rank per host: the reduce sends host g's owners their sums from every
  other host once (up P - P_h, down (H - 1) P_h); the broadcast sends each owner's slices to every other
  host once (up (H - 1) P_h, down P - P_h).
- sharded, flat (k > 1): every rank sends its own part to each remote owner, and gloo's broadcast sends the
  root's buffer to every other rank: k times the two-level figures.
- ddp: gloo's ring all-reduce (reduce-scatter, then all-gather) sends 2 (W - 1) / W of every gradient byte
  along each edge of the ring of ranks; one edge leaves each host, one enters it.
- fsdp2: each all-gather of the parameters (one a step, two when it reshards after forward) sends (W - 1) / W
  of them along each edge; its reduce-scatter of the gradients is, on gloo, an all-reduce: 2 (W - 1) / W
  (NCCL's would send half).
A phase's figure is the larger direction of the most loaded link; phases run one after the other, so the
total is their sum.
"""

from __future__ import annotations

import time

PROBE_BYTES = 32 << 20


def probe_link(topo, hosts: int, nbytes: int = PROBE_BYTES, repeats: int = 5) -> dict:
    """Every rank calls it (the barriers); the first rank of each host measures. Bytes per second each
    way, from rank 0's exchanges (every host's the same shaped link)."""
    import torch
    import torch.distributed as dist

    k = topo.world_size // hosts
    group = topo.compute
    host, local = divmod(topo.rank, k)
    send = torch.zeros(nbytes // 4)
    into = torch.empty_like(send)
    took = []
    for _ in range(repeats + 1):   # the first warms the connections
        dist.barrier(group=group)
        if local == 0:
            t0 = time.perf_counter()
            works = [dist.isend(send, dst=((host + 1) % hosts) * k, group=group),
                     dist.irecv(into, src=((host - 1) % hosts) * k, group=group)]
            for work in works:
                work.wait()
            took.append(time.perf_counter() - t0)
    dist.barrier(group=group)
    if not took:
        return {}
    seconds = min(took[1:])
    return {"bytes_per_s": nbytes / seconds, "probe_bytes": nbytes, "probe_s": [round(t, 4) for t in took[1:]]}


def best_rate(probes: list[dict], link: str) -> dict:
    """The rate the ideal uses: the best any round's probe measured (a round's probe can stall on a busy
    machine: that is no property of the line), never above the rate `link` shapes; and each round's."""
    from engine.processes.cluster import rate_bits
    shaped = rate_bits(link) / 8
    best = max(probes, key=lambda p: p["bytes_per_s"])
    return {"bytes_per_s": min(best["bytes_per_s"], shaped), "shaped_bytes_per_s": shaped,
            "capped": best["bytes_per_s"] > shaped, "probe_bytes": best["probe_bytes"],
            "probe_s": best["probe_s"], "rounds_bytes_per_s": [round(p["bytes_per_s"]) for p in probes]}


def ideal_bytes(variant: str, owned_per_rank: list[int], parameter_bytes: int, hosts: int,
                working_bytes: int | None = None) -> dict:
    """Each phase's bytes over the most loaded host link, in its busier direction, and their `total`
    (`parameter_bytes`: the fp32 model's, what gradients are reduced in; `working_bytes`: what fsdp2 gathers,
    its bf16 working parameters under mixed precision; default the same)."""
    world = len(owned_per_rank)
    k = world // hosts
    if variant.startswith("ddp"):
        ring = 2 * (world - 1) / world * parameter_bytes
        return {"allreduce": int(ring), "total": int(ring)}
    if variant.startswith("fsdp2"):
        from engine.bench.torch_fsdp import gathers
        gather = gathers(variant == "fsdp2-reshard") * (world - 1) / world * (working_bytes or parameter_bytes)
        reduce = 2 * (world - 1) / world * parameter_bytes
        return {"allgather": int(gather), "reduce_scatter": int(reduce), "total": int(gather + reduce)}
    per_host = [sum(owned_per_rank[h * k:(h + 1) * k]) for h in range(hosts)]
    total = sum(per_host)
    fan = k if variant.endswith("flat") and k > 1 else 1   # every rank on its own, not one per host
    reduce = max(max(total - p, (hosts - 1) * p) for p in per_host) * fan
    broadcast = max(max((hosts - 1) * p, total - p) for p in per_host) * fan
    return {"reduce": int(reduce), "broadcast": int(broadcast), "total": int(reduce + broadcast)}
