"""engine/processes/procpool.py: a job that cannot reach its ranks, or kills one, fails at once by name."""

from __future__ import annotations

import os
import sys
import types

import pytest

from engine.processes.procpool import DistPool, PoolError


def _exit_now(topo, code: int):
    os._exit(code)


def test_a_job_whose_module_the_ranks_cannot_import_fails_with_their_traceback(monkeypatch):
    """The module lives in this process alone: the rank's unpickling fails, and says so, where it used to end
    the rank and leave the pool waiting out the job's whole timeout."""
    module = types.ModuleType("only_here")
    exec("def job(topo):\n    return topo.rank\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_here", module)
    with DistPool(1, timeout_s=10) as pool:
        with pytest.raises(PoolError, match="No module named 'only_here'"):
            pool.run(module.job, timeout=60)


def test_a_rank_whose_process_ends_mid_job_fails_the_run_by_name():
    with DistPool(1, timeout_s=10) as pool:
        with pytest.raises(PoolError, match=r"rank 0's process ended \(exit code 3\) before it answered"):
            pool.run(_exit_now, timeout=60, code=3)
        assert not any(p.is_alive() for p in pool.procs)
