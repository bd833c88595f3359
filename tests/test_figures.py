"""Every per-rank figure is declared once (every run's in engine/telemetry/figures.py, a strategy's own in its
spec.py; engine/strategies/specs/figures.py lists them all), and the exchange's columns, a rank
entry's figures, its closed schema, docs/telemetry.md's table and the hello's `figures` (what a console's panels
show) follow from that; a figure reported but not declared stops the exchange. The live logs of every strategy
are validated in their own tests (validate_log)."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import protocol
from engine.config import config_from_dict
from engine.runtime.lifecycle import hello
from engine.runtime.control import COLUMN, FIELDS, GPU_FIELDS, UndeclaredFigure, rank_rows, row_values
from engine.strategies.specs import STRATEGIES
from engine.strategies.specs.figures import FIGURES, LOGGED, declared
from engine.telemetry import figures
from engine.telemetry.log import read_raw
from engine.telemetry.schema import RANK_ENTRY, RECORD_SCHEMA
from tests.conftest import ROOT, read_jsonl


def validate_log(path) -> list[dict]:
    """Every record of the log at `path`, as written and with each step's rows filled in, against the schema."""
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    records = read_jsonl(path)
    for record in read_raw(path) + records:
        validator.validate(record)
    return records


def test_every_figure_is_declared_once_with_a_known_unit_combine_and_place():
    every = [f for group in figures.COMMON.values() for f in group] + [f for s in STRATEGIES.values() for f in s.figures]
    assert list(FIGURES.values()) == every   # none declared twice (a clash stops the import)
    for f in FIGURES.values():
        assert f.unit in figures.UNITS and f.combine in figures.COMBINES and f.optional in figures.OPTIONAL, f
        assert set(f.shows) <= {figures.LOG, figures.DEVICES, figures.FLEET, figures.STAGES, figures.STREAMS}, f
        assert not f.shows or figures.LOG in f.shows, f   # a panel reads a figure from the log's rank entries
        assert f.exchanged or figures.LOG in f.shows, f
    assert FIELDS == tuple(f.name for f in FIGURES.values() if f.exchanged)
    assert COLUMN == {name: i for i, name in enumerate(FIELDS)}


def test_the_console_reads_the_gpu_figures_and_every_runs_declarations_from_the_protocol():
    """A strategy's own figures reach the console in the hello, never through engine.protocol (the console
    imports nothing of a strategy)."""
    assert protocol.GPU_FIELDS == GPU_FIELDS == ("allocated_bytes", "reserved_bytes", "allocator_peak_bytes",
                                                 "nvml_used_bytes", "nvml_total_bytes", "gpu_util_percent")
    assert protocol.FIGURES is figures.FIGURES and set(protocol.FIGURES) < set(FIGURES)
    assert protocol.every_run() == declared("a plugin's") and "reduce_ms" not in protocol.FIGURES


def test_a_strategys_declarations_are_every_runs_and_its_own_as_json():
    common = [f.name for group in figures.COMMON.values() for f in group if figures.LOG in f.shows]
    for name, spec in STRATEGIES.items():
        said = declared(name)
        assert json.loads(json.dumps(said)) == said
        own = [f.name for f in spec.figures if figures.LOG in f.shows]
        assert [d["name"] for d in said] == common + own   # the exchange's own (stop, flops) in no record
    assert [d["name"] for d in declared("a plugin's")] == common   # a strategy with no figures of its own

    def shown(strategy, panel):
        return [d["name"] for d in declared(strategy) if panel in d["shows"]]
    assert shown("sharded", protocol.STREAMS) == ["reduce_ms", "reduce_span_ms", "broadcast_wait_ms",
                                                  "broadcast_span_ms"]
    assert shown("pipeline", protocol.STAGES) == ["recv_wait_ms"]
    assert not any(shown(name, panel) for name in ("ddp", "param_server") for panel in ("streams", "stages"))
    assert next(d for d in declared("pipeline") if d["name"] == "recv_wait_ms") == {
        "name": "recv_wait_ms", "unit": "ms", "combine": "max", "shows": ["log", "stages"], "optional": "absent",
        "label": "recv wait"}


def test_the_hello_carries_its_strategys_declarations():
    for strategy in ("sharded", "pipeline"):
        cfg = config_from_dict({"parallel": {"strategy": strategy, "world_size": 2}})
        said = hello(cfg, SimpleNamespace(world_size=2, backend="gloo", hosts=lambda: [0, 0]),
                     SimpleNamespace(name="cpu", simulated=True, rank_names=None, note=""), ["fc0"], {}, [], [])
        assert said["figures"] == declared(strategy)
        json.dumps(said)


def test_combine_reads_the_ranks_values_as_one_as_declared():
    assert protocol.combine("max", [0.5, None, 1.25]) == 1.25   # a non-finite figure is null: left out
    assert (protocol.combine("min", [3, 1]), protocol.combine("sum", [3, 1]), protocol.combine("mean", [3, 1]),
            protocol.combine("first", [None, 3, 1])) == (1, 4, 2.0, 3)
    assert protocol.combine("max", [False, True]) is True
    assert protocol.combine("none", ["worker", "server"]) is None and protocol.combine("max", []) is None
    assert protocol.combine("max", [None, "x"]) is None


def test_a_strategys_phases_are_declared():
    from engine.strategies.sharded.strategy import PHASES
    assert set(PHASES) <= set(FIELDS)


def test_a_figure_reported_but_not_declared_stops_the_exchange_naming_it():
    with pytest.raises(UndeclaredFigure, match="'bogus_ms'.*engine/telemetry/figures.py"):
        row_values({"loss": 1.0, "bogus_ms": 2.0})
    with pytest.raises(UndeclaredFigure, match="'role'"):   # declared, but written after the exchange
        row_values({"role": 1.0})
    row = row_values({"loss": 1.0, "kind": "cpu", "simulated": True})   # the device's words: not figures
    assert row[COLUMN["loss"]] == 1.0 and len(row) == len(FIELDS)
    assert all(math.isnan(row[COLUMN[k]]) for k in GPU_FIELDS)


def test_a_world_of_one_exchanges_its_own_row_as_the_table_and_reads_it_as_a_tensors_would_be():
    from types import SimpleNamespace
    from engine.runtime.control import Table, column, exchange, table_rows
    from engine.strategies.base import Strategy
    values = {"loss": 2.5, "step_ms": 10.123456, "used_bytes": 1000.0, "command_bytes": 40}
    table = exchange(SimpleNamespace(world_size=1), values)   # no peer, no process group: no collective
    assert type(table) is Table and table_rows(table) == [row_values(values)]
    tensor = torch.tensor([row_values(values)], dtype=torch.float64)   # what several ranks' all-gather makes
    assert rank_rows(table) == rank_rows(tensor) and column(table, "loss") == column(tensor, "loss") == [2.5]
    assert Strategy.step_loss(None, column(table, "loss")) == 2.5
    assert Strategy.step_loss(None, [2.0, 3.0, 4.5]) == 3.1666666666666665 == float(torch.tensor([2.0, 3.0, 4.5],
                                                                                            dtype=torch.float64).mean())


def _figure_value(name: str):
    """A value of figure `name` in a row, as ranks report them: absent (NaN) where it may be, 0 where that means
    absent, numbers whose rounding to 4 and then 2 decimals is a case of its own (0.00004999, 12.34565)."""
    numbers = [0.0, 1.0, 2.5, 0.00004999, 12.34565, 97.5, 1e9 + 0.5, float(2 ** 33)]
    if FIGURES[name].unit == "flag":
        numbers = [0.0, 1.0]
    if FIGURES[name].optional == "absent":
        numbers.append(math.nan)
    return st.sampled_from(numbers)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_steps_figures_read_a_column_at_a_time_equal_its_full_rows(data):
    """Rank 0's record reads a dozen figures of every rank a column at a time, and every rank's full row only on
    the steps that log it: the columns, the `per_rank` columns made of them, the peaks and a pipeline's stage
    rows equal those of the full rows."""
    from engine.runtime.control import Peaks, RankFigures, Table
    from engine.strategies.pipeline.grid import Grid
    from engine.strategies.pipeline.stage_times import stage_rows
    from engine.strategies.specs.figures import PANEL_COLUMNS
    stages, replicas = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    row = st.tuples(*(_figure_value(name) for name in FIELDS)).map(list)
    rows = data.draw(st.lists(row, min_size=stages * replicas, max_size=stages * replicas))
    full = rank_rows(Table(rows))
    for name in [*LOGGED, "rank", "compute_ms", "role"]:   # role: written after the exchange, in no column
        assert RankFigures(Table(rows)).column(name) == [entry.get(name) for entry in full], name
    lazy = RankFigures(Table(rows))
    assert lazy.row(len(rows) - 1) == full[-1]
    assert protocol.rank_columns(lazy, PANEL_COLUMNS) == protocol.rank_columns(full, PANEL_COLUMNS)
    assert lazy.rows() == full
    peaks = [Peaks(len(rows)), Peaks(len(rows))]
    peaks[0].note(full), peaks[1].note(RankFigures(Table(rows)))
    assert peaks[0].summary() == peaks[1].summary()
    st_ = SimpleNamespace(stage_layers=[[f"layer{i}"] for i in range(stages)], micro_batches=4,
                          grid=Grid.of(stages, stages * replicas, "stage"), rebalancer=SimpleNamespace(threshold=0.2),
                          migration=None)
    assert stage_rows(st_, RankFigures(Table(rows))) == stage_rows(st_, full)


def test_a_rank_entry_writes_each_figure_as_declared_and_hides_the_exchanges_own():
    cpu = {"loss": 2.5, "step_ms": 10.123456, "fwd_ms": 3.0, "bwd_ms": 5.0, "gate_ms": 1.0, "stop": 1.0,
           "command_bytes": 40, "plan_made": 1.0, "flops": 1e9, "ckpt_written": 3, "used_bytes": 1000.0,
           "over_capacity": 1.0, "swap_layers": 2.0, "reduce_ms": 0.5, "recv_wait_ms": 0.25, "compile_ms": 0.0}
    gpu = {**cpu, **dict.fromkeys(GPU_FIELDS, 7.0), "compile_ms": 12.0, "recompiles": 1.0}
    a, b = rank_rows(torch.tensor([row_values(cpu), row_values(gpu)], dtype=torch.float64))
    assert (a["rank"], a["loss"], a["step_ms"], a["used_bytes"]) == (0, 2.5, 10.1235, 1000)
    assert a["over_capacity"] is True
    assert type(a["used_bytes"]) is int and type(a["swap_layers"]) is int and a["compute_ms"] == 7.0
    assert (a["reduce_ms"], a["recv_wait_ms"]) == (0.5, 0.25)
    assert not {"stop", "command_bytes", "plan_made", "flops", "ckpt_written", "compile_ms", "recompiles",
                *GPU_FIELDS} & set(a)
    assert b["rank"] == 1 and {k: b[k] for k in GPU_FIELDS} == {**dict.fromkeys(GPU_FIELDS[:5], 7),
                                                               "gpu_util_percent": 7.0}
    assert (b["compile_ms"], b["recompiles"]) == (12.0, 1)
    assert set(a) <= set(LOGGED) and set(b) <= set(LOGGED)
    for entry in (a, b):
        jsonschema.validate(entry, RANK_ENTRY)


def test_the_rank_entry_is_closed_and_types_each_figure_by_its_unit():
    entry = rank_rows(torch.tensor([row_values({})], dtype=torch.float64))[0]
    jsonschema.validate({**entry, "role": "worker", "alive": True, "stale_steps": 2}, RANK_ENTRY)
    for bad in ({"bogus_ms": 1.0}, {"owned_bytes": 1.5}, {"over_capacity": 1}, {"role": "boss"},
                {"gpu_util_percent": 101.0}, {"reduce_ms": -1.0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**entry, **bad}, RANK_ENTRY)
    assert set(RANK_ENTRY["properties"]) == set(LOGGED) and RANK_ENTRY["additionalProperties"] is False


def rank_table_names() -> set[str]:
    """The figures docs/telemetry.md's table of rank entries names in its first column."""
    text = (ROOT / "docs" / "telemetry.md").read_text()
    table = text.split("`ranks` holds one entry per rank:", 1)[1].split("\n\n", 2)[1]
    return {name for line in table.splitlines()[2:] for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])}


def test_the_docs_table_names_every_logged_figure_and_nothing_else():
    names = rank_table_names()
    assert sorted(set(LOGGED) - names) == [], "declared but missing from docs/telemetry.md's rank table"
    assert sorted(names - set(LOGGED)) == [], "in docs/telemetry.md's rank table but not declared"


def test_the_cuda_fixture_feed_follows_the_closed_rank_entry():
    """tests/fixtures/gpu_feed.jsonl: the console's CUDA replay, every rank with the GPU's own figures."""
    records = validate_log(ROOT / "tests" / "fixtures" / "gpu_feed.jsonl")
    ranks = [e for rec in records if rec["type"] == "step" for e in rec["ranks"]]
    assert ranks and all(set(GPU_FIELDS) <= set(e) for e in ranks)
