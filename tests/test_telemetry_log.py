"""Every record a run writes validates against the documented schema; full rank rows every
`telemetry.rank_every` steps and `per_rank` columns between; a log that rotates by size and is read whole."""

from __future__ import annotations

import errno
import json
import math
import os

import jsonschema
import pytest

from engine import protocol
from engine.telemetry.log import LogWriteError, TelemetryLog, fill_ranks, read_log, read_raw
from engine.telemetry.outlets import RankRows
from engine.telemetry.schema import RECORD_SCHEMA
from tests.conftest import ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


@pytest.mark.timeout(90)
def test_a_runs_records_follow_the_schema(cli):
    log = cli.tmp_path / "run.jsonl"
    # a tiny capacity, so the over-capacity event is written too
    r = cli.run("run", DEMO, "--headless", "--steps", "12", *cli.base_args("schema"), "--set",
                "checkpoint.every=5", "--set", "run.eval_every=6", "--set", "device.memory=100KiB",
                "--set", "telemetry.rank_every=4", "--set", "telemetry.layer_every=0", "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    raw = read_raw(log)
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in raw + read_jsonl(log):   # as written, and each step's rows filled in
        validator.validate(record)
    # full rows on the first step and every 4 (the over-capacity event is step 1's, written before it); columns between
    full = [r["step"] for r in raw if r["type"] == "step" and "ranks" in r]
    assert full == [1, 5, 9]
    records = read_jsonl(log)
    for record in (r for r in records if r["type"] == "step"):   # every step: each rank's time and memory
        assert [e["rank"] for e in record["ranks"]] == [0, 1]
        assert all({"step_ms", "compute_ms", "wait_ms", "used_bytes", "peak_bytes", "capacity_bytes"} <= set(e)
                   for e in record["ranks"])
    kinds = [r.get("kind") for r in records if r["type"] == "event"]
    assert {"checkpoint", "eval", "memory_over_capacity"} <= set(kinds)
    assert records[0]["type"] == "run_start" and records[-1]["type"] == "summary"
    assert {"devices", "device_note"} <= set(records[0])   # the schema lets logs from before them replay
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 13))
    assert "warning" in r.stdout and "over its device capacity" in r.stdout


@pytest.mark.parametrize("feed", sorted(p.name for p in (ROOT / "tests" / "fixtures").glob("*.jsonl")))
def test_every_fixture_feed_follows_the_schema_the_engine_writes(feed):
    """The console's tests replay these: a fixture that drifted from the engine's records (a stage row's
    `micro_batches_in_flight`, which no engine sent) would test a console no run feeds."""
    path = ROOT / "tests" / "fixtures" / feed
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in read_raw(path) + read_jsonl(path):
        validator.validate(record)
    stages = [s for r in read_jsonl(path) if r["type"] == "step" for s in r.get("stages", [])]
    assert all(set(s) <= set(RECORD_SCHEMA["oneOf"][1]["properties"]["stages"]["items"]["properties"]) for s in stages)


def test_the_schema_rejects_a_step_record_without_loss():
    record = {"schema": 1, "time": 0.0, "type": "step", "step": 1, "samples_per_s": 1.0, "step_ms": 1.0,
              "ranks": []}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, RECORD_SCHEMA)


FULL = [{"rank": r, "step_ms": 10.0 + r, "fwd_ms": 3.0, "bwd_ms": 6.0, "compute_ms": 9.0, "wait_ms": 0.5,
         "used_bytes": 100 + r, "peak_bytes": 200 + r, "capacity_bytes": 1000, "rss_bytes": 5} for r in range(3)]


def test_columns_overlay_the_last_full_rows_and_a_missing_rank_goes_stale():
    columns = protocol.rank_columns([{**e, "step_ms": 20.0, "used_bytes": 150} for e in FULL])
    assert columns == {"step_ms": [20.0] * 3, "compute_ms": [9.0] * 3, "wait_ms": [0.5] * 3, "memory_unit": 1,
                       "used": [150] * 3, "peak": [200, 201, 202]}
    first = {"step": 1, "ranks": FULL}
    second = protocol.with_ranks({"step": 2, "per_rank": columns}, first)
    assert [e["used_bytes"] for e in second["ranks"]] == [150] * 3
    assert all(e["capacity_bytes"] == 1000 and e["rss_bytes"] == 5 and e["stale_steps"] == 0 for e in second["ranks"])
    # rank 1 left out for two steps (a gap): its older figures stay, counted stale
    gap = {"step": 4, "per_rank": {"rank": [0, 2], **{k: v if k == "memory_unit" else [v[0], v[2]]
                                                 for k, v in columns.items()}}}
    third = protocol.with_ranks(gap, second)
    assert [e["stale_steps"] for e in third["ranks"]] == [0, 2, 0]
    assert third["ranks"][1]["used_bytes"] == 150


def test_the_panels_figures_are_columns_every_step_where_the_ranks_report_them():
    """A stage's receive wait and sharded's waits are what the stages and streams panels show: columns on the
    steps between full rows (a wait back to 0 too), in no column where no rank reports them (ddp's rows). The
    writer names them (the strategies' declarations); a reader overlays whatever columns come."""
    from engine.strategies.specs.figures import PANEL_COLUMNS
    assert {"recv_wait_ms", "reduce_ms", "broadcast_wait_ms"} <= set(PANEL_COLUMNS)
    assert not {"recv_wait_ms", "reduce_ms"} & set(protocol.rank_columns(FULL, PANEL_COLUMNS))
    stages = [{**e, "recv_wait_ms": 4.0 if e["rank"] else 0.0} for e in FULL]
    columns = protocol.rank_columns(stages, PANEL_COLUMNS)
    assert columns["recv_wait_ms"] == [0.0, 4.0, 4.0]
    later = protocol.rank_columns([{**e, "recv_wait_ms": 0.0} for e in stages], PANEL_COLUMNS)
    jsonschema.validate({"schema": 1, "time": 0.0, "type": "step", "step": 2, "loss": 1.0, "samples_per_s": 1.0,
                         "step_ms": 10.0, "per_rank": later}, RECORD_SCHEMA)
    rows = protocol.expand_ranks({"step": 2, "per_rank": later}, {"step": 1, "ranks": stages})
    assert [e["recv_wait_ms"] for e in rows] == [0.0, 0.0, 0.0]


def test_memory_columns_count_units_of_the_capacity_and_the_peak_rounds_up():
    gib, mib = 1 << 30, 1 << 20
    rows = [{"rank": 0, "step_ms": 1.0, "compute_ms": 1.0, "wait_ms": 0.0, "used_bytes": 33 * gib + 3,
             "peak_bytes": 40 * gib + 1, "capacity_bytes": 80 * gib, "nvml_used_bytes": 78 * gib}]
    columns = protocol.rank_columns(rows)
    assert columns["memory_unit"] == mib   # 80 GiB / 65536 = 1.25 MiB: the power of two below
    assert columns["used"] == [33 * 1024] and columns["peak"] == [40 * 1024 + 1] and columns["nvml_used"] == [78 * 1024]
    back = protocol.expand_ranks({"step": 2, "per_rank": columns}, {"step": 1, "ranks": rows})[0]
    assert back["used_bytes"] == 33 * gib and back["peak_bytes"] == 40 * gib + mib >= rows[0]["peak_bytes"]
    assert back["nvml_used_bytes"] == 78 * gib and back["capacity_bytes"] == 80 * gib
    assert protocol.memory_unit([{"capacity_bytes": 100 << 10}]) == 1   # a tiny CPU capacity: exact bytes


def test_full_rows_every_n_steps_and_after_a_change():
    rows = RankRows(every=5)
    shaped = []
    for step in range(1, 13):
        if step == 8:
            rows.noted("policy")      # an operator's set-policy: the next step shows it in full
        rows.noted("checkpoint")      # changes nothing in the rows
        record, full = rows.shape({"step": step, "ranks": FULL})
        shaped.append(full)
        assert ("ranks" in record) == full and ("per_rank" in record) != full
    assert [s for s, full in enumerate(shaped, 1) if full] == [1, 6, 8]


def test_the_log_rotates_by_size_and_is_read_whole(tmp_path):
    path = tmp_path / "run.jsonl"
    log = TelemetryLog(path, max_bytes=2000)
    rows = RankRows(every=10)
    log.write({"type": "run_start", "name": "r"})
    for step in range(1, 41):
        record, _ = rows.shape({"step": step, "loss": 1.0, "ranks": FULL})
        log.write({"type": "step", **record})
    log.close()
    parts = protocol.log_parts(path)
    assert parts[0] == path and [p.name for p in parts[1:3]] == ["run.1.jsonl", "run.2.jsonl"]
    assert all(p.stat().st_size <= 2000 for p in parts)
    records = read_log(path)
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 41))
    assert all(r["ranks"][2]["capacity_bytes"] == 1000 for r in records if r["type"] == "step")
    # a restarted run appends to the newest part
    TelemetryLog(path, max_bytes=2000).write({"type": "event", "kind": "restart", "step": 40})
    assert read_raw(parts[-1])[-1]["kind"] == "restart" and len(protocol.log_parts(path)) == len(parts)
    assert fill_ranks(read_raw(path)) == read_log(path)


def test_a_64_rank_feed_logs_under_4_kb_a_step_and_replays_with_every_ranks_figures(tmp_path):
    """The synthetic 64-GPU, 200-layer feed of `trainyard bench telemetry --bytes`, written through the engine's
    RankRows and TelemetryLog; the console's state, fed the log as a replay would, has each step's 64 rows."""
    from console.client import replay_messages
    from console.state import RunState
    from engine.bench.telemetry import LOG_GOAL_BYTES, synthetic_bytes
    sizes = synthetic_bytes(64, 200, 300, layer_every=10, rank_every=100, work=tmp_path)
    assert sizes["log_bytes_per_step"] <= LOG_GOAL_BYTES and sizes["full_rows_records"] == 3
    state = RunState()
    for msg in replay_messages(read_raw(tmp_path / "synthetic64.jsonl")):
        state.apply(msg)
        ranks = state.last_step["ranks"]
        assert len(ranks) == 64 and all({"used_bytes", "peak_bytes", "capacity_bytes", "step_ms", "wait_ms",
                                          "compute_ms", "nvml_used_bytes"} <= set(e) for e in ranks)
        assert ranks[41]["nvml_used_bytes"] / ranks[41]["nvml_total_bytes"] >= 0.98 - 1e-4
    assert state.step == 300


def test_a_parameter_servers_workers_and_layers_go_as_columns_between_full_steps():
    workers = [{"rank": r, "iterations": 10 + r, "steps_per_s": 5.0, "wait_ms": 1.0, "compute_ms": 3.0,
                "slow_factor": 1.0 + r, "alive": True} for r in (2, 3)]
    layers = [{"name": f"fc{j}", "server": j % 2, "version": 7, "window_workers": 2, "mean_staleness": 0.5,
               "window_ms": 4.0} for j in range(3)]
    ps = {"mode": "soft", "workers_live": 2, "workers_lost": [], "workers": workers, "layers": layers}
    rows = RankRows(every=10)
    first, _ = rows.shape({"step": 1, "loss": 1.0, "ranks": FULL, "ps": ps})
    later = {**ps, "workers": [{**w, "iterations": 20, "alive": w["rank"] == 2} for w in workers],
             "layers": [{**layer, "version": 9} for layer in layers]}
    second, full = rows.shape({"step": 2, "loss": 1.0, "ranks": FULL, "ps": later})
    assert not full and "workers" not in second["ps"] and second["ps"]["worker_columns"]["iterations"] == [20, 20]
    from engine.telemetry.schema import PS
    for record in (first, second):
        jsonschema.validate(record["ps"], PS)
    filled = protocol.with_ranks(second, protocol.with_ranks(first, None))["ps"]
    assert filled == later   # the names, servers and slowness from the full step, the figures from the columns


class FullDisk:
    """A log's file on a disk with `room` bytes left: a short write, then ENOSPC, as the kernel does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        taken = self.file.write(bytes(data[:self.room]))
        self.room -= taken
        return taken

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_leaves_whole_lines_and_says_where_and_how_far(tmp_path, monkeypatch, capsys):
    import shutil
    from types import SimpleNamespace
    from engine.runtime.disk import disk_words
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=100, used=100, free=0))
    path = tmp_path / "telemetry.jsonl"
    log = TelemetryLog(path)
    log.write({"type": "run_start", "name": "r"})
    for step in range(1, 42):
        log.write({"type": "step", "step": step, "loss": 1.0})
    log.write({"type": "event", "kind": "checkpoint", "step": 41, "path": "x"})
    whole = path.read_bytes()
    log._file = FullDisk(log._file, room=20)   # half of the next record fits
    with pytest.raises(LogWriteError) as failed:
        log.write({"type": "step", "step": 42, "loss": 1.0})
    assert not isinstance(failed.value, OSError)
    assert str(failed.value) == (f"the telemetry log {path} could not be written: [Errno 28] No space left on "
                                 f"device ({disk_words(tmp_path)}); the log is whole up to step 41")
    assert "has 0 B free of 100 B" in disk_words(tmp_path)
    assert path.read_bytes() == whole   # cut back to its last whole line
    with pytest.raises(LogWriteError):  # and it writes no more
        log.write({"type": "summary"})
    log.close()
    assert [r["step"] for r in read_raw(path) if r["type"] == "step"] == list(range(1, 42))
    assert capsys.readouterr().err == ""   # nothing skipped: every line is whole


def test_a_full_disk_at_a_new_part_and_before_any_step(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    log = TelemetryLog(path, max_bytes=100)
    log.write({"type": "run_start", "name": "r", "pad": "x" * 60})
    def no_room(self):   # not even for the next part's file
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(TelemetryLog, "_open", no_room)
    with pytest.raises(LogWriteError, match=r"run\.1\.jsonl could not be written: \[Errno 122\] Disk quota "
                                            r"exceeded \(its disk \(.* free of .*\); the log is whole with no step "
                                            r"record yet"):
        log.write({"type": "step", "step": 1, "loss": 1.0, "pad": "x" * 60})
    log.close()


def test_rank_zeros_telemetry_stops_on_a_full_disk_and_closes_quietly(tmp_path):
    tel = rank_zero(tmp_path)
    tel.step(step_record(1))
    tel.log._file = FullDisk(tel.log._file, room=0)
    with pytest.raises(LogWriteError, match="whole up to step 1"):
        tel.step(step_record(2))
    with pytest.raises(LogWriteError):   # a failure met on the hub's thread stops the next step too
        tel.step(step_record(3))
    tel.event("stop", 2, reason="failed")   # consoles alone hear what follows: no second failure
    tel.summary({"name": "r", "steps": 1})
    tel.close("run failed (LogWriteError: ...)")
    assert [r["step"] for r in read_raw(tmp_path / "t.jsonl")] == [1]


def rank_zero(tmp_path):
    from engine.config import config_from_dict
    from engine.run.rank import Job
    from engine.telemetry.outlets import RankZeroTelemetry
    job = Job(config=config_from_dict({"telemetry": {"hub": False}}), telemetry_log=tmp_path / "t.jsonl",
              headless=False)
    return RankZeroTelemetry(job, {"mode": "ddp", "layers": [], "capabilities": []}, 0)


def step_record(step: int, loss: float = 1.0) -> dict:
    rows = [{**row, "loss": loss, "optim_ms": 1.0, "over_capacity": False, "cpu_percent": 1.0,
             **dict.fromkeys(("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes",
                              "swapped_bytes"), 0)} for row in FULL]
    return {"step": step, "loss": loss, "samples_per_s": 10.0, "step_ms": 1.0, "ranks": rows}


def strict_loads(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_figures_are_written_null_and_named():
    record = {"type": "step", "step": 3, "loss": math.nan, "ok": 1.5,
              "ranks": [{"rank": 0, "step_ms": 1.0}, {"rank": 1, "step_ms": math.inf}],
              "ps": {"layers": [{"window_ms": {"2": -math.inf}}]}, "t": (1.0, math.nan)}
    out = strict_loads(protocol.strict_json(record))
    assert out["loss"] is None and out["ranks"][1]["step_ms"] is None
    assert out["ps"]["layers"][0]["window_ms"]["2"] is None
    assert out["ok"] == 1.5 and out["ranks"][0] == {"rank": 0, "step_ms": 1.0} and out["t"] == [1.0, None]
    assert out["nonfinite"] == ["loss", "ranks.1.step_ms", "ps.layers.0.window_ms.2", "t.1"]
    assert record["loss"] != record["loss"] and record["ranks"][1]["step_ms"] == math.inf   # the caller's is untouched
    finite = {"type": "step", "loss": 1.0, "ranks": [{"rank": 0}]}
    assert protocol.finite_record(finite) is finite and "nonfinite" not in strict_loads(protocol.strict_json(finite))
    many = protocol.finite_record({"x": [math.nan] * 20})
    assert many["nonfinite"] == [f"x.{i}" for i in range(16)] + ["+4 more"]
    assert strict_loads(protocol.encode({"type": "step", "loss": math.inf}))["nonfinite"] == ["loss"]


def test_a_line_is_what_json_dumps_writes_and_a_failed_line_leaves_the_encoder_whole():
    """strict_json's encoder is made once (engine/telemetry/protocol.py): the same text as json.dumps for strings
    that need escaping, nested containers, big and negative numbers; an unencodable value raises as json.dumps
    does, and the next line is whole."""
    record = {"type": "event", "text": "é\u2028\"q\"\\ \x00", "n": [1, 2.5, -0.0, 1e300, 12345678901234567890,
              None, True, False], "d": {"e": {}, "f": [[]], "7": (1, 2)}}
    assert protocol.strict_json(record) == json.dumps(record, separators=(",", ":"), allow_nan=False)
    with pytest.raises(TypeError, match="not JSON serializable"):
        protocol.strict_json({"x": [{"y": object()}]})
    assert protocol.strict_json({"x": [{"y": 1}]}) == '{"x":[{"y":1}]}'
    assert protocol.strict_json({"x": math.nan, "y": [1]}) == '{"x":null,"y":[1],"nonfinite":["x"]}'


def test_a_nan_loss_is_said_once_as_an_event_and_every_such_step_is_flagged(tmp_path):
    tel = rank_zero(tmp_path)
    notes = []
    tel.note = notes.append
    tel.step(step_record(1))
    tel.step(step_record(2, math.nan))
    tel.step(step_record(3, math.inf))
    tel.step(step_record(4))
    tel.close("run finished")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    records = [strict_loads(line) for line in lines]
    # step 1 has every rank's full row, the rest the columns (no loss in them)
    assert [(r["type"], r.get("step")) for r in records] == [("step", 1), ("event", 2), ("step", 2), ("step", 3),
                                                             ("step", 4)]
    assert {k: records[1][k] for k in ("kind", "step", "what", "value")} == {"kind": "nonfinite", "step": 2,
                                                                            "what": "loss", "value": "nan"}
    assert [(r["loss"], r.get("nonfinite")) for r in records[2:]] == [(None, ["loss"]), (None, ["loss"]), (1.0, None)]
    assert len(notes) == 1 and "step 2" in notes[0] and "nan" in notes[0]
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in records:
        validator.validate(record)


def test_readers_skip_a_cut_last_line_and_a_bad_middle_line_and_say_so(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    good = [json.dumps({"type": "step", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text(f"{good[0]}\n{{\"type\": \"st\n{good[1]}\n[1, 2]\n{good[2]}\n" + good[2][:17])
    assert [r["step"] for r in read_raw(path)] == [1, 2, 3]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"trainyard: {path}: skipped line 2: not JSON (Invalid control character at)",
                   f"trainyard: {path}: skipped line 4: not a JSON object",
                   f"trainyard: {path}: skipped an incomplete last line (17 bytes): the writer stopped mid-record"]
    path.write_bytes(good[0].encode() + b"\n" + "{\"note\": \"é\"}".encode()[:-3])   # cut inside a character
    assert len(read_raw(path)) == 1 and "incomplete last line (11 bytes)" in capsys.readouterr().err
    path.write_text(good[0])   # whole JSON, only the newline missing: kept
    assert len(read_raw(path)) == 1 and capsys.readouterr().err == ""
