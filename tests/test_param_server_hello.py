"""A parameter-server run says what the step loop says of itself at the start: its hello, from the one builder
(engine/runtime/lifecycle.py hello), the world range of a run over a range of hosts included."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.config import config_from_dict
from engine.strategies.param_server.setup import Setup


def ps_setup(cluster: dict) -> Setup:
    """A server's Setup as its __init__ leaves it, without the processes: 1 server, 2 workers, 3 layers."""
    cfg = config_from_dict({"parallel": {"strategy": "param_server", "world_size": 3,
                                         "param_server": {"servers": 1, "workers": 2}}, "cluster": cluster})
    setup = Setup.__new__(Setup)
    setup.cfg, setup.servers, setup.workers = cfg, 1, 2
    setup.topo = SimpleNamespace(world_size=2, backend="gloo", hosts=lambda: [0, 2])   # host 1 is gone
    setup.device = SimpleNamespace(name="cpu", simulated=False, rank_names=None, note="")
    setup.model = SimpleNamespace(names=["fc0", "act0", "head"])
    setup.params = {0: [torch.nn.Parameter(torch.zeros(2))], 2: [torch.nn.Parameter(torch.zeros(2))]}
    setup.owner = {0: 0, 2: 0}
    return setup


def test_a_parameter_server_run_over_a_range_of_hosts_tells_the_console_its_largest_world():
    ranged = ps_setup({"nnodes": 3, "min_nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}).hello()
    assert ranged["max_world_size"] == 3 and ranged["world_size"] == 2 and ranged["hosts"] == [0, 2]
    assert ranged["mode"] == "param_server" and ranged["updated_layers"] == ["fc0", "head"]
    assert ranged["capabilities"] == ["pause", "resume", "stop", "checkpoint", "set-sync"]
    assert ranged["layout"]["strategy"] == "param_server" and ranged["layout"]["server_layers"] == {"0": ["fc0", "head"]}
    one_size = ps_setup({}).hello()
    assert "max_world_size" not in one_size   # a run of one size says only the world it has
    assert set(ranged) - set(one_size) == {"max_world_size"}
