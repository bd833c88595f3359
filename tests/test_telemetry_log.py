"""Every record a run writes validates against the documented schema."""

from __future__ import annotations

import jsonschema
import pytest

from engine.telemetry.schema import RECORD_SCHEMA
from tests.conftest import ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


@pytest.mark.timeout(90)
def test_a_runs_records_follow_the_schema(cli):
    log = cli.tmp_path / "run.jsonl"
    # a tiny capacity, so the over-capacity event is written too
    r = cli.run("run", DEMO, "--headless", "--steps", "12", *cli.base_args("schema"), "--set",
                "checkpoint.every=5", "--set", "run.eval_every=6", "--set", "device.memory=100KiB",
                "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in records:
        validator.validate(record)
    kinds = [r.get("kind") for r in records if r["type"] == "event"]
    assert {"checkpoint", "eval", "memory_over_capacity"} <= set(kinds)
    assert records[0]["type"] == "run_start" and records[-1]["type"] == "summary"
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 13))
    assert "warning" in r.stdout and "over its device capacity" in r.stdout


def test_the_schema_rejects_a_step_record_without_loss():
    record = {"schema": 1, "time": 0.0, "type": "step", "step": 1, "samples_per_s": 1.0, "step_ms": 1.0,
              "ranks": []}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, RECORD_SCHEMA)
