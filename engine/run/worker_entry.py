"""What torch's elastic agent starts in each worker process of a run (engine/run/launch.py): worker_main, the
process's entry (a parameter server's rank, or the step loop's Worker in engine/run/worker.py), watching the
launcher, with an error it raises recorded whole for the agent; what does not end it ends the process.

Imports engine.run.worker, engine.run.rank, engine.runtime, engine.processes.lifeline and the strategies'
registry (engine.strategies.specs: a strategy with loops of its own).
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import suppress

import torch

from engine.processes import lifeline
from engine.run.rank import Job, build_rank, place_on_host
from engine.run.worker import Worker
from engine.runtime import emulate
from engine.runtime.lifecycle import StopRequest
from engine.runtime.refusal import is_refusal, refuse, transient
from engine.runtime.topology import Topology
from engine.strategies.specs import STRATEGIES, resolve


def run_worker(job: Job, _forked=None) -> dict | None:
    """worker_main, watching the launcher (engine/processes/lifeline.py); where it raises, the worker exits with
    status 1 once the error is in the agent's error.json (what the launcher reports, as before). An error raised
    on out of here would also be pickled by torch.multiprocessing into a pytorch-errorfile-*.pickle in the
    system temp dir, which nothing removes. `_forked`: the launcher's environment (forkserver.Inherit), taken
    as it was unpickled."""
    # one host: the run stops with its launcher (a final checkpoint where it fits); several: this host is lost
    lifeline.hold(job.launcher, job.config.parallel.shutdown_timeout_s, f"rank {os.environ.get('RANK', '?')}",
                  stop=job.config.cluster.nnodes == 1)
    os.environ[emulate.LAUNCHER_PID] = str(job.launcher[0])   # emulate.kill_how = "launcher"
    try:
        result = worker_main(job)
    except Exception as e:
        _record_error(e)
        sys.exit(1)
    lifeline.finished()   # the agent may keep a finished worker waiting: a stop must still end it
    return result


def _record_error(error: BaseException) -> None:
    """torch's error file for the agent (TORCHELASTIC_ERROR_FILE), written whole or not at all: torch writes it
    in place, and a full disk left it empty, which the agent then failed to parse (a JSONDecodeError traceback
    instead of the worker's error)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    partial = f"{path}.partial"
    os.environ["TORCHELASTIC_ERROR_FILE"] = partial
    try:
        ErrorHandler().record_exception(error)
        if os.path.getsize(partial):
            os.replace(partial, path)
    except OSError:
        pass
    finally:
        os.environ["TORCHELASTIC_ERROR_FILE"] = path
        with suppress(OSError):
            os.unlink(partial)


def worker_main(job: Job) -> dict | None:
    torch.set_num_threads(1)   # one thread per worker: on a few cores the pools would thrash
    cfg = job.config
    place_on_host(job)
    spec = STRATEGIES[cfg.parallel.strategy]
    if spec.apart and int(os.environ["RANK"]) >= spec.apart_from(cfg):
        return resolve(spec.apart)(job, build_rank)   # a parameter-server worker: its death does not end the run
    stop = StopRequest(grace_s=cfg.parallel.shutdown_timeout_s)
    topo = Topology.from_env(cfg.parallel.backend, cfg.device.kind, cfg.parallel.collective_timeout_s)
    worker = None
    try:
        if spec.loops:   # loops of its own instead of the step loop (a parameter server's servers)
            return resolve(spec.loops)(job, topo, stop, build_rank)
        worker = Worker(job, topo, stop)
        return worker.run()
    except Exception as e:
        lost = transient(e)
        # our launcher is there to tell (not torchrun's) and this is no stop: a restart would fail the same way
        final = lost is None and job.refusal_path is not None and not stop.requested
        if worker is not None:   # consoles hear why, and the socket and registry entry go away
            with suppress(Exception):   # a log that could not be written must not hide the error
                worker.tel.close(f"run {'refused' if final and is_refusal(e) else 'failed'} ({type(e).__name__}: {e})")
        if final:   # the launcher ends the run: exit 2 for a refusal, 1 for a failure
            where = worker.where() if worker is not None else "" if spec.loops else "while starting"
            if not is_refusal(e) and not getattr(type(e), "says_all", False):   # its traceback, once
                print(f"trainyard: rank {topo.rank} failed ({where}); not restarted, the same error would "
                      f"recur:\n{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
            refuse(job.refusal_path, job.launcher[0], topo.rank, e, lambda: stop.requested, where)
        if stop.requested:   # being shut down and a peer already left: nothing more to save
            print(f"trainyard: rank {topo.rank} stopped ({type(e).__name__} after a peer left)",
                  file=sys.stderr, flush=True)
            os._exit(1)
        raise
    finally:
        if stop.requested:
            sys.stdout.flush()
            # The elastic agent is shutting the group down and will not collect a return
            # value; leave now rather than wait for its SIGKILL.
            os._exit(0)
        topo.shutdown()
