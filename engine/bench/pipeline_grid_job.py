"""The job `trainyard bench pipeline --replicas` runs on every rank of its pool: one variant, built from its
config table as a run builds it (engine/strategies/interface.py make_strategy), or torch's own stages x
replicas (engine/bench/torch_pp_ddp.py), trained on this rank's share of one fixed global batch.

    pool.run(variant_job, variant="2x2-ddp", table={...}, stage_layers=[...], stages=2, hidden=1024,
             depth=20, batch=32, micro_batches=4, steps=8, warmup=2, interface="ty0")

A rank's share is the one the run's loop gives it (the strategy's parallel_groups: data parallel, a share a
rank; a pipeline, a share a replica, the same on each of its stages), and every step begins as the loop
begins it (begin_step). What comes back, per rank:
- `step_ms`: each timed step's time, from the previous step's end to its own (no barrier between steps, so a
  sharded step's broadcast overlaps the next forward as in a run); the last includes `sync` (the last
  broadcast, host updates);
- `link`: with `interface` (an emulated host's, engine/processes/cluster.py), the bytes its host sent and
  received on it over the timed steps, from /proc/net/dev, which shows the namespace of the reader: what
  crossed between hosts, headers included. Ranks of one host read the same counters;
- `phases_ms`: a trainyard variant's own step phases (its `timings`: forward, backward, update, a stage's
  wait for its neighbour and its replicas' reduce, ...), the mean over the timed steps; none for torch's.
"""

from __future__ import annotations

import time

OPTIM = {"name": "sgd", "lr": 0.01}   # as `bench broadcast`'s


def grid_model(hidden: int, depth: int):
    """`bench broadcast`'s MLP: `depth` equal hidden layers (the first from `hidden` features), then the head;
    the same weights on every rank."""
    from engine.config import ModelConfig
    from engine.models import build_model
    return build_model(ModelConfig(name="mlp", hidden=hidden, depth=depth),
                       {"input_dim": hidden, "num_classes": 10}, seed=0)


def link_counters(interface: str) -> dict[str, int] | None:
    """This network namespace's bytes received and sent on `interface` so far (None: no such interface)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == interface:
                fields = rest.split()
                return {"rx": int(fields[0]), "tx": int(fields[8])}
    return None


def _runner(topo, variant: str, table: dict | None, stage_layers: list[list[str]], stages: int, hidden: int,
            depth: int, micro_batches: int):
    """(step(x, y), sync(), close(), timings(): the last step's phases, this rank's share index, shares)."""
    model = grid_model(hidden, depth)
    if table is None:   # torch-pp-ddp
        from engine.bench.torch_pp_ddp import TorchPipelineDDP
        from engine.strategies.pipeline.grid import Grid
        grid = Grid.of(stages, topo.world_size, "stage")
        pipe = TorchPipelineDDP(topo, model, stage_layers, grid, micro_batches, OPTIM)
        return pipe.step, lambda: None, pipe.close, dict, grid.replica_of(topo.rank), grid.replicas
    from engine.config import config_from_dict
    from engine.runtime.devices import LedgerDevice
    from engine.strategies.interface import make_strategy
    cfg = config_from_dict(table)
    device = LedgerDevice(1 << 40)
    strategy = make_strategy(cfg, model, topo, device)
    device.ledger.track_module(strategy.tracked_module(), strategy.optimizer)
    index, shares = strategy.parallel_groups(topo.rank, topo.world_size).share(topo.rank)
    batch = cfg.data.batch_size

    def step(x, y):
        strategy.begin_step(cfg.optim.lr, batch)   # as the loop does: every target counts (no IGNORE here)
        return strategy.train_step(x, y)
    return step, strategy.sync, strategy.close, lambda: strategy.timings, index, shares


def variant_job(topo, variant: str, table: dict | None, stage_layers: list[list[str]], stages: int, hidden: int,
                depth: int, batch: int, micro_batches: int, steps: int, warmup: int,
                interface: str | None = None) -> dict:
    """On every rank: `variant` (its config `table`; None: torch-pp-ddp), `warmup` steps, then `steps` timed."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    step, sync, close, timings, index, shares = _runner(topo, variant, table, stage_layers, stages, hidden, depth,
                                               micro_batches)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, hidden, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    per = batch // shares
    x, y = x[index * per:(index + 1) * per].contiguous(), y[index * per:(index + 1) * per].contiguous()
    for _ in range(warmup):
        step(x, y)
    sync()
    dist.barrier(group=topo.compute)
    before = link_counters(interface) if interface else None
    ends, phases = [time.perf_counter()], {}
    for k in range(steps):
        step(x, y)
        if k == steps - 1:
            sync()   # the last broadcast is part of the work
        ends.append(time.perf_counter())
        for name, ms in timings().items():
            if name.endswith("_ms") and isinstance(ms, (int, float)):
                phases[name] = phases.get(name, 0.0) + ms / steps
    dist.barrier(group=topo.compute)
    after = link_counters(interface) if interface else None
    close()
    link = None if before is None or after is None else {k: after[k] - before[k] for k in after}
    return {"step_ms": [(b - a) * 1000 for a, b in zip(ends, ends[1:])], "link": link, "phases_ms": phases}
