"""Start the workers of a run through torch's elastic agent, and end them all.

    summary = launch(Job(config=cfg, ...))     # blocks; rank 0's summary dict

The agent restarts the whole worker group when a worker dies (up to
`parallel.max_restarts`; workers resume from the last checkpoint), and on
SIGINT/SIGTERM signals every worker, waits `parallel.shutdown_timeout_s` for the
final checkpoint, then kills what is left: no child outlives the launcher.

torch's elastic agent keeps its logs in the run directory, `agent/nodeR/` for host R (agent_dir):
a folder per launch, in it one per restart attempt, in that one per local rank with a failed worker's
error.json. The folders left empty are removed when the launch ends, and a fresh start (no --resume)
removes the host's earlier ones. Nothing goes to the system temp dir: torch's default is a
`torchelastic_*` folder there per run, and a worker's error pickled into a `pytorch-errorfile-*`
(run_worker, engine/run/worker_entry.py), neither ever removed.

Several hosts (`[cluster] nnodes > 1`, docs/cluster.md): one launcher per host, all meeting
at host 0's c10d rendezvous (`cluster.rdzv_endpoint`). Host R runs global ranks
R*k .. R*k+k-1 (k = world_size / nnodes), whatever order the rendezvous lists the hosts
in, so rank 0 (the hub), the parameter servers and neighbouring pipeline stages are
where the user put them; the workers' store is on host 0, at the rendezvous port + 1. At its end each
launcher waits for the other hosts' to end too, but not for a host the rendezvous has found dead
(engine/run/agent.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from engine.runtime import checkpoint as ckpt
from engine.runtime import compat
from engine.processes import forkserver
from engine.run import PRELOAD
from engine.processes.children import torch_cache_out_of_temp
from engine.config import config_to_toml
from engine.run.agent import ending_hosts_waited
from engine.run.handover import hand_over, release
from engine.runtime.refusal import FAILED, REFUSAL_SIGNAL, read_refusal
from engine.run.checks import RunSetupError, check_machine, check_model
from engine.run.claim import Claim, remove_leftovers
from engine.processes import lifeline
from engine.run.rank import Job, agent_dir, restart_marker
from engine.run.worker_entry import run_worker
from engine.telemetry.trackers.follow import follow_trackers


class RunRefused(RunSetupError):
    """The workers refused the run once it had started (a plan that cannot fit, a setting only a worker can
    check: engine/runtime/refusal.py); exit status 2, no restart."""


class RunFailed(RuntimeError):
    """Workers failed more often than `parallel.max_restarts` allows, or a worker's error would recur on a restart
    (engine/runtime/refusal.py): exit status 1."""


class RunInterrupted(RuntimeError):
    """The launcher was told to stop (Ctrl-C, SIGTERM); workers wrote a final checkpoint."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def prepare_run_dir(job: Job) -> None:
    """Check this host (check_machine), claim the run directory (engine/run/claim.py: a live run's is refused
    by name) and check the checkpoint to resume before any process starts. With several hosts, host 0 prepares
    the (shared) run directory; the others only check what they would resume. The claim, `job.claim`, is held
    until the process ends or it is released."""
    cfg = job.config
    check_machine(job)
    check_model(job)
    if job.claim is None:   # `trainyard run` took it first thing
        job.claim = Claim.take(cfg.run_dir, cfg.cluster.node_rank, cfg.run.name)
    try:
        remove_leftovers(cfg.run.name)
        _prepare_claimed(job)
    except BaseException:
        job.claim.abandon()   # a folder made for this run goes with it
        raise


def _prepare_claimed(job: Job) -> None:
    cfg = job.config
    run_dir = cfg.run_dir
    node = cfg.cluster.node_rank
    if node:
        if job.resume is not None:
            job.resume = ckpt.resolve(job.resume)
            ckpt.verify_or_offer(job.resume)
        else:   # an earlier run's agent logs are not this run's
            shutil.rmtree(agent_dir(run_dir, node), ignore_errors=True)
        (run_dir / "pids").mkdir(parents=True, exist_ok=True)
        (run_dir / "pids" / f"launcher-node{node}.pid").write_text(str(os.getpid()))
        return
    if job.resume is not None:
        job.resume = ckpt.resolve(job.resume)
        manifest = ckpt.verify_or_offer(job.resume)   # CheckpointError names the damaged file (and an earlier one)
        check_resumable(job, manifest)
    elif ckpt.list_checkpoints(run_dir):
        if not cfg.run.overwrite:
            raise RunSetupError(
                f"run directory {run_dir} already holds checkpoints: resume with --resume {run_dir}, "
                f"start afresh with --set run.overwrite=true, or pick another --set run.name=...")
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "telemetry.jsonl").unlink(missing_ok=True)
    if job.resume is None:
        shutil.rmtree(agent_dir(run_dir, node), ignore_errors=True)
    ckpt.remove_staged(run_dir)   # a crashed run's unpublished checkpoint (the folder is claimed: no rank writes)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    (run_dir / "pids").mkdir(exist_ok=True)
    for stale in (run_dir / "pids").glob("*.pid"):
        if not stale.name.startswith("launcher-node"):   # another host's launcher may be up already
            stale.unlink()
    (run_dir / "pids" / "launcher.pid").write_text(str(os.getpid()))


def check_resumable(job: Job, manifest: dict) -> None:
    """What cannot carry over from the checkpoint `job.resume` to this run, refused by name before any worker
    starts: its format, another model or data, another precision, another kind of optimizer. Another world size
    or strategy is no reason: a checkpoint is read by name (engine/runtime/checkpoint.py)."""
    cfg, source = job.config, job.resume
    ckpt.check_format(source, manifest)
    ckpt.check_precision(source, manifest, cfg.to_dict()["precision"])
    ckpt.check_optimizer(source, manifest, cfg.optim.name)
    saved = manifest.get("config", {})
    for section in ("model", "data"):
        if saved.get(section) != cfg.to_dict()[section]:
            raise ckpt.CheckpointError(
                f"{source}: the checkpoint's [{section}] differs from this config's; resume with the "
                f"config the run was started with (saved as {source.parent.parent / 'config.toml'})")
    if job.model is not None:   # a user's model: [model] says only "user", its names and shapes say which
        ckpt.check_shapes(source, manifest, job.model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_torch_elastic() -> None:
    # The agent logs every step of a restart or shutdown with tracebacks; trainyard
    # reports those itself, in a line each.
    # Each of its modules sets its own logger's level, so every one is quietened.
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this host; RunSetupError names the ones there are."""
    import psutil
    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise RunSetupError(f"cluster.interface = {name!r}: this host has no such interface "
                            f"(it has: {', '.join(sorted(addrs))})")
    for a in addrs[name]:
        if a.family == socket.AF_INET:
            return a.address
    raise RunSetupError(f"cluster.interface = {name!r}: the interface has no IPv4 address")


def _launch_config(job: Job, logs_dir: Path | None = None) -> LaunchConfig:
    """The agent's settings; `logs_dir`: where it keeps its logs (None: nowhere, for a config only looked at)."""
    cfg, c = job.config, job.config.cluster
    local_addr = None
    if c.interface:
        local_addr = interface_address(c.interface)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = c.interface
    wait = max(1, round(c.rdzv_timeout_s))   # torch reads these as whole seconds
    # a heartbeat every second; a host silent for cluster.host_timeout_s is dead to the rendezvous
    rdzv = {"timeout": wait, "join_timeout": wait, "keep_alive_interval": 1,
            "keep_alive_max_attempt": max(2, round(c.host_timeout_s))}
    common = dict(max_restarts=cfg.parallel.max_restarts, monitor_interval=0.1, start_method=start_method(),
                  shutdown_timeout=cfg.parallel.shutdown_timeout_s, rdzv_backend="c10d", local_addr=local_addr)
    # torch's default (logs_specs None) makes a torchelastic_* folder in the system temp dir as soon as the
    # config is built; without a folder of ours, os.devnull: none at all (a config only looked at)
    common["logs_specs"] = DefaultLogsSpecs(log_dir=str(logs_dir) if logs_dir is not None else os.devnull)
    if c.nnodes == 1:
        return compat.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=cfg.parallel.world_size,
                                    run_id=f"{cfg.run.name}-{os.getpid()}",
                                    rdzv_endpoint=c.rdzv_endpoint or f"127.0.0.1:{_free_port()}",
                                    rdzv_configs=rdzv, **common)
    host, port = c.rdzv_endpoint.rsplit(":", 1)
    per_host = cfg.parallel.world_size // c.nnodes
    job.placement = (host.strip("[]"), int(port) + 1)
    if c.node_rank == 0:
        _check_port_free(int(port) + 1, "the workers' store (the rendezvous port + 1)")
    # the rendezvous numbers the hosts that are there in the order of their names: named by host number, the
    # hosts present get contiguous ranks in that order, host 0 first (the name is no address: the workers' store
    # address is placement's, and the agents' own store is the rendezvous's)
    common["local_addr"] = host_name(c.node_rank)
    return compat.launch_config(min_nodes=c.host_counts[0], max_nodes=c.nnodes, nproc_per_node=per_host,
                                run_id=cfg.run.name, rdzv_endpoint=c.rdzv_endpoint,
                                rdzv_configs={**rdzv, "is_host": c.node_rank == 0,
                                              "last_call_timeout": max(1, round(c.last_call_s))}, **common)


def host_name(node_rank: int) -> str:
    """Host `node_rank`'s name at the rendezvous, which orders hosts by name (torch's _NodeDesc sorts)."""
    return f"trainyard-host-{node_rank:05d}"


def _check_port_free(port: int, what: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise RunSetupError(f"port {port} on this host is taken ({e.strerror}); it serves {what}: "
                                f"choose another cluster.rdzv_endpoint port") from None


class _RestartReporter(logging.Handler):
    """Prints the agent's decision to restart the worker group, in one line (its own log is quietened), and
    counts it in `job.generation` before the agent starts the new group (whose pickled Job carries it): a
    restart for a host that joins is no failure, so torch's restart count stays, and without ours the new
    group would start from the run's first checkpoint asked for instead of its last."""

    def __init__(self, job: Job):
        super().__init__(logging.INFO)
        node, nnodes = job.config.cluster.node_rank, job.config.cluster.nnodes
        self.where = f"host {node}: " if nnodes > 1 else ""
        self.nnodes, self.job = nnodes, job

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "will restart worker group" not in text:
            return
        self.job.generation += 1
        m = re.search(r"(\d+)/(\d+) attempts left", text)
        self.job.joined = not m
        left = f" ({m.group(1)} of {m.group(2)} restarts left)" if m else ""
        why = "a worker failed" if m else "a host is waiting to join"   # only a failure counts attempts
        if not m:   # the workers, stopped next, learn from it that the run goes on (Worker.restarting)
            marker = restart_marker(self.job.config.run_dir, self.job.config.cluster.node_rank)
            with suppress(OSError):
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(self.job.generation))
        fewest = self.job.config.cluster.host_counts[0]
        hosts = f"all {self.nnodes}" if fewest == self.nnodes else f"{fewest} to {self.nnodes}"
        wait = f"; waiting for {hosts} hosts at the rendezvous" if self.nnodes > 1 else ""
        print(f"trainyard: {self.where}{why}; restarting the worker group from the last checkpoint{left}{wait}",
              file=sys.stderr, flush=True)


def launch(job: Job) -> dict | None:
    cfg = job.config
    job.launched_at = job.launched_at or time.time()
    job.launcher = lifeline.identity()   # what every worker watches
    # A restarted gloo group hangs in connectFullMesh when it shares the rendezvous
    # store (pytorch/pytorch#135712); a store of its own restarts cleanly.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch_cache_out_of_temp()   # engine.train's path too: the workers import torch._dynamo
    _quiet_torch_elastic()
    agent = agent_dir(cfg.run_dir, cfg.cluster.node_rank)
    launch_cfg = _launch_config(job, agent)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    reporter = _RestartReporter(job)
    agent_log.addHandler(reporter)
    agent_log.setLevel(logging.INFO)
    agent_log.propagate = False
    try:
        preload = [PRELOAD, *forkserver.model_modules(job.model)]
        if launch_cfg.start_method == "forkserver" and not forkserver.start(preload):
            launch_cfg.start_method = "spawn"   # engine.train's path; `trainyard run` started it before torch
        hand_over(job)   # the user's model and data, as copies of the workers' own
        # trackers (TensorBoard, W&B) follow rank 0's log from here, off every rank's step
        with _refusals(job, agent), follow_trackers(cfg, job.log_path(), resumed=job.resume is not None), \
                ending_hosts_waited(reporter.where):   # a host lost for good is not waited for at the end
            # a worker forked from the fork server takes the launcher's environment as it starts (Inherit)
            forked = forkserver.Inherit() if launch_cfg.start_method == "forkserver" else None
            results = elastic_launch(launch_cfg, run_worker)(job, forked)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RunFailed(_describe_failure(rank, failure, cfg.parallel.max_restarts)) from None
    except RendezvousError as e:
        c = cfg.cluster
        raise RunFailed(f"the rendezvous at {launch_cfg.rdzv_endpoint} failed ({type(e).__name__}: {e}); "
                        f"{c.nnodes} hosts must join within cluster.rdzv_timeout_s = {c.rdzv_timeout_s:g} s"
                        ) from None
    except SignalException as e:
        raise RunInterrupted(f"stopped by {signal.Signals(e.sigval).name}; {ckpt.latest_said(cfg.run_dir)}",
                             int(e.sigval)) from None
    finally:
        agent_log.removeHandler(reporter)
        if not cfg.cluster.node_rank:   # host 0's workers publish checkpoints: a staged one now is a dead one's
            ckpt.remove_staged(cfg.run_dir)
        release(job)
        restart_marker(cfg.run_dir, cfg.cluster.node_rank).unlink(missing_ok=True)
        _remove_empty_folders(agent)
    summary = next((v for _, v in sorted(results.items()) if v), None)   # rank 0's, or a refusal
    if summary and summary.get("type") == "refused":
        raise RunRefused(summary["error"])
    return summary


def start_method() -> str:
    """How the agent starts a worker: forked from the fork server where it runs (engine/processes/forkserver.py:
    no GPU visible), else spawned afresh."""
    return "forkserver" if forkserver.usable() else "spawn"


def _remove_empty_folders(agent: Path) -> None:
    """The agent makes a folder for every attempt and rank; only those holding a failed worker's error.json are
    worth keeping. Removes the empty ones, `agent` and its parent included when nothing is left in them."""
    for folder, _, _ in os.walk(agent, topdown=False):
        with suppress(OSError):
            os.rmdir(folder)
    with suppress(OSError):
        agent.parent.rmdir()


@contextmanager
def _refusals(job: Job, folder: Path):
    """A worker's refusal (engine/runtime/refusal.py) arrives as REFUSAL_SIGNAL: the handler raises RunRefused in
    the agent's loop, whose run() then stops every worker at once; nothing is restarted. Only the first
    signal raises (several ranks may refuse alike; a second raise would cut the agent's shutdown short).
    Signals reach the main thread only: from another thread a refusal is restarted like any failure."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:   # the runtime dir (the sockets' private folder): a full run directory must not lose the reason
        from engine.telemetry.protocol import runtime_dir
        folder = runtime_dir()
    except OSError:   # RuntimeDirError (not private) included: the run's agent folder then
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"refusal-{os.getpid()}-{time.monotonic_ns()}"
    job.refusal_path = str(path)
    raised = []

    def handler(signum, frame):
        if raised:
            return
        raised.append(signum)
        kind, text = read_refusal(str(path))
        if kind == FAILED:
            raise RunFailed(f"{text} (not restarted: the same error would recur); {ckpt.latest_said(job.config.run_dir)}")
        raise RunRefused(text)

    previous = signal.signal(REFUSAL_SIGNAL, handler)
    try:
        yield
    finally:
        signal.signal(REFUSAL_SIGNAL, previous)
        path.unlink(missing_ok=True)


def _describe_failure(rank: int, failure, max_restarts: int) -> str:
    code = failure.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    message = failure.message
    if isinstance(message, dict):
        inner = message.get("message", "")
        message = inner.get("message", "") if isinstance(inner, dict) else inner
    message = "" if not message or "ProcessFailure" in str(message) else str(message)
    # the exception's own line ("RuntimeError: ..."), not the traceback around it
    errors = [line.strip() for line in message.splitlines() if re.match(r"\s*[\w.]+(Error|Exception)\b", line)]
    detail = errors[-1] if errors else (message.strip().splitlines() or [""])[-1]
    tail = f": {detail}" if detail else ""
    return f"worker rank {rank} {how}{tail} (after {max_restarts} restarts allowed by parallel.max_restarts)"
