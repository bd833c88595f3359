"""`trainyard plan`: a plan on paper for jobs this machine cannot run (docs/plan.md).

    trainyard plan run.toml --hosts 8 --per-host 8 --memory 80GB [--set KEY=VALUE ...] [--json]

For the config's model, built on the meta device (no weights, no worker, no data file read), every layout of
hosts x devices: ddp, sharded, and the pipeline at each stage count dividing the world with its replicas combining
as ddp or sharded; for each, what its tightest rank holds by the ledger's categories and the capacity it needs
(FIT_MARGIN more, as engine/run/fit.py asks), under keep and at the recompute floor; bf16 working weights and host
updates where they change the answer. Exit status 0 when a layout fits, 2 when none does (the smallest capacity
any would need is said) or the config or a flag is bad.

- model.py: the config read for planning, the model on meta, each layer's figures.
- layouts.py: the layouts and each strategy's memory rule.
Imports engine.config, engine.models, engine.run.fit and the strategies' pure planners (sharded owners,
pipeline partition): on the commands' floor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError, format_size, parse_size
from engine.run.fit import FIT_MARGIN

COLUMNS = (("layout", 21), ("S x R", 8), ("weights", 7), ("updates", 9), ("mb", 4), ("params", 10),
           ("grads", 10), ("master", 10), ("optim", 10), ("acts", 10), ("need", 10), ("floor", 10), ("fits", 9))


class PlanError(ValueError):
    """A bad flag of `trainyard plan`, said by name."""


@dataclass
class Plan:
    """What `trainyard plan` found: the rows (engine/plan/layouts.py Row) and what they were planned for."""

    config: str
    hosts: int
    per_host: int
    capacity_bytes: int
    parameters: int
    batch_size: int
    about: str
    rows: list

    @property
    def fitting(self) -> list:
        return [r for r in self.rows if r.fits != "no"]


def plan(config: Path, hosts: int, per_host: int, memory: str | None, overrides: list[str],
         as_json: bool, say=print) -> int:
    """The command: prints the table (or JSON); returns the exit status (0 a layout fits, 2 none does)."""
    found = make_plan(config, hosts, per_host, memory, overrides)
    for line in (to_json(found) if as_json else table(found)):
        say(line)
    if not found.fitting:
        runnable = [r for r in found.rows if not r.problem] or found.rows
        least = min(runnable, key=lambda r: r.recompute_need_bytes)
        why = f"the smallest need is {format_size(least.recompute_need_bytes)} ({_said(least)}, recompute floor)" \
            if not least.problem else f"no layout splits the batch: {least.problem}"
        say(f"no layout fits {format_size(found.capacity_bytes)} a device: {why}")
        return 2
    return 0


def make_plan(config: Path, hosts: int, per_host: int, memory: str | None, overrides: list[str]) -> Plan:
    """Every layout's row for the config's model on hosts x per_host devices of `memory` (None: device.memory).
    ConfigError for a bad config, PlanError for a bad flag, ValueError for a model that cannot be built."""
    from engine.plan.layouts import plan_rows
    from engine.plan.model import ModelShape, build_on_meta, planned_config
    if hosts < 1:
        raise PlanError(f"--hosts {hosts}: must be at least 1")
    if per_host < 1:
        raise PlanError(f"--per-host {per_host}: must be at least 1")
    cfg = planned_config(config, overrides)
    capacity = capacity_bytes(cfg, memory)
    built = build_on_meta(cfg)
    weights = [cfg.precision.params] + (["bf16"] if cfg.precision.params == "fp32" else [])
    shapes = {w: ModelShape.of(cfg, w, built) for w in weights}
    rows = plan_rows(cfg, shapes, hosts, per_host, capacity)
    about = (f"{cfg.model.name} model; batch {cfg.data.batch_size}" +
             (f" x {cfg.data.seq_len} tokens" if cfg.data.name in ("text", "tokens") else "") +
             f"; {cfg.optim.name}; compute {cfg.precision.compute}")
    return Plan(str(config), hosts, per_host, capacity, shapes[cfg.precision.params].parameter_count,
                cfg.data.batch_size, about, rows)


def table(found: Plan) -> list[str]:
    world = found.hosts * found.per_host
    return [f"{found.config}: {found.about}; {found.parameters:,} parameters; {found.hosts} hosts x "
            f"{found.per_host} devices = world {world}; {format_size(found.capacity_bytes)} a device",
            "  ".join(f"{name:<{width}}" for name, width in COLUMNS).rstrip(),
            *(_line(r) for r in found.rows),
            f"per rank, the tightest (a pipeline's stage, sharded's largest owner); need: the total with keep's "
            f"activations and {FIT_MARGIN:.0%} more; floor: the same with recompute's; mb: samples a micro-batch"]


def to_json(found: Plan) -> list[str]:
    return [json.dumps(dict(config=found.config, hosts=found.hosts, per_host=found.per_host,
                            world=found.hosts * found.per_host, capacity_bytes=found.capacity_bytes,
                            margin=FIT_MARGIN, parameters=found.parameters, batch_size=found.batch_size,
                            layouts=[r.to_json() for r in found.rows]), indent=1)]


def capacity_bytes(cfg, memory: str | None) -> int:
    """`--memory`, else `[device] memory`; a plan needs a number (`auto` is the GPU's own, not known here)."""
    if memory is not None:
        try:
            return parse_size(memory)
        except ValueError as e:
            raise PlanError(f"--memory {memory!r}: {e}") from None
    if cfg.capacity_bytes is None:
        raise PlanError('device.memory = "auto": the plan needs each device\'s capacity: give --memory SIZE '
                        '(e.g. 80GB) or set [device] memory')
    return cfg.capacity_bytes


def _said(r) -> str:
    return f"{r.layout.label}, {r.weights} weights, {r.updates} updates"


def _line(r) -> str:
    f = r.figures
    cells = [r.layout.label, f"{r.layout.stages} x {r.layout.replicas}", r.weights, r.updates]
    if r.problem:
        return "  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS)) + f"  -- {r.problem}"
    sizes = [f.parameters, f.gradients, f.master, f.optimizer_state, f.activations, r.need_bytes,
             r.recompute_need_bytes]
    cells += [str(r.micro_batch)] + [format_size(b) for b in sizes] + [r.fits]
    return "  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS)).rstrip()


__all__ = ["ConfigError", "Plan", "PlanError", "capacity_bytes", "make_plan", "plan", "table", "to_json"]
