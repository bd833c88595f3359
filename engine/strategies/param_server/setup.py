"""What every rank of a parameter-server run sets up alike: which server owns which layer, the
device, data and model, the links, where the run resumes, and what it writes about its layout.

    setup = Setup(job, topo, stop, build_rank)   # every rank, servers and workers, at the start (engine/run/rank.py)
    setup.owner                        # layer index -> server rank (assign_layers)
    setup.links                        # peer rank -> Link (engine/strategies/param_server/links.py)
    setup.first_step                   # 0, or the step of the checkpoint it resumes from

Layers go to servers by parameter bytes (assign_layers): the largest first, each to the server that
holds the fewest so far, so every server holds about as much.
"""

from __future__ import annotations

import torch

from engine.training.data import batch_for, global_count
from engine.training.loss import cross_entropy
from engine.runtime import lifecycle
from engine.runtime.checkpoint_writer import run_meta
from engine.runtime.run_core import resume_point
from engine.models.layers import params_by_layer
from engine.strategies.param_server.links import make_links




class ParamServerError(RuntimeError):
    """The parameter-server run cannot go on (a model it cannot serve)."""


class PeerLost(ParamServerError):
    """A server, every worker, or an answer was lost: a restart may cure it (engine/runtime/refusal.py)."""

    transient = True


def assign_layers(sizes: dict[int, int], servers: int) -> dict[int, int]:
    """Layer index -> server rank, balancing parameter bytes: the largest layer first, each to the
    server holding the fewest bytes so far (ties to the lower rank, then the earlier layer)."""
    if len(sizes) < servers:
        raise ParamServerError(
            f"parallel.param_server.servers = {servers} but the model has only {len(sizes)} layers with parameters: "
            f"every server needs at least one layer (use at most {len(sizes)} servers)")
    load = [0] * servers
    owner = {}
    for layer in sorted(sizes, key=lambda j: (-sizes[j], j)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[layer] = server
        load[server] += sizes[layer]
    return dict(sorted(owner.items()))


def layer_params(model) -> dict[int, list[torch.nn.Parameter]]:
    """Each layer's parameters, for the layers that have any. A weight several layers hold (tied) is its first
    holder's: pushed with that layer's gradient (autograd has summed both uses into it by then), updated by
    that layer's server, and pulled with that layer, before any later holder's forward needs it."""
    return {j: ps for j, ps in params_by_layer(model).items() if ps}


class Setup:
    """What every rank of a parameter-server run builds the same way: device, data, model, the
    layers' owners, the links, and where it resumes."""

    def __init__(self, job, topo, stop, build):
        cfg = self.cfg = job.config
        self.job, self.topo, self.stop = job, topo, stop
        self.loss_fn = job.loss_fn or cross_entropy   # engine/training/loss.py
        self.servers = cfg.parallel.param_server.servers
        self.workers = topo.world_size - self.servers
        self.restart, self.device, self.data, self.model = build(job, topo)   # the run's build_rank
        self.params = layer_params(self.model)
        self.owner = assign_layers({j: sum(p.numel() * p.element_size() for p in ps)
                                    for j, ps in self.params.items()}, self.servers)
        # the links carry the working dtype (bf16 under precision.params = "bf16"); a server keeps its
        # layers' weights in fp32, the masters, and narrows them for each pull's reply
        self.link_dtype = next(iter(self.params.values()))[0].dtype if self.params else torch.float32
        self.masters = topo.rank < self.servers and self.link_dtype != torch.float32
        if topo.rank < self.servers:   # a server counts the layers it owns; a worker the whole model
            owned = torch.nn.ModuleList([self.model.layers[j] for j, s in self.owner.items() if s == topo.rank])
            if self.masters:
                owned.float()
                self.params = layer_params(self.model)
                for p in owned.parameters():   # the updates' fp32 gradients, summed into in place
                    p.grad = torch.zeros_like(p)
                self.device.ledger.extra["master"] = sum(p.numel() * 4 for p in owned.parameters())
                self.device.ledger.extra["gradients"] = self.device.ledger.extra["master"]
            else:
                self.device.ledger.track_module(owned)
        else:
            self.device.ledger.track_module(self.model)
        self.links = make_links(topo, self.servers, cfg.parallel.collective_timeout_s)
        self.resume = resume_point(cfg, job, self.restart)   # the run core's (engine/runtime/run_core.py)
        self.first_step = self.resume.step if self.resume else 0

    def batch(self, iteration: int, index: int):
        return batch_for(self.data, iteration, self.cfg.data.batch_size, self.cfg.run.seed, index, self.workers)

    def global_counted(self, iteration: int) -> int | None:
        """The targets the loss counts in the iteration's global batch, or None: every share counts alike."""
        return global_count(self.data, iteration, self.cfg.data.batch_size, self.cfg.run.seed, self.loss_fn)

    def restore(self, server) -> None:
        """Load a server's (engine/strategies/param_server/server.py) layers from the checkpoint this run
        resumes from, if any: written by any strategy at any world size, read by name (server.load)."""
        if self.resume is None:
            return
        with self.resume.reader() as reader:
            server.load(reader)
        for j in server.mine:
            server.count[j] = self.first_step * self.workers

    def layout(self) -> dict:
        p = self.cfg.parallel.param_server
        return {"strategy": "param_server", "servers": self.servers, "workers": self.workers, "sync": p.sync,
                "staleness_bound": p.staleness_bound, "staleness_scaling": p.staleness_scaling,
                "staleness_unit": p.staleness_unit,
                "server_layers": {str(s): [self.model.names[j] for j, o in self.owner.items() if o == s]
                                  for s in range(self.servers)},
                "roles": ["server" if r < self.servers else "worker" for r in range(self.topo.world_size)],
                "slow_workers": dict(p.slow_workers)}

    def manifest(self, step: int) -> dict:
        return run_meta(self.cfg, self.topo.world_size, step, self.layout(), self.model)

    def hello(self) -> dict:
        """The run's hello (engine/runtime/lifecycle.py), its world range included; a tied weight's layers
        after its first holder have no update of their own (layer_params)."""
        return lifecycle.hello(self.cfg, self.topo, self.device, self.model.names, self.layout(),
                               [self.model.names[j] for j in sorted(self.params)])
