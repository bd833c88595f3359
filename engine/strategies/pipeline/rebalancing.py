"""A pipeline's rebalancing as the step loop sees it: the operator's `rebalance` command, the check at the
boundary, the memory planned ahead of a migration, and the migration's report, each said as events
(engine/runtime/events.py) that the loop forwards.

    events = rebalancing.command(command)           # taken, answered once the check has run or the layout moved
    events = rebalancing.boundary(step, trained, memory)   # every rank, after the commands
    events = rebalancing.migrated(step, table)      # every rank, after the exchange of a step that migrated

Imports torch.distributed, engine.runtime.control, engine.runtime.events and engine.telemetry.outlets (the
refusal's words, which the hub gives too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.runtime.control import Table, column
from engine.runtime.devices import tensor_bytes
from engine.runtime.events import Event
from engine.telemetry.outlets import rebalance_in_flight


class Rebalancing:
    def __init__(self, stage):
        self.stage = stage
        self.requested = False                  # the operator asked for a check at this boundary
        self.waiting: dict | None = None        # the operator's command, until its check or migration answers it

    def command(self, command: dict) -> list[Event]:
        if self.requested or self.waiting or self.stage.pending is not None:
            return [Event(reply=(command, "rejected", {"reason": rebalance_in_flight()}))]
        self.requested, self.waiting = True, command
        return []

    def boundary(self, step: int, trained: bool, memory) -> list[Event]:
        """The check when one is due (or asked for); its decision as events, on every rank."""
        requested, self.requested = self.requested, False
        if not (trained or requested):
            return []
        decision = self.stage.check(step, requested, memory)
        if decision is None:
            return []
        command = self.waiting if decision.reason == "command" else None
        if not decision.changed:
            self.waiting = None
            return [Event(reply=(command, "applied", {"reason": decision.summary()}))] if command else []
        ahead = self._plan_ahead(decision, memory)
        events = [Event("rebalance", dict(reason=decision.reason, stages=decision.stages,
                                          stage_ms=[round(t, 4) for t in decision.stage_ms],
                                          predicted_ms=[round(t, 4) for t in decision.predicted_ms],
                                          threshold_ms=round(decision.threshold_ms, 4),
                                          layer_ms={k: round(v, 4) for k, v in decision.layer_ms.items()}),
                        note=f"rebalance ({decision.reason}) at step {step}: {decision.summary()}; "
                             f"layers migrate during step {step + 1}")]
        if ahead is not None:
            held = ", ".join(f"{n} {p}" for n, p in ahead.policies.items() if p != "keep") or "every layer kept"
            events.append(Event(note=f"memory planned ahead of the migration (rank {self.stage.rank}): {held}"))
        return events

    def _plan_ahead(self, decision, memory):
        """Every rank, once a new layout is decided (`memory.policy = "auto"`): the policies of the layers it
        will hold in the migration step, planned before they move, from the costs measured where each ran
        and the bytes each brings (engine/techniques/memory/policy.py: plan_ahead). So no stage goes over
        its capacity while layers move (the plan after the move came a step late before)."""
        if not memory.auto:
            return None
        stage = self.stage
        rooms = decision.rooms   # every stage's costs and static bytes, as the check gathered them
        if rooms is None:        # a check that gathered none (its decision came without memory's rooms)
            rooms = [None] * stage.topo.world_size
            dist.all_gather_object(rooms, memory.room(stage.layer_static_bytes()), group=stage.topo.side)
        costs = {n: c for room in rooms for n, c in room.costs.items()}
        static = {n: b for room in rooms for n, b in room.static.items()}
        now = set(stage.owned_layers())
        after = decision.stages[stage.rank]
        held = [n for n in stage.model.names if n in now or n in after]
        return memory.plan_ahead(held, costs, sum(static[n] for n in after if n not in now))

    def migrated(self, step: int, table: Table) -> list[Event]:
        """Every rank, after the step: if layers migrated during it, what moved, and the operator's answer."""
        move = self.stage.take_migration()
        if move is None:
            return []
        command, self.waiting = self.waiting, None
        nbytes = int(sum(column(table, "migration_bytes")))
        duration = max(column(table, "migration_ms"))
        moves = [{"layer": n, "from_stage": a, "to_stage": b} for n, a, b in move.moves]
        events = [Event("migration", dict(moves=moves, stages=move.new, bytes=nbytes, duration_ms=round(duration, 3),
                                          cutover_micro_batch=move.cutover),
                        state={"layout": move.new},
                        note=f"migrated {len(move.moves)} layer(s) during step {step} ({nbytes} bytes, "
                             f"{duration:.1f} ms): stages now {move.new}")]
        if command:
            events.append(Event(reply=(command, "applied",
                                       {"reason": f"new layout took effect in step {step}: {move.new}"})))
        return events

    def static_bytes(self) -> dict[str, int]:
        """Each layer the stage runs: the device bytes that travel with it in a migration (weights, their
        gradients, and its update's optimizer state and fp32 masters where it runs here, on the device)."""
        st, out = self.stage, {}
        for i in range(st.start, st.end):
            u = st.updater.updates.get(i)
            # a gradient its update freed counts as held, as the ledger counts it (count_as_held)
            out[st.model.names[i]] = sum(tensor_bytes(p) + (tensor_bytes(p.grad) if p.grad is not None else
                                                            tensor_bytes(p) if p.requires_grad else 0)
                                         for p in st.model.layers[i].parameters()) + \
                (u.device_bytes() if u is not None and u.side == "device" else 0)
        return out
