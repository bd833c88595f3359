"""engine/runtime/compat.py: a run still starts on a torch whose launcher lacks a newer option, and says
once what is not applied; on this torch nothing is left out and nothing is said."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from engine.runtime import compat
from engine.config import load_config
from engine.run.launch import _launch_config, start_method
from engine.run.rank import Job

DDP = "demo/configs/digits_ddp.toml"


@dataclass
class LaunchConfigWithoutShutdownTimeout:
    """torch 2.8 .. 2.11's LaunchConfig, as far as trainyard uses it: no shutdown_timeout."""
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    local_addr: str | None = None
    logs_specs: object = None   # torch >= 2.3


@pytest.fixture
def fresh(monkeypatch):
    """Nothing said yet in this process, whatever other tests printed."""
    monkeypatch.setattr(compat, "_said", set())


def _job(*overrides: str) -> Job:
    return Job(config=load_config(DDP, list(overrides)))


TWO_HOSTS = ("cluster.nnodes=2", "cluster.node_rank=1", "cluster.rdzv_endpoint=127.0.0.1:29999")


@pytest.mark.parametrize("hosts", [(), TWO_HOSTS], ids=["one host", "two hosts"])
def test_an_older_launcher_still_builds_the_config_and_says_so_once(monkeypatch, capsys, fresh, hosts):
    monkeypatch.setattr(compat, "LaunchConfig", LaunchConfigWithoutShutdownTimeout)
    job = _job("parallel.shutdown_timeout_s=10", *hosts)
    first = _launch_config(job)
    second = _launch_config(job)
    for cfg in (first, second):
        assert isinstance(cfg, LaunchConfigWithoutShutdownTimeout)
        assert not hasattr(cfg, "shutdown_timeout")
        assert cfg.nproc_per_node * job.config.cluster.nnodes == job.config.parallel.world_size
        assert cfg.max_nodes == job.config.cluster.nnodes
        assert cfg.rdzv_backend == "c10d" and cfg.start_method == start_method()
        assert {"timeout", "join_timeout"} <= set(cfg.rdzv_configs)
    err = capsys.readouterr().err
    assert err.count("trainyard: ") == 1, err
    assert "launcher has no shutdown_timeout" in err
    assert "parallel.shutdown_timeout_s = 10 is not applied" in err
    assert f"fixed {compat.OLD_SHUTDOWN_WAIT_S} s" in err


@pytest.mark.skipif("shutdown_timeout" not in compat.launch_config_fields(),
                    reason="this torch's launcher is older than torch 2.12")
def test_this_torch_drops_nothing_and_says_nothing(capsys, fresh):
    job = _job("parallel.shutdown_timeout_s=10")
    cfg = _launch_config(job)
    assert cfg.shutdown_timeout == 10
    assert cfg.nproc_per_node == job.config.parallel.world_size
    assert capsys.readouterr().err == ""


def test_fields_of_a_class_that_is_not_a_dataclass():
    class Plain:
        def __init__(self, min_nodes, max_nodes, shutdown_timeout=None):
            pass
    assert compat.launch_config_fields(Plain) == {"min_nodes", "max_nodes", "shutdown_timeout"}
    assert "shutdown_timeout" not in compat.launch_config_fields(LaunchConfigWithoutShutdownTimeout)
    real = {f.name for f in dataclasses.fields(compat.LaunchConfig)}
    assert compat.launch_config_fields() == real


def test_accepts():
    def step(*args, target=None, return_outputs=True, **kwargs):
        pass
    assert compat.accepts(step, "return_outputs") and compat.accepts(step, "target")
    assert not compat.accepts(step, "scale_grads")
    assert not compat.accepts(42, "anything")


def test_a_torch_below_the_floor_is_named_with_what_breaks():
    assert compat.below_floor("2.13.0+cpu") is None and compat.below_floor("2.8.0") is None
    line = compat.below_floor("2.4.1+cu121")
    assert line.startswith("torch 2.4.1+cu121 is older than trainyard's floor 2.8: workers may hang at exit")
