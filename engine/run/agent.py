"""The elastic agent a launcher runs: torch's LocalElasticAgent, whose exit barrier stops waiting for a host that
the rendezvous has found dead.

At its end torch's agent waits, up to 300 s (its `exit_barrier_timeout`, which torch's launcher API does not
expose), for every other host's agent of its group to end as well. A host lost during a run that goes on without
it (a parameter server's workers: the servers go on, the group is not restarted) never ends, so every other host
would wait those 300 s after the run's last step. Here each agent marks its own end in the round's store, and
waits in slices of a second for the others' marks; between slices it stops once every host still missing is dead
to the rendezvous (no heartbeat for cluster.host_timeout_s), and says so. A live host is waited for as torch
waits, up to its 300 s; so is every host where this torch's rendezvous does not show its participants.

    with ending_hosts_waited(where="host 0: "):    # engine/run/launch.py, around elastic_launch
        elastic_launch(config, entry)(job)

Imports torch's agent only.
"""

from __future__ import annotations

import contextlib
import sys
import time
from datetime import timedelta

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.launcher import api as launcher_api

SLICE_S = 1.0
ENDED = "trainyard/ended/"   # + the agent's rank in the round: its workers have ended


def live_ranks(rdzv_handler) -> set[int] | None:
    """The ranks of the round's hosts that the rendezvous holds alive (its sync drops a participant whose heartbeat
    is older than its keep-alive timeout); None where this torch's handler does not show them."""
    holder, lock = getattr(rdzv_handler, "_state_holder", None), getattr(rdzv_handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return None
    try:
        with lock:
            holder.sync()
            return set(holder.state.participants.values())
    except Exception:   # the store gone with its host: nobody left to wait for who could say
        return None


def wait_for_ended(store, rank: int, world: int, live, timeout_s: float, slice_s: float = SLICE_S) -> list[int]:
    """Mark rank `rank`'s end in `store`, then wait until every rank of `world` has marked its own, or every one
    missing is not in `live()` (the ranks alive), or `timeout_s` has passed. Returns the ranks not waited for."""
    store.set(f"{ENDED}{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if not store.check([f"{ENDED}{r}"])]
        if not missing:
            return []
        alive = live()
        if alive is not None and not set(missing) & alive:
            return missing
        if time.monotonic() >= deadline:
            return missing
        with contextlib.suppress(Exception):   # DistStoreError: a slice without the next mark
            store.wait([f"{ENDED}{r}" for r in missing], timedelta(seconds=slice_s))


class Agent(local_elastic_agent.LocalElasticAgent):
    where = ""   # "host N: ", for what it says

    def _exit_barrier(self):
        group = self._worker_group
        handler = group.spec.rdzv_handler
        try:
            gone = wait_for_ended(self._store, group.group_rank, group.group_world_size,
                                  lambda: live_ranks(handler), self._exit_barrier_timeout)
        except Exception:   # as torch's: the run's result stands whatever the barrier meets
            return None
        if gone:
            print(f"trainyard: {self.where}the run ended without {len(gone)} host(s) of its group (rank "
                  f"{', '.join(map(str, gone))} at the rendezvous), lost during it; not waiting for them",
                  file=sys.stderr, flush=True)
        return None


@contextlib.contextmanager
def ending_hosts_waited(where: str = ""):
    """torch's launcher builds this module's Agent instead of its own within the block."""
    agent = type("Agent", (Agent,), {"where": where})
    saved, launcher_api.LocalElasticAgent = launcher_api.LocalElasticAgent, agent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved
