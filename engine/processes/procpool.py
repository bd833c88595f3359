"""A pool of `world` worker processes joined in one process group, for tests and
benchmarks that run many small distributed jobs: starting torch.distributed once and
reusing it keeps a parametrised grid within CI's time, and lets a bench run its
variants side by side in one process tree.

    with DistPool(world=2) as pool:
        results = pool.run(some_module.job, steps=20)   # job(topo, steps=20) on every rank

With `cluster` (engine/processes/cluster.py), the ranks are spread over its emulated hosts, consecutive
ranks per host as an elastic agent places them, and talk over its shaped links.

The ranks fork from the launcher's fork server (engine/processes/forkserver.py: torch and the engine already
imported, 2.8 s of CPU saved a rank) where it runs, else are spawned; either way each starts with the
environment its pool was made in, as a spawned child would (forkserver.Inherit).

`job` must be a module-level function (the children import it by name). Every
collective has the pool's timeout; `run` has its own deadline; a job that raised on
any rank raises here with that rank's traceback, and the pool is then closed (its
ranks may disagree on which collective comes next). Children are always reaped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, timeout_s: float, inbox, outbox, place=None, owner=None,
           _inherited=None) -> None:
    """`owner`: the pool's maker (lifeline.identity), whose end ends this rank, however it ended (its ranks are
    not its children where they fork from a server); `_inherited`: its environment (forkserver.Inherit), taken as
    it was unpickled."""
    if owner is not None:
        from engine.processes import lifeline
        lifeline.hold(owner, 1.0, f"pool rank {rank}")
    import torch
    torch.set_num_threads(1)
    addr, local, per_host = "127.0.0.1", rank, world
    if place is not None:   # (netns, interface, first host's address, ranks per host)
        from engine.processes.cluster import enter_host
        netns, interface, addr, per_host = place
        if netns is not None:
            enter_host(netns)
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        local = rank % per_host
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))
    from engine.runtime.topology import Topology
    topo = Topology.from_env("gloo", "cpu", timeout_s)
    try:
        while True:
            try:
                job = inbox.get()   # unpickling imports the job's module: a failure is the job's, not the rank's
            except Exception:
                outbox.put((rank, False, traceback.format_exc()))
                continue
            if job is None:
                break
            fn, kwargs = job
            try:
                outbox.put((rank, True, fn(topo, **kwargs)))
            except BaseException:   # the test shows this rank's traceback
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        topo.shutdown()


class PoolError(AssertionError):
    """A job failed or did not answer in time."""


class DistPool:
    def __init__(self, world: int, timeout_s: float = 20.0, cluster=None, per_host: int | None = None):
        """`per_host`: without a cluster, tell the ranks they sit on hosts of that many (LOCAL_WORLD_SIZE),
        all on this machine's loopback: the code paths of several hosts, without the links."""
        from engine.processes import forkserver, lifeline
        ctx = mp.get_context("forkserver" if forkserver.start() else "spawn")
        owner = lifeline.identity()
        self.world, self.timeout_s = world, timeout_s
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        port = free_port()
        places = [None] * world
        if per_host is not None:
            places = [(None, None, "127.0.0.1", per_host)] * world
        if cluster is not None:
            n = len(cluster.hosts)
            if world % n:
                raise ValueError(f"world {world} does not split evenly over {n} hosts")
            per_host = world // n
            places = [(cluster.hosts[r // per_host].netns, cluster.interface, cluster.hosts[0].address, per_host)
                      for r in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, timeout_s, self.inboxes[r], self.outbox,
                                                       places[r], owner, forkserver.Inherit()),
                                  daemon=True, name=f"pool-rank{r}")
                      for r in range(world)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, fn, timeout: float = 120.0, answer_from: list[int] | None = None, **kwargs) -> list:
        """fn(topo, **kwargs) on every rank; the results in rank order (of `answer_from` only,
        when given: for jobs in which some ranks die on purpose)."""
        if self.broken:
            raise PoolError("the pool is closed after an earlier failure")
        for inbox in self.inboxes:
            inbox.put((fn, kwargs))
        ranks = list(range(self.world)) if answer_from is None else answer_from
        results, errors, deadline = {}, {}, time.monotonic() + timeout
        while len(results) + len(errors) < len(ranks):
            try:
                rank, ok, value = self.outbox.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                waiting = sorted(set(ranks) - set(results) - set(errors))
                dead = [r for r in waiting if not self.procs[r].is_alive()]
                if dead or time.monotonic() >= deadline:
                    self.close(now=bool(dead))
                    raise PoolError(f"{fn.__name__}: rank {dead[0]}'s process ended (exit code "
                                    f"{self.procs[dead[0]].exitcode}) before it answered" if dead else
                                    f"{fn.__name__}: no answer from ranks {waiting} in {timeout} s") from None
                continue
            (results if ok else errors)[rank] = value
            if errors and time.monotonic() > deadline:
                break
        if errors:
            self.close()
            raise PoolError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
        return [results[r] for r in ranks]

    def close(self, now: bool = False) -> None:
        """Tell every rank to end and wait for it (5 s each), SIGKILL what is left; `now`: SIGKILL at once
        (the pool's owner is unwinding from an error or a signal, and a rank may be mid-job)."""
        self.broken = True
        if not now:
            for inbox in self.inboxes:
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            if not now:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(now=exc_type is not None)
