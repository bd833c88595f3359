"""The telemetry log's records as JSON Schema (draft 2020-12); docs/telemetry.md describes them.

Tests validate every record a run writes against RECORD_SCHEMA, so the documentation,
the schema and the writer cannot drift apart. A step record's rank entry comes from the figures'
declarations (every run's and every strategy's: engine/strategies/specs/figures.py), closed: a key no one
declared fails.
"""

from engine.strategies.specs.figures import FIGURES, LOGGED, PANEL_COLUMNS
from engine.telemetry.figures import json_type
from engine.telemetry.protocol import (MEMORY_COLUMNS, OPTIONAL_MEMORY_COLUMNS, OPTIONAL_RANK_COLUMNS,
                                       PS_LAYER_COLUMNS, PS_WORKER_COLUMNS, RANK_COLUMNS, SYNC_MODES)

_BYTES = {"type": "integer", "minimum": 0}

# closed: every key of a rank entry is a declared figure, of its unit's type
RANK_ENTRY = {
    "type": "object",
    "required": [name for name in LOGGED if FIGURES[name].required],
    "additionalProperties": False,
    "properties": {name: json_type(FIGURES[name]) for name in LOGGED},
}

TIME_SPLIT = {
    "type": "object", "required": ["compute_ms", "comm_ms", "wait_ms"],
    "properties": {k: {"type": "number", "minimum": 0} for k in ("compute_ms", "comm_ms", "wait_ms")},
}

STREAM = {
    "type": "object", "required": ["stream", "bytes", "busy_ms", "busy_fraction", "in_flight"],
    "properties": {"stream": {"type": "integer", "minimum": 0}, "bytes": _BYTES,
                   "busy_ms": {"type": "number", "minimum": 0},
                   "busy_fraction": {"type": "number", "minimum": 0, "maximum": 1},
                   "in_flight": {"type": "integer", "minimum": 0}},
}

LAYER = {
    "type": "object", "required": ["name", "fwd_ms", "bwd_ms", "activation_bytes"],
    "properties": {"name": {"type": "string"}, "fwd_ms": {"type": "number", "minimum": 0},
                   "bwd_ms": {"type": "number", "minimum": 0}, "activation_bytes": _BYTES,
                   "owner_rank": {"type": "integer"}, "stage": {"type": "integer"},
                   "policy": {"enum": ["keep", "swap", "recompute"]}, "placement": {"enum": ["device", "host"]}},
}

# `nonfinite`: the fields written as null because they were NaN or inf (engine.protocol.finite_record)
_COMMON = {"schema": {"const": 1}, "time": {"type": "number"},
           "nonfinite": {"type": "array", "items": {"type": "string"}}}

RUN_START = {
    "type": "object",
    # every run writes devices and device_note; logs from before they were written still replay without them
    "required": ["schema", "time", "type", "name", "strategy", "world_size", "backend", "device", "simulated",
                 "layers", "first_step", "restart", "config"],
    "properties": {**_COMMON, "type": {"const": "run_start"}, "name": {"type": "string"},
                   "strategy": {"type": "string"}, "world_size": {"type": "integer", "minimum": 1},
                   "max_world_size": {"type": "integer", "minimum": 1},
                   "hosts": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                   "backend": {"enum": ["gloo", "nccl"]}, "device": {"type": "string"},
                   "simulated": {"type": "boolean"}, "devices": {"type": "array", "items": {"type": "string"}},
                   "device_note": {"type": "string"},
                   "layers": {"type": "array", "items": {"type": "string"}}, "first_step": {"type": "integer", "minimum": 0}, "restart": {"type": "integer", "minimum": 0},
                   "config": {"type": "object"},
                   # where the work is placed (a pipeline's stages, and with replicas its grid; a server's layers)
                   "layout": {"type": "object"},
                   # the hello's declarations of the figures its rank entries carry (docs/protocol.md, hello)
                   "figures": {"type": "array", "items": {"type": "object", "required": ["name", "unit", "shows"]}}},
}

PS = {   # param_server: the sync mode, every worker, every layer with parameters (or their columns)
    "type": "object",
    "required": ["mode", "workers_live", "workers_lost"],
    "oneOf": [{"required": ["workers", "layers"]}, {"required": ["worker_columns", "layer_columns"]}],
    "properties": {
        "worker_columns": {"type": "object", "required": list(PS_WORKER_COLUMNS), "additionalProperties": False,
                           "properties": {name: {"type": "array"} for name in PS_WORKER_COLUMNS}},
        "layer_columns": {"type": "object", "required": list(PS_LAYER_COLUMNS[:4]),   # the tally's: newer
                          "additionalProperties": False,
                          "properties": {name: {"type": "array"} for name in PS_LAYER_COLUMNS}},
        "mode": {"enum": list(SYNC_MODES)}, "workers_live": {"type": "integer", "minimum": 0},
        "loss_workers": {"type": "integer", "minimum": 1},   # logs before it was added lack it
        "workers_lost": {"type": "array", "items": {"type": "integer"}},
        "workers": {"type": "array", "items": {
            "type": "object", "required": ["rank", "iterations", "steps_per_s", "wait_ms", "slow_factor", "alive"],
            "properties": {"rank": {"type": "integer"}, "iterations": {"type": "integer", "minimum": 0},
                           "steps_per_s": {"type": "number", "minimum": 0}, "wait_ms": {"type": "number", "minimum": 0},
                           "slow_factor": {"type": "number", "minimum": 1}, "alive": {"type": "boolean"}}}},
        "layers": {"type": "array", "items": {
            "type": "object", "required": ["name", "server", "version", "window_workers", "mean_staleness", "window_ms"],
            "properties": {"name": {"type": "string"}, "server": {"type": "integer", "minimum": 0},
                           "version": {"type": "integer", "minimum": 0},
                           "window_workers": {"type": "integer", "minimum": 0},
                           "mean_staleness": {"type": "number", "minimum": 0},
                           "window_ms": {"type": "number", "minimum": 0},
                           # since the server (re)started (logs before they were added lack them)
                           "windows": {"type": "integer", "minimum": 0},
                           "gradients": {"type": "integer", "minimum": 0},
                           "staleness_sum": {"type": "number", "minimum": 0},
                           "staleness_max": {"type": "number", "minimum": 0},
                           "applied": {"type": "number", "minimum": 0}}}}},
}

# the steps between full rank rows: one column per figure, by rank (engine.protocol.rank_columns)
_COLUMN = {"type": "array", "minItems": 1, "items": {"type": "number", "minimum": 0}}
_UNITS = {"type": "array", "minItems": 1, "items": {"type": ["integer", "null"], "minimum": 0}}
PER_RANK = {
    "type": "object", "required": [*RANK_COLUMNS, "memory_unit", *MEMORY_COLUMNS], "additionalProperties": False,
    "properties": {"rank": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                   **{k: _COLUMN for k in RANK_COLUMNS + OPTIONAL_RANK_COLUMNS + PANEL_COLUMNS},
                   "memory_unit": {"type": "integer", "minimum": 1},
                   **{k: _UNITS for k in [*MEMORY_COLUMNS, *OPTIONAL_MEMORY_COLUMNS]}},
}

STAGE = {   # pipeline: one per stage, from every rank's timings (engine/strategies/pipeline/stage.py: stage_rows)
    "type": "object", "required": ["stage", "rank", "layers", "fwd_ms", "bwd_ms", "idle_ms"],
    "properties": {"stage": {"type": "integer", "minimum": 0}, "rank": {"type": "integer", "minimum": 0},
                   "layers": {"type": "array", "items": {"type": "string"}},
                   "fwd_ms": {"type": "number", "minimum": 0}, "bwd_ms": {"type": "number", "minimum": 0},
                   "idle_ms": {"type": "number", "minimum": 0},
                   # the micro-batches a step is cut into (parallel.pipeline.micro_batches); logs before 2026-11-25 lack it
                   "micro_batches": {"type": "integer", "minimum": 1}, "sent_bytes": _BYTES,
                   # stages x replicas: each replica's forward + backward ms, replica 0 first (the row is the slowest's)
                   "replicas_ms": {"type": "array", "items": {"type": "number", "minimum": 0}}},
}

STEP = {   # closed: a field no one declared here fails (the rank entries' figures: RANK_ENTRY)
    "type": "object", "additionalProperties": False,
    "required": ["schema", "time", "type", "step", "loss", "samples_per_s", "step_ms"],
    "oneOf": [{"required": ["ranks"]}, {"required": ["per_rank"]}],
    "properties": {**_COMMON, "type": {"const": "step"}, "step": {"type": "integer", "minimum": 1},
                   "loss": {"type": ["number", "null"]}, "samples_per_s": {"type": "number", "minimum": 0},
                   "step_ms": {"type": "number", "minimum": 0},
                   # where samples are sequences of token ids: tokens a second over the wall time between step
                   # records; mfu where the device's peak is known (engine/training/throughput.py)
                   "tokens_per_s": {"type": "number", "minimum": 0}, "mfu": {"type": "number", "minimum": 0},
                   "ranks": {"type": "array", "minItems": 1, "items": RANK_ENTRY}, "per_rank": PER_RANK,
                   "time_split": TIME_SPLIT, "streams": {"type": "array", "items": STREAM},
                   "layers": {"type": "array", "items": LAYER}, "ps": PS,
                   "stages": {"type": "array", "minItems": 1, "items": STAGE},
                   "imbalance_ms": {"type": "number", "minimum": 0}, "threshold_ms": {"type": "number", "minimum": 0},
                   "migrating": {"type": "boolean"},
                   # the optimizer's step (logs from before it was recorded lack them): the learning rate used,
                   # the global gradient norm before clipping (null when neither clipping nor skipping is on, or
                   # not finite), whether it was clipped or skipped, and the layers whose update was redone
                   "lr": {"type": "number", "minimum": 0}, "grad_norm": {"type": ["number", "null"], "minimum": 0},
                   "clipped": {"type": "boolean"}, "skipped": {"type": "boolean"},
                   "redone_layers": {"type": "integer", "minimum": 0}},
}

EVENT_KINDS = ["checkpoint", "restart", "resume", "eval", "memory_over_capacity", "stop", "command", "update_plan",
               "placement", "rebalance", "migration", "memory_plan", "policy", "sync_mode", "worker_lost",
               "resize", "ps_profile", "step_skipped", "step_rolled_back", "nonfinite", "checkpoint_skipped",
               "checkpoint_waited", "compile", "auto_fit", "plan_reverted"]
_FRACTION = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
_NUMBER_OR_NULL = {"type": ["number", "null"]}

EVENT = {
    "type": "object",
    "required": ["schema", "time", "type", "kind", "step"],
    "properties": {**_COMMON, "type": {"const": "event"}, "kind": {"enum": EVENT_KINDS},
                   "step": {"type": "integer", "minimum": 0}},
    "allOf": [
        {"if": {"properties": {"kind": {"const": "checkpoint"}}}, "then": {"required": ["path"]}},
        {"if": {"properties": {"kind": {"const": "restart"}}}, "then": {"required": ["restart", "max_restarts"]}},
        {"if": {"properties": {"kind": {"const": "resume"}}}, "then": {"required": ["checkpoint"]}},
        {"if": {"properties": {"kind": {"const": "eval"}}},   # engine/training/evaluation.py
         "then": {"required": ["test_accuracy", "val_loss", "perplexity"],
                  "properties": {"test_accuracy": _FRACTION, "val_loss": _NUMBER_OR_NULL, "perplexity": _NUMBER_OR_NULL}}},
        {"if": {"properties": {"kind": {"const": "memory_over_capacity"}}},
         "then": {"required": ["rank", "peak_bytes", "capacity_bytes"]}},
        {"if": {"properties": {"kind": {"const": "stop"}}}, "then": {"required": ["reason"]}},
        {"if": {"properties": {"kind": {"const": "update_plan"}}},
         "then": {"required": ["planner", "placement", "predicted_ms", "all_device_ms", "all_host_ms"]}},
        {"if": {"properties": {"kind": {"const": "placement"}}}, "then": {"required": ["layer", "placement"]}},
        {"if": {"properties": {"kind": {"const": "auto_fit"}}},
         "then": {"required": ["capacity_bytes", "memory", "placement"]}},
        {"if": {"properties": {"kind": {"const": "plan_reverted"}}},
         "then": {"required": ["reason", "plan_ms", "replaced_ms", "placement"]}},
        {"if": {"properties": {"kind": {"const": "policy"}}}, "then": {"required": ["layer", "policy"]}},
        {"if": {"properties": {"kind": {"const": "memory_plan"}}},
         "then": {"required": ["planner", "ranks", "policies", "capacity_bytes", "host_link_gbps"]}},
        {"if": {"properties": {"kind": {"const": "rebalance"}}},
         "then": {"required": ["reason", "stages", "stage_ms", "predicted_ms", "threshold_ms", "layer_ms"]}},
        {"if": {"properties": {"kind": {"const": "migration"}}},
         "then": {"required": ["moves", "stages", "bytes", "duration_ms", "cutover_micro_batch"],
                  "properties": {"bytes": _BYTES, "duration_ms": {"type": "number", "minimum": 0}}}},
        {"if": {"properties": {"kind": {"const": "sync_mode"}}},
         "then": {"required": ["mode", "previous", "source"], "properties": {"mode": {"enum": list(SYNC_MODES)}}}},
        {"if": {"properties": {"kind": {"const": "worker_lost"}}}, "then": {"required": ["rank", "reason"]}},
        {"if": {"properties": {"kind": {"const": "resize"}}},
         "then": {"required": ["from_world_size", "world_size", "hosts", "max_hosts"],
                  "properties": {"from_world_size": {"type": "integer", "minimum": 1},
                                 "world_size": {"type": "integer", "minimum": 1},
                                 "hosts": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                 "max_hosts": {"type": "integer", "minimum": 1}}}},
        {"if": {"properties": {"kind": {"const": "ps_profile"}}}, "then": {"required": ["layers", "mode"]}},
        {"if": {"properties": {"kind": {"const": "step_skipped"}}},
         "then": {"required": ["grad_norm", "redone_layers"],
                  "properties": {"grad_norm": {"type": ["number", "null"], "minimum": 0},
                                 "redone_layers": {"type": "integer", "minimum": 0}}}},
        {"if": {"properties": {"kind": {"const": "step_rolled_back"}}},
         "then": {"required": ["grad_norm", "clip", "redone_layers"],
                  "properties": {"grad_norm": {"type": "number", "minimum": 0},
                                 "clip": {"type": "number", "exclusiveMinimum": 0},
                                 "redone_layers": {"type": "integer", "minimum": 0}}}},
        {"if": {"properties": {"kind": {"const": "compile"}}},
         "then": {"required": ["compile_s", "compile_s_per_rank", "total_s", "recompiles"],
                  "properties": {"compile_s": {"type": "number", "minimum": 0},
                                 "recompiles": {"type": "integer", "minimum": 0}}}},
        {"if": {"properties": {"kind": {"const": "nonfinite"}}},
         "then": {"required": ["what", "value"], "properties": {"value": {"enum": ["nan", "inf", "-inf"]}}}},
        {"if": {"properties": {"kind": {"const": "command"}}},
         "then": {"required": ["name", "args", "status"],
                  "properties": {"status": {"enum": ["applied", "rejected"]}}}},
    ],
}

SUMMARY = {
    "type": "object",
    "required": ["schema", "time", "type", "name", "final_loss", "test_accuracy", "steps", "wall_s",
                 "peak_bytes_per_rank", "capacity_bytes", "simulated", "restarts", "stopped_early"],
    "properties": {**_COMMON, "type": {"const": "summary"}, "name": {"type": "string"},
                   "final_loss": {"type": ["number", "null"]},
                   "test_accuracy": _FRACTION, "val_loss": _NUMBER_OR_NULL, "perplexity": _NUMBER_OR_NULL,
                   "steps": {"type": "integer", "minimum": 0}, "wall_s": {"type": "number", "minimum": 0},
                   "peak_bytes_per_rank": {"type": "array", "items": _BYTES},
                   "allocator_peak_bytes_per_rank": {"type": "array", "items": _BYTES}, "capacity_bytes": _BYTES,
                   "simulated": {"type": "boolean"}, "restarts": {"type": "integer", "minimum": 0},
                   "stopped_early": {"type": "boolean"},
                   # the medians of the latest 10,000 steps, the first left out (engine/run/report.py Throughput)
                   "tokens_per_s": {"type": "number", "minimum": 0}, "mfu": {"type": "number", "minimum": 0}},
}

RECORD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["type"],
    "oneOf": [RUN_START, STEP, EVENT, SUMMARY],
}
