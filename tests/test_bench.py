"""Benchmarks run and report every figure (their numbers are not asserted: speed is not a test)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(180)
def test_bench_telemetry_reports_ratios_as_json(cli):
    r = cli.run("bench", "telemetry", "--json", "--rounds", "1", "--steps", "150", "--warmup", "20", timeout=170)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report["ratio_to_no_client"]) == {"0", "1", "10"}
    assert report["ratio_to_no_client"]["0"] == 1.0
    # every attached console received messages
    assert all(count > 0 for count in report["messages_per_client"]["10"][0])
    assert len(report["messages_per_client"]["10"][0]) == 10
