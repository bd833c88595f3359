"""Benchmarks run and report every figure (their numbers are not asserted: speed is not a test)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(180)
@pytest.mark.slow   # 45 s; `trainyard bench telemetry` itself is what it runs
def test_bench_telemetry_reports_ratios_as_json(cli):
    r = cli.run("bench", "telemetry", "--json", "--rounds", "1", "--steps", "400", "--warmup", "20", timeout=170)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report["ratio_to_no_client"]) == {"0", "1", "10"}
    assert report["ratio_to_no_client"]["0"] == 1.0
    # every attached console received messages
    assert all(count > 0 for count in report["messages_per_client"]["10"][0])
    assert len(report["messages_per_client"]["10"][0]) == 10


@pytest.mark.timeout(120)
def test_bench_broadcast_reports_every_variant_and_figure(cli):
    r = cli.run("bench", "broadcast", "--json", "--world", "2", "--streams", "2", "--slices", "4", "--rounds", "1",
                "--steps", "2", "--warmup", "1", "--hidden", "32", "--depth", "4", "--features", "32", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert [v["variant"] for v in report["variants"]] == ["ddp", "sharded-1", "sharded-2", "sharded-2-gated"]
    ddp, *sharded = report["variants"]
    assert ddp["ratio_to_ddp"] == 1.0 and ddp["state_fraction_of_ddp"] == 1.0
    for row in sharded:   # the owners split the optimizer state: 4 equal layers over 2 ranks
        assert 0.4 <= row["state_fraction_of_ddp"] <= 0.6 and row["step_ms"] > 0
    assert sharded[2]["broadcast_wait_ms"] == 0.0 and sharded[1]["broadcast_wait_ms"] > 0
    for figure in ("overlap_efficiency", "t_broadcast_ms", "t_forward_ms", "meets_goals", "parameters"):
        assert figure in report


def test_bench_broadcast_refuses_fewer_slices_than_streams(cli):
    r = cli.run("bench", "broadcast", "--streams", "4", "--slices", "2", timeout=30)
    assert r.returncode == 2 and "--slices must be >= --streams" in r.stderr


@pytest.mark.timeout(120)
def test_bench_hybrid_reports_every_placement_at_both_capacities(cli):
    r = cli.run("bench", "hybrid", "--json", "--rounds", "1", "--steps", "2", "--warmup", "1", "--trial", "4",
                "--hidden", "32", "--depth", "3", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["layers_with_updates"] == 4 and set(report["cases"]) == {"tight", "roomy"}
    tight, roomy = report["cases"]["tight"]["placements"], report["cases"]["roomy"]["placements"]
    assert not tight["all-device"]["fits"] and tight["all-device"]["measured_ms"] is None   # reported infeasible
    assert all(row["fits"] for row in roomy.values())
    for rows in (tight, roomy):   # the exact plan is the brute-force optimum of the cost model
        assert rows["auto-global"]["modelled_ms"] == rows["brute-force"]["modelled_ms"]
        assert rows["all-host"]["ratio_to_all_host"] == 1.0 and rows["auto-local"]["measured_ms"] > 0
    host = report["host_step"]   # the host step before (foreach, one thread) beside now, measured alike
    assert host["before_foreach_1_thread_ms"] > 0 and host["now_fused_ms"] == roomy["all-host"]["measured_ms"]
    before, now = host["before_foreach_1_thread_ms"], host["now_fused_ms"]
    # both times are reported to 0.01 ms and the speedup (of the unrounded times) to 0.001: on a small model
    # a few ms long, the rounding alone moves the ratio of the reported times by a few thousandths
    assert host["speedup"] == pytest.approx(before / now, rel=0.005 / before + 0.005 / now + 1e-3)
    assert host["host_updates_alone_before_ms"] > 0 and host["host_updates_alone_now_ms"] > 0 and host["now_threads"] >= 1


@pytest.mark.timeout(240)
@pytest.mark.slow   # two parameter-server runs of 6 processes
def test_bench_ps_reports_time_to_target_and_accuracy_per_mode(cli):
    r = cli.run("bench", "ps", "--json", "--seconds", "4", "--modes", "bsp,soft", "--eval-every", "2", timeout=230)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert list(report["modes"]) == ["bsp", "soft"] and report["slow_worker"] == {"rank": 5, "factor": 3.0}
    bsp, soft = report["modes"]["bsp"], report["modes"]["soft"]
    assert bsp["time_vs_bsp"] in (1.0, None) and bsp["accuracy_minus_bsp"] == 0.0
    for row in (bsp, soft):
        assert 0 <= row["final_accuracy"] <= 1 and row["steps"] > 0 and row["evals"]
        assert set(row["iterations"]) == {"2", "3", "4", "5"}


@pytest.mark.timeout(120)
def test_bench_memory_reports_every_variant_beside_torchs_own(cli):
    r = cli.run("bench", "memory", "--json", "--rounds", "1", "--steps", "1", "--d-model", "32", "--depth", "1",
                "--seq-len", "16", "--batch", "8", "--device", "cpu", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    variants = report["variants"]
    assert set(variants) == {"keep", "recompute", "swap", "auto-ratio", "auto-reverse", "auto-exhaustive",
                             "torch-checkpoint", "torch-save-on-cpu"}
    assert report["device"] == "cpu" and variants["recompute"]["vs_recompute"] == 1.0
    assert variants["swap"]["swapped_per_step_bytes"] > 0 and variants["keep"]["swapped_per_step_bytes"] == 0
    for name in ("torch-checkpoint", "torch-save-on-cpu"):   # the ledger cannot see inside torch's own hooks
        assert variants[name]["peak_bytes"] is None and variants[name]["fits"] is None
        assert variants[name]["samples_per_s"] > 0
    assert all(row["allocator_peak_bytes"] is None for row in variants.values())   # no GPU here
