"""Techniques 1 and 2: sharded ownership, multi-stream sliced broadcast, forward gated per layer.

    strategy = ShardedStrategy(model, optim_cfg, topo, device, ShardedConfig(streams=2, slices=4), seed=0)
                                          # ShardedConfig: [parallel.sharded] (spec.py)
    loss = strategy.train_step(x, y)      # forward (gated), backward, reduce to owners, update, broadcast
    strategy.sync()                       # every broadcast in flight has landed (before a checkpoint)

Ownership, interleaved. The parameters, in forward-use order (the order of the LayerList's
layers), each go to the rank with the fewest bytes so far: equal layers go round robin, and
every owner's parameters run through the whole forward. Each rank keeps one flat buffer per
owner and every parameter is a view into its owner's buffer; the gradients likewise. Only the
owner builds an optimizer over its parameters, so optimizer state exists on the owner alone:
about 1/world of what DDP keeps.

Slices. Each owner's buffer is cut into `slices` contiguous slices, listed in forward-use
order across owners (plan.py), so that every link carries traffic both ways (owners in
contiguous runs sent rank 0's half, then rank 1's, and one direction of a 1 Gbit/s link idled
while the other worked). Gradients travel in buckets: an owner's consecutive slices, merged up
to 1 MiB (a bench-sized model's slices are a bucket each; a tiny model's, one per owner).

A step. Backward accumulates every gradient into the flat gradient buffers; once backward has
made every gradient a bucket holds (post-accumulate hooks count them), the bucket is averaged
and sent point-to-point to its owner, tagged with its index, while backward goes on with
earlier layers (as DDP's buckets go); the owner adds what the others sent into its own. No
all-reduce: each rank receives only its own buckets' parts. (Point-to-point is gloo's fastest
way to do this here: for 19M floats on 2 workers, isend/irecv plus the sum took 30 ms where
gloo's reduce to each owner took 2 x 38 ms and its all-reduce 51 ms.) The owner then updates
its shard and each slice is broadcast from its owner on one of `streams` communicators (one
process group per stream; on a GPU each NCCL group has its own communicator and CUDA stream);
`balanced` gives an owner's slices to streams of its own, so that each direction always has
a stream at work. Stream i of every rank pairs with stream i of the others because every rank
issues the same slices on the same groups in the same order: forward-use order.

Across hosts (`hierarchical`, with several hosts of several ranks each): every byte crosses
between hosts once. A slice's gradients for an owner on another host are first sent to the rank
of this host with the owner's local index (its relay), whose relay thread adds them to its own
and sends one sum across as soon as they are in (while backward goes on); a slice goes from
its owner to its peers on the other hosts (the ranks with its local index), and each of them
broadcasts it within its host. gloo's broadcast sends the
root's buffer to every other rank, so without this a slice crossed the link once per remote
rank (2 x 2 ranks on a 1 Gbit/s link: 490 ms where one crossing takes 200 ms). The second
level of a slice is issued by one thread per stream, in plan order on every rank (a
relay waits there for the slice to arrive), so the calls on each host group pair up.

The gate. With `overlap_forward`, the next step starts at once; a forward pre-hook on
each layer waits only for the broadcasts that carry that layer's parameters, so the
broadcast of later layers overlaps the forward of earlier ones. Without it, the step
waits for every broadcast before it returns.

Here: spec.py (what it is before it is built, torch-free, on the config's floor: SPEC, its StrategySpec;
ShardedConfig, its table; its checks), plan.py (owners, slices, streams: pure functions), streams.py (the
two-level exchange across hosts), reduce.py (each bucket's gradients to its owner, through the relays),
strategy.py (ShardedStrategy: the step, the broadcast and its gates, checkpoints). This file imports spec.py
when loaded and the rest when first asked for (`from engine.strategies.sharded import ShardedStrategy`), so that
reading the registry loads no torch. Its modules may import engine.config, engine.training.loss, engine.runtime
(the ground: devices, topology, checkpoint, the comm meter), engine.models (the layer grouping),
engine.techniques.updates and engine.strategies.base (the contract); nothing imports it back but the strategy
factory, benches and tests. `build` makes it from a Config (its spec's builder).
"""

from __future__ import annotations

from engine.strategies.sharded.spec import SPEC, ShardedConfig
from engine.strategies.specs.spec import late_exports

__all__ = ["SPEC", "ShardedConfig", "ShardedStrategy", "Slice", "assign_owners", "build", "cut", "plan_slices"]

LATER = {"ShardedStrategy": "strategy", "Slice": "plan", "assign_owners": "plan", "cut": "plan",
         "plan_slices": "plan"}   # a name -> its module here, imported late

__getattr__ = late_exports(__name__, LATER)   # a torch-heavy export, imported when first asked for


def build(cfg, model, topo, device, loss_fn):
    """`parallel.strategy = "sharded"` from a Config: a ShardedStrategy (its spec's builder, spec.py)."""
    from engine.strategies.sharded.strategy import ShardedStrategy
    from engine.training.precision import reduce_dtype
    return ShardedStrategy(model, cfg.optim, topo, device, cfg.parallel.sharded, seed=cfg.run.seed,
                           update_cfg=cfg.update, loss_fn=loss_fn, reduce_dtype=reduce_dtype(cfg.precision),
                           accumulate=cfg.data.accumulate)
