"""Every per-rank figure, declared once by the part of the engine that reports it.

    FIGURES["reduce_ms"]     # Figure(name="reduce_ms", unit="ms", combine="max", shows=("log",), ...)
    EXCHANGED                # the boundary's columns, in order (engine/runtime/control.py FIELDS)
    LOGGED                   # the keys of a step record's `ranks` entries (engine/telemetry/schema.py)
    undeclared({"loss": 1.0, "foo_ms": 2.0})   # ["foo_ms"]: a figure nobody declared
    declared("sharded")      # [{"name": "rank", "unit": "rank", "combine": "none", "shows": [...], ...}, ...]
    combine("max", [0.5, 1.25])   # 1.25: the ranks' values read as one, as a declaration's combine says

From these come the exchange's columns, how a rank entry writes each figure, the closed JSON schema of a
rank entry, the check on docs/telemetry.md's table of them and the hello's `figures`, from which a console
learns what each of its panels shows. Torch-free: the console reads them too, through engine.protocol.
Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# where a figure shows: the log's rank entries, and the console's panels that read it from them
LOG, DEVICES, FLEET, STAGES, STREAMS = "log", "devices", "fleet", "stages", "streams"
UNITS = ("ms", "bytes", "count", "percent", "core_percent", "flag", "loss", "rank", "role", "step", "errno",
         "flops")
COMBINES = ("max", "min", "sum", "mean", "first", "none")   # how rank 0 reads every rank's value as one
OPTIONAL = ("", "absent", "zero")   # always there; only where reported (a GPU's: sent as NaN); only while not 0


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    combine: str
    shows: tuple[str, ...] = (LOG,)   # (): the exchange's own, in no record
    optional: str = ""
    required: bool = False   # in every rank entry since the first logs: the schema requires it
    exchanged: bool = True   # False: written into the rank entry after the exchange (a role, a staleness)


def _ms(name, *shows, optional=""):   # a time on one rank: the ranks' slowest is what a step waits for
    return Figure(name, "ms", "max", (LOG, *shows), optional=optional)


def _own(name, *shows):   # a time only some modes measure: absent from others' entries (no zeros in every mode's log)
    return _ms(name, *shows, optional="absent")


def _bytes(name, *shows, required=False):   # bytes one rank holds or moves: the ranks' add up
    return Figure(name, "bytes", "sum", (LOG, *shows), required=required)


# the step loop (engine/run/worker.py) and the boundary itself
CORE = (
    Figure("stop", "flag", "max", ()),
    Figure("command_bytes", "bytes", "first", ()),
    Figure("rank", "rank", "none", (LOG, DEVICES, FLEET), required=True, exchanged=False),
    Figure("loss", "loss", "mean", (LOG,), required=True),
    Figure("step_ms", "ms", "max", (LOG, FLEET), required=True),
    Figure("fwd_ms", "ms", "max", (LOG, FLEET), required=True),
    Figure("bwd_ms", "ms", "max", (LOG, FLEET), required=True),
    Figure("optim_ms", "ms", "max", (LOG,), required=True),
    _ms("compute_ms", FLEET),
    Figure("wait_ms", "ms", "max", (LOG, FLEET), required=True),
    Figure("flops", "flops", "sum", ()),
)
# the device (engine/runtime/devices.py): the ledger's categories and gauges, then a GPU's own
DEVICE = (
    *(_bytes(f"{k}_bytes", DEVICES, required=True) for k in ("parameters", "gradients", "optimizer_state")),
    _bytes("master_bytes", DEVICES),
    _bytes("activations_bytes", DEVICES, required=True),
    _bytes("inputs_bytes", DEVICES),
    _bytes("swapped_bytes", DEVICES, required=True),
    _bytes("used_bytes", DEVICES, FLEET, required=True),
    Figure("peak_bytes", "bytes", "max", (LOG, DEVICES, FLEET), required=True),
    Figure("capacity_bytes", "bytes", "min", (LOG, DEVICES, FLEET), required=True),
    Figure("over_capacity", "flag", "max", (LOG, DEVICES, FLEET), required=True),
    _bytes("rss_bytes", DEVICES, FLEET, required=True),
    Figure("cpu_percent", "core_percent", "mean", (LOG, DEVICES), required=True),
)
GPU = tuple(Figure(name, unit, combine, (LOG, DEVICES, FLEET), optional="absent") for name, unit, combine in (
    ("allocated_bytes", "bytes", "sum"), ("reserved_bytes", "bytes", "sum"),
    ("allocator_peak_bytes", "bytes", "max"), ("nvml_used_bytes", "bytes", "sum"),
    ("nvml_total_bytes", "bytes", "sum"), ("gpu_util_percent", "percent", "mean")))
# the activation policy (engine/techniques/memory_report.py step_fields)
MEMORY = (
    Figure("swap_layers", "count", "sum", (LOG, DEVICES)),
    Figure("recompute_layers", "count", "sum", (LOG, DEVICES)),
    Figure("plan_made", "flag", "max", ()),
    Figure("plan_estimate_bytes", "bytes", "max", ()),
    Figure("min_capacity_bytes", "bytes", "max", ()),
    _bytes("swapped_out_bytes"),
    _ms("link_wait_ms", DEVICES),
)
# the optimizer updates, device or host (engine/techniques/updates/updater.py timings)
UPDATES = (
    _bytes("host_bytes", DEVICES),
    _ms("host_busy_ms"),
    _own("update_device_ms"),
    _own("host_gate_ms"),
    _bytes("host_link_bytes"),
)
# `[model] compile` (engine/models/compile.py compile_figures): cumulative, absent while nothing compiled
COMPILE = (Figure("compile_ms", "ms", "max", optional="zero"),
           Figure("recompiles", "count", "sum", optional="zero"))
# each rank's checkpoint writer (engine/run/checkpointer.py): the last step whose file it wrote, a failed write's
# step + 1 and errno, its last checkpoint's stall and write times; rank 0 publishes from them
CHECKPOINT = (
    Figure("ckpt_written", "step", "min", ()),
    Figure("ckpt_failed", "step", "max", ()),
    Figure("ckpt_errno", "errno", "max", ()),
    Figure("ckpt_stall_ms", "ms", "max", ()),
    Figure("ckpt_write_ms", "ms", "max", ()),
)
# ddp (engine/strategies/ddp.py): after the last gradient, the all-reduce's tail and the updates
DDP = (_own("after_backward_ms"),)
# sharded (engine/strategies/sharded/strategy.py): ownership, the reduce onto owners, the sliced broadcast; the
# streams panel shows the reduce's and the broadcast's waits and spans beside the streams that carry them
SHARDED = (
    _bytes("owned_bytes", DEVICES),
    _ms("gate_ms"),
    _own("reduce_ms", STREAMS),
    _own("reduce_span_ms", STREAMS),
    _own("broadcast_issue_ms"),
    _own("broadcast_wait_ms", STREAMS),
    _own("broadcast_span_ms", STREAMS),
    _own("host_wait_ms"),
)
# pipeline (engine/strategies/pipeline/stage.py): a stage's traffic, its waits (on its line of the stages panel),
# its layers' moves
PIPELINE = (
    _bytes("sent_bytes"),
    _own("recv_wait_ms", STAGES),
    _bytes("migration_bytes"),
    _ms("migration_ms"),
)
# param_server (engine/strategies/param_server/coordinator.py): written into rank 0's entries, not exchanged;
# stale_steps also by a reader overlaying columns on older rows (engine.protocol.with_ranks)
PARAM_SERVER = (
    Figure("role", "role", "none", (LOG, FLEET), optional="absent", exchanged=False),
    Figure("alive", "flag", "none", (LOG, DEVICES, FLEET), optional="absent", exchanged=False),
    Figure("stale_steps", "count", "max", (LOG, FLEET), optional="absent", exchanged=False),
)

# a strategy's group is CONTRIBUTORS[its name]; every run reports these besides
COMMON = ("core", "device", "gpu", "memory", "updates", "compile", "checkpoint")
CONTRIBUTORS = {"core": CORE, "device": DEVICE, "gpu": GPU, "memory": MEMORY, "updates": UPDATES,
                "compile": COMPILE, "checkpoint": CHECKPOINT, "ddp": DDP, "sharded": SHARDED, "pipeline": PIPELINE,
                "param_server": PARAM_SERVER}
FIGURES = {f.name: f for group in CONTRIBUTORS.values() for f in group}
EXCHANGED = tuple(f.name for f in FIGURES.values() if f.exchanged)
LOGGED = tuple(f.name for f in FIGURES.values() if LOG in f.shows)
GPU_FIELDS = tuple(f.name for f in GPU)
CHECKPOINT_FIELDS = tuple(f.name for f in CHECKPOINT)
# what device.stats() says of the device besides its figures: words, said once in `run_start`, never exchanged
WORDS = ("kind", "simulated")

_JSON = {"ms": {"type": "number", "minimum": 0}, "bytes": {"type": "integer", "minimum": 0},
         "count": {"type": "integer", "minimum": 0}, "percent": {"type": "number", "minimum": 0, "maximum": 100},
         "core_percent": {"type": "number", "minimum": 0}, "flag": {"type": "boolean"},
         "loss": {"type": ["number", "null"]}, "rank": {"type": "integer", "minimum": 0},
         "role": {"enum": ["server", "worker"]}, "step": {"type": "integer", "minimum": 0},
         "errno": {"type": "integer", "minimum": 0}, "flops": {"type": "number", "minimum": 0}}
INTEGER_UNITS = ("bytes", "count", "rank", "step", "errno")


def json_type(figure: Figure) -> dict:
    """The JSON Schema of the figure's value in a rank entry."""
    return dict(_JSON[figure.unit])


def undeclared(values: dict) -> list[str]:
    """The names in `values` the exchange has no column for (a figure nobody declared, or one not exchanged)."""
    return [k for k in values if k not in _EXCHANGED_SET and k not in WORDS]


_EXCHANGED_SET = frozenset(EXCHANGED)


def label(figure: Figure) -> str:
    """A figure's name in a panel's words: without its unit's suffix, spaced (`broadcast_wait_ms` -> `broadcast
    wait`, `swap_layers` -> `swap layers`)."""
    return figure.name.removesuffix(f"_{figure.unit}").replace("_", " ")


def declared(strategy: str) -> list[dict]:
    """The declarations of the figures a run of `strategy` writes into its rank entries, as JSON (the hello's
    `figures`): the common groups' and the strategy's own (none for a strategy with no group), each with its
    `name`, `unit`, `combine`, `shows`, `optional` and `label`. The exchange's own figures, in no record, are
    left out."""
    groups = (*COMMON, strategy) if strategy not in COMMON else COMMON
    return [{"name": f.name, "unit": f.unit, "combine": f.combine, "shows": list(f.shows), "optional": f.optional,
             "label": label(f)}
            for group in groups for f in CONTRIBUTORS.get(group, ()) if LOG in f.shows]


def combine(how: str, values: list) -> float | bool | None:
    """The ranks' `values` read as one, as a declaration's `combine` says (COMBINES); None where there is none
    to read (no number among them, or `none`: a figure each rank has alone, such as its role)."""
    numbers = [v for v in values if isinstance(v, (int, float))]   # a non-finite figure is null on the wire
    if not numbers or how not in COMBINES or how == "none":
        return None
    if how == "first":
        return numbers[0]
    if how == "mean":
        return sum(numbers) / len(numbers)
    return {"max": max, "min": min, "sum": sum}[how](numbers)
