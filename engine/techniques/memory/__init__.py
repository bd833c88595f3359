"""Per-layer activation memory: each layer keeps, swaps to host or recomputes what autograd saves for
its backward, planned against the device capacity (docs/memory.md).

    from engine.techniques.memory import ActivationPolicy
    policy = ActivationPolicy(model, device, cfg.memory, owned=lambda: model.names, in_flight=lambda: 1)
    policy.before_step(step); loss = strategy.train_step(x, y); plan = policy.after_step(step)

What lives here, one idea a module:

    policy.py    ActivationPolicy: wraps each layer's forward, applies keep/swap/recompute, and runs
                 the measure-then-plan cycle and the refusal floor (what the step loop calls)
    swap.py      Swapper: the ledger's side of swapping (saved storages out, prefetched back, backpressure)
    stream_swap.py  StreamSwapper: the same on a GPU, copies queued on side streams and booked by event
    link.py      HostLink (CPU threads), StreamLink and CudaCopies (GPU streams), HostBufferPool,
                 measure_link_gbps: copies between device and host memory
    measure.py   Measure: one measured step's per-layer times and input bytes, turned into ActivationCosts
    cost.py      ActivationCost and the cost model (estimate, activation_peak, extra_ms): pure functions
    planner.py   plan (ratio / reverse / exhaustive), Plan, PlanError: pure functions of ActivationCosts
    room.py      Room, Floors: what each pipeline stage can hold, so a rebalance never picks a layout
                 whose stage cannot fit its capacity even with every layer recomputed

Imports within the package go one way: policy.py imports the others; stream_swap.py imports swap.py
and link.py; swap.py imports link.py; measure.py, planner.py and room.py import cost.py; cost.py and link.py
import nothing of the engine. The package may import torch, engine.config and engine.training.timing only: the
model, the device and its ledger are handed in, so nothing here imports engine.runtime (the worker,
the devices) or any strategy.
"""

from engine.techniques.memory.cost import (POLICIES, ActivationCost, activation_peak, estimate, extra_ms,
                                           resident_bytes,
                                           swap_ms, swaps_pending)
from engine.techniques.memory.link import (FETCH_TIMEOUT_S, CudaCopies, HostBufferPool, HostLink, StreamLink,
                                           measure_link_gbps)
from engine.techniques.memory.planner import EXHAUSTIVE_MAX_LAYERS, PLANNERS, Plan, PlanError, order_by_ratio, plan
from engine.techniques.memory.policy import ActivationPolicy
from engine.techniques.memory.room import Floors, Room
from engine.techniques.memory.stream_swap import StreamSwapper
from engine.techniques.memory.swap import Swapper

__all__ = ["EXHAUSTIVE_MAX_LAYERS", "FETCH_TIMEOUT_S", "PLANNERS", "POLICIES", "ActivationPolicy",
           "CudaCopies", "Floors", "HostBufferPool", "HostLink", "ActivationCost", "Plan", "PlanError", "Room", "StreamLink",
           "StreamSwapper",
           "Swapper", "activation_peak", "estimate", "extra_ms", "measure_link_gbps", "order_by_ratio", "plan",
           "resident_bytes", "swap_ms", "swaps_pending"]
