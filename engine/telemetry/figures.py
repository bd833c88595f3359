"""Every per-rank figure every run reports, declared once by the part of the engine that reports it; a
strategy's own figures are declared in its package (its spec.py: StrategySpec.figures), and every run's
whole list is engine/strategies/specs/figures.py's.

    Figure("reduce_ms", "ms", "max", (LOG, STREAMS), optional="absent")   # a declaration
    own_ms("reduce_ms", STREAMS)   # the same: a time only some strategies measure, absent from others' entries
    FIGURES["step_ms"]       # every run's figures, by name (COMMON: the groups)
    declarations(figures)    # [{"name": "rank", "unit": "rank", "combine": "none", "shows": [...], ...}, ...]
    combine("max", [0.5, 1.25])   # 1.25: the ranks' values read as one, as a declaration's combine says

From the declarations come the exchange's columns, how a rank entry writes each figure, the closed JSON
schema of a rank entry, the check on docs/telemetry.md's table of them and the hello's `figures`, from which
a console learns what each of its panels shows. Torch-free: the console reads them too, through
engine.protocol (every run's; a strategy's own come in the hello). Imports nothing.
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


def ms(name, *shows, optional=""):   # a time on one rank: the ranks' slowest is what a step waits for
    return Figure(name, "ms", "max", (LOG, *shows), optional=optional)


def own_ms(name, *shows):   # a time only some modes measure: absent from others' entries (no zeros in every log)
    return ms(name, *shows, optional="absent")


def nbytes(name, *shows, required=False):   # bytes one rank holds or moves: the ranks' add up
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
    ms("compute_ms", FLEET),
    Figure("wait_ms", "ms", "max", (LOG, FLEET), required=True),
    Figure("flops", "flops", "sum", ()),
    # rows a reader overlays columns on, older than their step (engine.protocol.with_ranks), and a parameter
    # server's overdue workers
    Figure("stale_steps", "count", "max", (LOG, FLEET), optional="absent", exchanged=False),
)
# the device (engine/runtime/devices.py): the ledger's categories and gauges, then a GPU's own
DEVICE = (
    *(nbytes(f"{k}_bytes", DEVICES, required=True) for k in ("parameters", "gradients", "optimizer_state")),
    nbytes("master_bytes", DEVICES),
    nbytes("activations_bytes", DEVICES, required=True),
    nbytes("inputs_bytes", DEVICES),
    nbytes("swapped_bytes", DEVICES, required=True),
    nbytes("used_bytes", DEVICES, FLEET, required=True),
    Figure("peak_bytes", "bytes", "max", (LOG, DEVICES, FLEET), required=True),
    Figure("capacity_bytes", "bytes", "min", (LOG, DEVICES, FLEET), required=True),
    Figure("over_capacity", "flag", "max", (LOG, DEVICES, FLEET), required=True),
    nbytes("rss_bytes", DEVICES, FLEET, required=True),
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
    nbytes("swapped_out_bytes"),
    ms("link_wait_ms", DEVICES),
)
# the optimizer updates, device or host (engine/techniques/updates/updater.py timings)
UPDATES = (
    nbytes("host_bytes", DEVICES),
    ms("host_busy_ms"),
    own_ms("update_device_ms"),
    own_ms("host_gate_ms"),
    nbytes("host_link_bytes"),
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
# what every run reports, by contributor; a strategy's own: its spec's `figures` (engine/strategies/*/spec.py)
COMMON = {"core": CORE, "device": DEVICE, "gpu": GPU, "memory": MEMORY, "updates": UPDATES, "compile": COMPILE,
          "checkpoint": CHECKPOINT}
FIGURES = {f.name: f for group in COMMON.values() for f in group}
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


def label(figure: Figure) -> str:
    """A figure's name in a panel's words: without its unit's suffix, spaced (`broadcast_wait_ms` -> `broadcast
    wait`, `swap_layers` -> `swap layers`)."""
    return figure.name.removesuffix(f"_{figure.unit}").replace("_", " ")


def declarations(figures) -> list[dict]:
    """`figures` as JSON (the hello's `figures`), those a rank entry carries: each with its `name`, `unit`,
    `combine`, `shows`, `optional` and `label`. The exchange's own figures, in no record, are left out."""
    return [{"name": f.name, "unit": f.unit, "combine": f.combine, "shows": list(f.shows), "optional": f.optional,
             "label": label(f)} for f in figures if LOG in f.shows]


def every_run() -> list[dict]:
    """What a console knows of a run whose hello declares no figures (an older run, a replayed log): every
    run's, none of its strategy's own."""
    return declarations(FIGURES.values())


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
