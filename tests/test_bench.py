"""Benchmarks run and report every figure (their numbers are not asserted: speed is not a test)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess

import psutil
import pytest
import torch


@pytest.mark.timeout(180)
@pytest.mark.slow   # 45 s; `trainyard bench telemetry` itself is what it runs
def test_bench_telemetry_reports_ratios_as_json(cli):
    r = cli.run("bench", "telemetry", "--json", "--rounds", "1", "--steps", "200", "--warmup", "20", timeout=170)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report["ratio_to_no_client"]) == {"0", "1", "10"}
    assert report["ratio_to_no_client"]["0"] == 1.0
    # every attached console received messages
    assert all(count > 0 for count in report["messages_per_client"]["10"][0])
    assert len(report["messages_per_client"]["10"][0]) == 10


@pytest.mark.timeout(120)
def test_bench_telemetry_record_times_both_reads_of_the_same_figures(cli):
    """`--record`: rank 0's work on a step's figures, from every rank's full row and a column at a time; the bench
    refuses to time them where the two give other columns."""
    r = cli.run("bench", "telemetry", "--record", "--json", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["bench"] == "telemetry-record" and [run["ranks"] for run in report["runs"]] == [1, 8, 64]
    assert all(run["full_rows_us"] > 0 and run["columns_us"] > 0 for run in report["runs"])


@pytest.mark.timeout(120)
def test_bench_broadcast_reports_every_variant_and_figure(cli):
    r = cli.run("bench", "broadcast", "--json", "--world", "2", "--streams", "2", "--slices", "4", "--rounds", "1",
                "--steps", "2", "--warmup", "1", "--hidden", "32", "--depth", "4", "--features", "32", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert [v["variant"] for v in report["variants"]] == ["ddp", "fsdp2-no-reshard", "fsdp2-reshard", "sharded-1",
                                                          "sharded-2", "sharded-2-gated"]
    ddp, *fsdp2, sharded = report["variants"][0], *report["variants"][1:3], report["variants"][3:]
    assert ddp["ratio_to_ddp"] == 1.0 and ddp["state_fraction_of_ddp"] == 1.0
    for row in fsdp2:   # torch's FSDP2 shards the optimizer state too
        assert 0.4 <= row["state_fraction_of_ddp"] <= 0.6 and row["step_ms"] > 0 and "communication_ms" not in row
    for row in sharded:   # the owners split the optimizer state: 4 equal layers over 2 ranks
        assert 0.4 <= row["state_fraction_of_ddp"] <= 0.6 and row["step_ms"] > 0
    assert sharded[2]["broadcast_wait_ms"] == 0.0 and sharded[1]["broadcast_wait_ms"] > 0
    # measured alike in every sharded variant: both spans, and the broadcast's hidden fraction in [0, 1]
    assert ddp["overlap_efficiency"] is None
    for row in sharded:
        assert row["reduce_span_ms"] > 0 and row["broadcast_span_ms"] > 0
        assert 0.0 <= row["overlap_efficiency"] <= 1.0
        assert row["communication_ms"] == pytest.approx(row["reduce_span_ms"] + row["broadcast_span_ms"], abs=0.02)
    assert report["best_gated"] == "sharded-2-gated" and report["goals"]["ratio_to_ddp_at_most"] == 1.0
    assert report["best_fsdp2"] in ("fsdp2-no-reshard", "fsdp2-reshard") and "below_fsdp2" in report["meets_goals"]
    for figure in ("meets_goals", "parameters"):
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
    r = cli.run("bench", "ps", "--json", "--seconds", "2", "--modes", "bsp,soft", "--eval-every", "2", timeout=230)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert list(report["modes"]) == ["bsp", "soft"] and report["slow_worker"] == {"rank": 5, "factor": 3.0}
    bsp, soft = report["modes"]["bsp"], report["modes"]["soft"]
    assert bsp["time_vs_bsp"] in (1.0, None) and bsp["accuracy_minus_bsp"] == 0.0
    for row in (bsp, soft):
        assert 0 <= row["final_accuracy"] <= 1 and row["steps"] > 0 and row["evals"]
        assert set(row["iterations"]) == {"2", "3", "4", "5"}


@pytest.mark.timeout(240)
@pytest.mark.slow   # two parameter-server runs of 5 processes
def test_bench_ps_repeat_reports_each_modes_distribution_over_the_same_seeds(cli):
    r = cli.run("bench", "ps", "--json", "--repeat", "1", "--steps", "12", "--servers", "1", "--modes",
                "bsp,soft:rounds", timeout=230)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["seeds"] == [0] and report["slow_worker"] == {"rank": 4, "factor": 3.0}
    assert list(report["modes"]) == list(report["runs"]) == ["bsp", "soft:rounds"]
    for mode, runs in report["runs"].items():
        (run,) = runs
        assert run["seed"] == 0 and run["steps"] == 12 and 0 <= run["final_accuracy"] <= 1
        assert report["modes"][mode]["final_accuracy"] == {"worst": run["final_accuracy"], "p10": run["final_accuracy"],
                                                           "median": run["final_accuracy"], "best": run["final_accuracy"]}
    (bsp,) = report["runs"]["bsp"]
    # every bsp update holds every worker's fresh gradient: one a step, a full step's worth each
    assert bsp["mean_staleness"] == bsp["max_staleness"] == 0 and bsp["applied_per_step"] == bsp["updates_per_step"]
    assert 0.9 <= bsp["updates_per_step"] <= 1.1
    bad = cli.run("bench", "ps", "--repeat", "1", "--modes", "soft:steps")
    assert bad.returncode == 2 and "--modes: soft:steps" in bad.stderr


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
    # what swapping waited for: nothing where nothing swaps
    assert variants["keep"]["host_wait_ms_per_step"] == variants["keep"]["stalls_per_step"] == 0
    assert variants["swap"]["host_wait_ms_per_step"] >= 0 and variants["swap"]["stalls_per_step"] >= 0
    for name in ("torch-checkpoint", "torch-save-on-cpu"):   # the ledger cannot see inside torch's own hooks
        assert variants[name]["peak_bytes"] is None and variants[name]["fits"] is None
        assert variants[name]["samples_per_s"] > 0
    assert all(row["allocator_peak_bytes"] is None for row in variants.values())   # no GPU here


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["interleaved", "turns"])
def test_bench_step_times_trainyard_beside_the_plain_loop_and_judges_the_goals(cli, mode):
    """`trainyard bench step`: the plain loop and `trainyard run` (keep/device, and auto/auto) at the host-bound
    size, in turns of a process each (a GPU's default) or interleaved, every process alive at once and timed in
    slices (the CPU's); every variant's figures, its ratio to the plain loop, the goals judged over the rounds,
    and no process left. In turns, auto/auto's turn is left out: a turn is a process more, and the interleaved
    round judges it."""
    variants = {"plain", "trainyard"} | ({"trainyard-auto"} if mode == "interleaved" else set())
    r = cli.run("bench", "step", "--json", "--size", "host", "--rounds", "1", "--steps", "6", "--mode", mode,
                "--cycles", "6", "--variants", ",".join(sorted(variants)) + ",trainyard-bf16w", timeout=170)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["left_out"] == {"trainyard-bf16w": "bf16 working weights need bf16 compute; this size computes "
                                                     "in fp32"}
    [host] = report["reports"]
    assert host["size"] == "host" and host["batch"] == 8 and host["seq_len"] == 64 and host["device"] == "cpu"
    assert host["interleaved"] == (mode == "interleaved") and host["failed"] == {}
    rows = {row["variant"]: row for row in host["variants"]}
    assert set(rows) == variants
    for name, row in rows.items():
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(8 * 64 / row["step_ms"] * 1000, rel=1e-3)
        assert "mfu" not in row and row["peak_bytes"] > 0   # no peak FLOP/s on the CPU
    if mode == "turns":   # a round's ratio: the two turns' medians
        want = rows["plain"]["step_ms"] / rows["trainyard"]["step_ms"]
    else:                 # the median over the round's cycles of the two slices' ratio
        [plain], [trainyard] = rows["plain"]["slices_ms"], rows["trainyard"]["slices_ms"]
        assert len(plain) == len(trainyard) == 6
        want = statistics.median(a / b for a, b in zip(plain, trainyard) if a and b)
    assert rows["trainyard"]["x_plain"] == pytest.approx(want, abs=1e-3)
    assert set(host["judged"]) == {"trainyard / plain"} | ({"trainyard-auto / trainyard"} if mode == "interleaved"
                                                           else set())
    assert all(j["verdict"] in ("met", "missed", "undecided") for j in host["judged"].values())
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if any("trainyard-bench-step-" in arg
                                                                  for arg in p.info["cmdline"] or ())]
    assert left == []   # no variant's process (a stopped one least of all) outlives the bench


@pytest.mark.timeout(120)
def test_the_compiled_plain_loop_compiles_a_graph_per_block_while_a_training_forward_builds_a_kv_cache(tmp_path):
    """bench step's compiled plain loop (`block.compile()` on each block) says how many graphs dynamo compiled: a
    Hugging Face causal LM builds a KV cache in a training forward unless `use_cache=False`, and each block's graph
    guards on its own layer of it, so each block compiles its own (the GPU size's 16 blocks pass dynamo's recompile
    limit of 8, and the rest run eager); `plain-compiled-nocache`'s blocks share one. Counted with dynamo's `eager`
    backend, which traces as inductor does and generates no code."""
    pytest.importorskip("transformers")
    from engine.bench.step import SIZES, command, write_inputs
    size = dict(SIZES["host"], config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=64),
                batch=2, seq_len=16)
    config = write_inputs(tmp_path, size, None)
    graphs = {}
    for variant in ("plain-compiled", "plain-compiled-nocache"):
        cmd, _ = command(variant, tmp_path, config, size, "cpu", 2, 0)
        assert ("--no-cache" in cmd) == variant.endswith("nocache") and "--compile" in cmd
        done = subprocess.run([*cmd, "--backend", "eager"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["blocks"] == 3 and out["recompile_limit"] == 8 and len(out["step_ms"]) == 2
        graphs[variant] = out["graphs"]
    assert graphs == {"plain-compiled": 3, "plain-compiled-nocache": 1}


@pytest.mark.parametrize("variant", ["trainyard", "trainyard-compiled", "trainyard-auto", "trainyard-bf16w"])
def test_bench_steps_trainyard_variants_with_the_plain_loops_own_optimizer(tmp_path, variant):
    """"The data, batch, precision and optimizer are the same in every variant": a trainyard variant's `[optim]`
    makes the plain loop's AdamW, every hyperparameter of it (the plain loop takes torch's defaults, and torch's
    AdamW decays weights by 0.01 where trainyard's config does not unless told)."""
    from engine.bench.step import SIZES, run_config, write_inputs
    from engine.bench.step_plain import plain_optimizer
    from engine.config import load_config
    from engine.training.optim import make_optimizer
    size = SIZES["gpu" if variant == "trainyard-bf16w" else "host"]   # bf16 working weights: with bf16 compute
    path = run_config(variant, tmp_path, write_inputs(tmp_path, size, None), size, "cpu", 10, 0)
    params = [torch.nn.Parameter(torch.zeros(3))]
    mine = make_optimizer(load_config(str(path)).optim, params)
    theirs = plain_optimizer(params)
    assert type(mine) is type(theirs)
    differ = {k: (mine.param_groups[0][k], v) for k, v in theirs.param_groups[0].items()
              if k != "params" and mine.param_groups[0].get(k) != v}
    assert differ == {}, f"{variant}'s optimizer (trainyard, plain loop): {differ}"


def test_bench_step_refuses_an_unknown_variant_by_name(cli):
    r = cli.run("bench", "step", "--variants", "plain,fastest", timeout=60)
    assert r.returncode == 2 and "--variants: unknown fastest; the variants are plain, plain-compiled" in r.stderr
    r = cli.run("bench", "step", "--cycles", "0", timeout=60)
    assert r.returncode == 2 and "--rounds and --cycles must be at least 1" in r.stderr


# --- `--precision bf16`: every bench beside itself in fp32 (issue 26); the bytes halve exactly where they must

@pytest.mark.timeout(90)
def test_bench_broadcast_in_bf16_halves_the_sharded_broadcast(cli):
    r = cli.run("bench", "broadcast", "--json", "--precision", "bf16", "--world", "2", "--streams", "2", "--slices",
                "4", "--rounds", "1", "--steps", "2", "--warmup", "1", "--hidden", "32", "--depth", "4", "--features",
                "32", timeout=80)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["precision"] == "bf16" and report["precisions"]["bf16"] == {"compute": "bf16", "params": "bf16",
                                                                               "reduce": "fp32"}
    names = ["ddp", "fsdp2-no-reshard", "fsdp2-reshard", "sharded-1", "sharded-2", "sharded-2-gated"]
    fp32 = {row["variant"]: row for row in report["variants"]}   # today's figures, from the fp32 runs
    bf16 = {row["variant"]: row for row in report["bf16"]["variants"]}
    assert list(fp32) == list(bf16) == names
    params = report["parameters"]
    # FSDP2 gathers its working parameters (fp32, then bf16) once or twice and reduces fp32 gradients
    assert fp32["fsdp2-no-reshard"]["bytes_per_step"] == 8 * params and bf16["fsdp2-no-reshard"]["bytes_per_step"] == 6 * params
    assert fp32["fsdp2-reshard"]["bytes_per_step"] == 12 * params and bf16["fsdp2-reshard"]["bytes_per_step"] == 8 * params
    for name in names[3:]:   # each rank's streams carry every slice: all the weights, 4 then 2 bytes each
        assert fp32[name]["bytes_per_step"] == 4 * params and bf16[name]["bytes_per_step"] == 2 * params
        assert bf16[name]["parameter_bytes_per_rank"] * 2 == fp32[name]["parameter_bytes_per_rank"]
        # the fp32 masters live at the owners: together, the fp32 weights
        assert fp32[name]["master_bytes_per_rank"] == 0 and bf16[name]["master_bytes_per_rank"] > 0
    # ddp is torch's mixed precision (fp32 weights under autocast): its all-reduce keeps its bytes
    assert bf16["ddp"]["bytes_per_step"] == fp32["ddp"]["bytes_per_step"] == 4 * params
    ratios = {row["variant"]: row for row in report["bf16_vs_fp32"]}
    assert [ratios[n]["bytes_ratio"] for n in names] == [1.0, 0.75, round(8 / 12, 4), 0.5, 0.5, 0.5]
    assert all(ratios[n]["step_ms_bf16"] > 0 and ratios[n]["step_ratio"] > 0 for n in names)
    assert "bytes are the figure" in report["note"]


@pytest.mark.timeout(90)
def test_bench_hybrid_in_bf16_halves_the_host_link(cli):
    r = cli.run("bench", "hybrid", "--json", "--precision", "bf16", "--rounds", "1", "--steps", "2", "--warmup", "1",
                "--trial", "4", "--hidden", "32", "--depth", "3", "--device", "cpu", timeout=80)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["precision"] == "bf16" and set(report["bf16"]["cases"]) == {"tight", "roomy"}
    for label in ("tight", "roomy"):
        fp32 = report["cases"][label]["placements"]["all-host"]
        bf16 = report["bf16"]["cases"][label]["placements"]["all-host"]
        # every layer's gradients down and weights up: bf16 both ways, exactly half the bytes
        assert fp32["host_link_bytes_per_step"] > 0
        assert bf16["host_link_bytes_per_step"] * 2 == fp32["host_link_bytes_per_step"]
        row = report["bf16_vs_fp32"][label]["all-host"]
        assert row["bytes_ratio"] == 0.5 and row["measured_ms_bf16"] > 0 and row["step_ratio"] > 0
    roomy = report["bf16"]["cases"]["roomy"]["placements"]
    assert roomy["all-device"]["host_link_bytes_per_step"] == 0   # nothing crosses the host link
    assert report["bf16_vs_fp32"]["roomy"]["all-device"]["bytes_ratio"] is None
    assert report["host_step"]["now_fused_ms"] == report["cases"]["roomy"]["placements"]["all-host"]["measured_ms"]


@pytest.mark.timeout(90)
def test_bench_memory_in_bf16_halves_the_parameters(cli):
    r = cli.run("bench", "memory", "--json", "--precision", "bf16", "--rounds", "1", "--steps", "1", "--d-model", "32",
                "--depth", "1", "--seq-len", "16", "--batch", "8", "--device", "cpu", timeout=80)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    held = report["bytes"]
    assert held["bf16"]["parameters"] * 2 == held["fp32"]["parameters"]
    assert held["bf16"]["gradients"] * 2 == held["fp32"]["gradients"]
    # the update's fp32 side is the same in both: AdamW's state, and (bf16) an fp32 master of every weight
    assert held["bf16"]["optimizer_state"] == held["fp32"]["optimizer_state"] > 0
    assert held["bf16"]["master"] == held["fp32"]["parameters"] and held["fp32"]["master"] == 0
    assert 0 < held["bf16"]["activations"] < held["fp32"]["activations"]
    assert held["bf16"]["keep_peak"] < held["fp32"]["keep_peak"] == report["keep_peak_bytes"]
    ratios = report["bf16_vs_fp32"]
    assert ratios["bytes"]["parameters"] == ratios["bytes"]["gradients"] == 0.5
    assert set(report["bf16"]["variants"]) == set(report["variants"]) == set(ratios["variants"])
    assert report["bf16"]["capacity_bytes"] == report["bf16"]["keep_peak_bytes"] // 2
    swap = report["bf16"]["variants"]["swap"]
    assert swap["swapped_per_step_bytes"] > 0 and ratios["variants"]["swap"]["swapped_ratio"] < 1


@pytest.mark.parametrize("bench", ["broadcast", "hybrid", "memory"])
def test_bench_refuses_an_unknown_precision_by_name(cli, bench):
    r = cli.run("bench", bench, "--precision", "fp16", timeout=30)
    assert r.returncode == 2
    assert "--precision" in r.stderr and "'fp16'" in r.stderr and "'fp32', 'bf16'" in r.stderr


# --- `--clip-grad-norm X` (issue 32): no clipping, clipping after waiting for the norm, speculative clipping

def assert_clip_row(row, modes, spec_rollback):
    assert set(row["step_ms"]) == set(modes) and all(row["step_ms"][m] > 0 for m in modes)
    guarded = [m for m in modes if m != "none"]
    for rates in (row["rollback_rate"], row["clipped_rate"]):
        assert set(rates) == set(guarded) and all(0.0 <= rates[m] <= 1.0 for m in guarded)
    # a threshold of 1e-6 clips every step: a speculative run rolls back its first clipped step (a warmup step here)
    # and then waits for the norm (engine/techniques/updates/updater.py), so no timed step rolls back; waiting never does
    assert row["rollback_rate"]["wait"] == 0.0 and all(row["clipped_rate"][m] == 1.0 for m in guarded)
    if "speculate" in modes:
        assert row["rollback_rate"]["speculate"] == spec_rollback
        assert set(row["ratios"]) == {"wait_over_none", "speculate_over_none", "speculate_over_wait"}
        assert row["meets_goals"]["speculate_within_5pct_of_none_without_rollbacks"] is None   # not judged
        assert row["meets_goals"]["speculate_at_most_wait_every_step_clipped"] in (True, False)
    assert row["grad_norm_median"] > 1e-6


@pytest.mark.timeout(60)
def test_bench_hybrid_clip_grad_norm_reports_three_modes_and_rollback_rates(cli):
    r = cli.run("bench", "hybrid", "--json", "--clip-grad-norm", "1e-6", "--rounds", "1", "--steps", "2", "--warmup",
                "1", "--hidden", "32", "--depth", "3", "--device", "cpu", timeout=50)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["clip_grad_norm"] == 1e-6 and report["modes"]["none"] == {"clip_grad_norm": 0.0,
                                                                            "skip_nonfinite": False}
    rows = {row["variant"]: row for row in report["variants"]}
    assert list(rows) == ["all-device", "all-host"] and rows["all-host"]["host_updates_overlap_backward"]
    for row in rows.values():
        assert_clip_row(row, ("none", "wait", "speculate"), spec_rollback=0.0)


@pytest.mark.timeout(60)
def test_bench_broadcast_clip_grad_norm_reports_three_modes_and_rollback_rates(cli):
    r = cli.run("bench", "broadcast", "--json", "--clip-grad-norm", "1e-6", "--world", "2", "--streams", "2",
                "--slices", "4", "--rounds", "1", "--steps", "2", "--warmup", "1", "--hidden", "32", "--depth", "4",
                "--features", "32", timeout=50)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    rows = {row["variant"]: row for row in report["variants"]}
    assert list(rows) == ["ddp-inline", "sharded-2-gated"]
    assert_clip_row(rows["ddp-inline"], ("none", "wait", "speculate"), spec_rollback=0.0)
    assert_clip_row(rows["sharded-2-gated"], ("none", "wait"), spec_rollback=None)   # decides first: never rolls back
    assert rows["sharded-2-gated"]["meets_goals"] == {}


@pytest.mark.parametrize("hosts, world, variant, want", [
    (2, 2, "sharded-4-gated", {"reduce": 50, "broadcast": 50}),        # one rank a host: half each way, twice
    (2, 2, "ddp", {"allreduce": 100}),                                   # ring of 2: 2 (W-1)/W = 1 x P
    (2, 4, "sharded-4-gated", {"reduce": 50, "broadcast": 50}),        # two-level: each byte crosses once
    (2, 4, "sharded-4-gated-flat", {"reduce": 100, "broadcast": 100}),  # flat: once per remote rank
    (2, 4, "ddp", {"allreduce": 150}),                                   # ring of 4: 1.5 x P over each edge
    (4, 4, "sharded-4-gated", {"reduce": 75, "broadcast": 75}),        # (H-1)/H of it, each way
    (2, 2, "fsdp2-no-reshard", {"allgather": 50, "reduce_scatter": 100}),   # gloo's reduce-scatter: an all-reduce
    (2, 2, "fsdp2-reshard", {"allgather": 100, "reduce_scatter": 100}),     # gathered again in backward
    (2, 4, "fsdp2-reshard", {"allgather": 150, "reduce_scatter": 150}),
])
def test_the_line_rate_ideal_counts_the_busiest_links_bytes_per_phase(hosts, world, variant, want):
    from engine.bench.linerate import ideal_bytes
    owned = [100 // world] * world   # 100 bytes of parameters in equal shares
    assert ideal_bytes(variant, owned, 100, hosts) == {**want, "total": sum(want.values())}


def test_the_ideal_takes_the_best_rounds_probe_never_above_the_shaped_rate():
    from engine.bench.linerate import best_rate
    probe = {"probe_bytes": 32 << 20, "probe_s": [0.3]}
    slow, fast = {**probe, "bytes_per_s": 0.5e8}, {**probe, "bytes_per_s": 1.2e8}
    got = best_rate([slow, fast, slow], "1gbit")   # a round on a busy machine says nothing of the line
    assert got["bytes_per_s"] == 1.2e8 and not got["capped"] and got["rounds_bytes_per_s"] == [50000000, 120000000, 50000000]
    got = best_rate([{**probe, "bytes_per_s": 1.4e8}], "1gbit")   # faster than tbf lets through: impossible
    assert got["bytes_per_s"] == 1e9 / 8 and got["capped"]


def test_a_variant_under_its_ideal_is_called_a_fault_of_the_probe():
    from engine.bench.broadcast_figures import figures
    phases = dict.fromkeys(("fwd_ms", "bwd_ms", "reduce_ms", "optim_ms", "broadcast_wait_ms", "gate_ms",
                            "reduce_span_ms", "broadcast_span_ms", "broadcast_issue_ms"), 1.0)

    def row(step_ms):
        return {"step_ms": step_ms, **phases, "parameters": 25, "model_bytes": 100, "parameter_bytes": 100,
                "bytes_per_step": 100, "master_bytes": 0, "owned_bytes": 50, "optimizer_state_bytes": 50,
                "state_per_rank": [50, 50], "master_per_rank": [0, 0], "owned_per_rank": [50, 50]}
    variants = ["ddp", "fsdp2-no-reshard", "fsdp2-reshard", "sharded-2-gated"]
    runs = {v: [row(ms)] for v, ms in zip(variants, (2000.0, 3000.0, 4000.0, 500.0))}
    # 1 byte/s over the link: ddp's ideal (100 bytes) is 100 s; the sharded variant's 100 s too: both under it
    out = figures(runs, variants, 2, {"ratio_to_ddp_at_most": 1.0}, with_bytes=False, hosts=2,
                  link={"bytes_per_s": 1.0})
    under = [r["variant"] for r in out["variants"] if r.get("under_ideal")]
    assert under == variants and "the probe under-measured the link" in out["probe_failed"]
    assert out["best_fsdp2"] == "fsdp2-no-reshard" and out["meets_goals"]["below_fsdp2"]
    fine = figures(runs, variants, 2, {"ratio_to_ddp_at_most": 1.0}, with_bytes=False, hosts=2,
                   link={"bytes_per_s": 1e9})
    assert "probe_failed" not in fine and not any(r.get("under_ideal") for r in fine["variants"])


def test_a_goal_is_met_by_every_round_missed_by_none_and_undecided_in_between():
    from engine.bench.verdict import judge
    assert judge([0.95, 0.97, 0.99], at_most=1.0) == {"median": 0.97, "spread": [0.95, 0.99], "goal": "<= 1",
                                                       "verdict": "met"}
    assert judge([0.95, 0.97, 1.02], at_most=1.0)["verdict"] == "undecided"
    assert judge([1.01, 1.2], at_most=1.0)["verdict"] == "missed"
    assert judge([1.4, 1.6], at_least=1.5)["verdict"] == "undecided"
    assert judge([1.6], at_least=1.5)["verdict"] == "met"
    with pytest.raises(ValueError):
        judge([1.0])


def test_the_memory_bench_holds_one_variants_model_at_a_time(monkeypatch):
    """On a GPU every variant's allocator peak must be its own: no step runs while another variant's model
    exists (the bench builds each afresh in every round and frees it after)."""
    from engine.bench import memory
    seen, step = [], memory._Trainer.step

    def counted(self, timed):
        seen.append(memory._Trainer.alive)
        return step(self, timed)
    monkeypatch.setattr(memory._Trainer, "step", counted)
    out = memory.measure(rounds=2, steps=1, link_gbps=0.0, d_model=16, depth=1, seq_len=8, batch=4)
    assert set(out["variants"]) == set(memory.VARIANTS + memory.TORCH_VARIANTS)
    assert seen and max(seen) == 1 and memory._Trainer.alive == 0


@pytest.mark.timeout(60)
@pytest.mark.slow   # 7 s on 2 idle cores, 12-17 s with them shared: 5 variants on 4 ranks, one round
def test_bench_pipeline_replicas_reports_every_variant_beside_ddp_sharded_and_torch(cli):
    """2 stages x 2 replicas of a tiny MLP on the loopback; 2x2-sharded runs, or (while the config check
    refuses it) is reported as not run with the check's own message."""
    from engine.bench.pipeline_grid import refusal, table_of
    r = cli.run("bench", "pipeline", "--replicas", "2", "--hidden", "32", "--depth", "4", "--rounds", "1",
                "--steps", "2", "--warmup", "1", "--json", timeout=55)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["world"], report["stages"], report["replicas"], report["hosts"]) == (4, 2, 2, 0)
    rows = {row["variant"]: row for row in report["variants"]}
    assert list(rows) == ["ddp", "sharded", "torch-pp-ddp", "2x2-ddp", "2x2-sharded"]
    refused = refusal(table_of("2x2-sharded", 4, 2, 32, 4, 32, 4, report["layout"]))
    for name, row in rows.items():
        if name == "2x2-sharded" and refused is not None:
            assert not row["run"] and row["step_ms"] is None and row["not_run"] == refused
            assert "not built yet" in refused
            continue
        assert row["run"] and row["step_ms"] > 0 and row["samples_per_s"] > 0
        assert len(row["step_ms_per_round"]) == 1 and "cross_host_bytes_per_step" not in row
        assert ("phases_ms" in row) == (name != "torch-pp-ddp")   # trainyard's own phases; torch has none
    assert rows["ddp"]["throughput_over_ddp"] == 1.0
    assert report["layout"] == [["fc0", "act0", "fc1", "act1"], ["fc2", "act2", "fc3", "act3", "head"]]
    assert report["goals"] == {} and "not judged" in report["goals_note"]   # the goals are the cluster's
    assert "2x2-ddp / ddp throughput" in report["judged"] and report["link_rate"] is None


def test_bench_pipeline_replicas_flags_only_with_replicas(cli):
    r = cli.run("bench", "pipeline", "--hosts", "2", timeout=30)
    assert r.returncode == 2 and "--hosts: only with --replicas" in r.stderr
    r = cli.run("bench", "pipeline", "--replicas", "3", timeout=30)
    assert r.returncode == 2 and "--replicas 3: must divide the world of 4" in r.stderr


def test_a_refused_replicas_variant_is_reported_not_run_and_left_out_of_the_goals():
    from engine.bench.pipeline_grid import figures
    def ranks(ms):
        return [{"step_ms": [ms, ms], "link": {"rx": 2000, "tx": 1000}, "phases_ms": {"fwd_ms": ms / 4}}] * 4
    variants = ["ddp", "sharded", "torch-pp-ddp", "2x2-ddp", "2x2-sharded"]
    got = {v: [ranks(ms)] for v, ms in zip(variants, (400.0, 260.0, 120.0, 100.0))}
    out = figures(variants, got, {"2x2-sharded": "not built yet"}, 32, 2, 4, {"bytes_per_s": 1000.0})
    rows = {row["variant"]: row for row in out["variants"]}
    assert rows["2x2-sharded"] == {"variant": "2x2-sharded", "run": False, "step_ms": None,
                                   "not_run": "not built yet"}
    assert rows["2x2-ddp"]["throughput_over_ddp"] == 4.0 and rows["2x2-ddp"]["samples_per_s"] == 320.0
    # the busiest host's busier direction, per step, and its time at the measured rate
    assert rows["ddp"]["cross_host_bytes_per_step"] == 1000 and rows["ddp"]["link_ms_per_step"] == 1000.0
    assert rows["2x2-ddp"]["phases_ms"] == {"fwd_ms": 25.0}
    assert out["goals"] == {"2x2-ddp / ddp throughput": "met", "2x2-ddp / sharded throughput": "met",
                            "2x2-ddp / torch-pp-ddp throughput": "met"}


def test_the_replicas_bench_cuts_the_stages_at_equal_parameters():
    from engine.bench.pipeline_grid import even_split
    from engine.bench.pipeline_grid_job import grid_model
    halves = even_split(grid_model(32, 20), 2)   # 20 equal layers and a small head: 10 layers a stage
    assert [s[0] for s in halves] == ["fc0", "fc10"] and halves[0][-1] == "act9"
    quarters = even_split(grid_model(32, 4), 4)
    assert quarters == [["fc0", "act0"], ["fc1", "act1"], ["fc2", "act2"], ["fc3", "act3", "head"]]
