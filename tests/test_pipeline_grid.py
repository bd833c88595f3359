"""Stages x replicas (issue 57): a pipeline whose stages are each held by R replicas (`parallel.pipeline.stages`),
which split every global batch and average their gradients within the stage (`data = "ddp"`), placed on the
ranks by `order` (engine/strategies/pipeline/grid.py). It trains as one worker does, across a live migration,
with swap, recompute and host updates, and resumes from and into other strategies' checkpoints."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.config import ConfigError, config_from_dict
from engine.strategies.pipeline.grid import Grid
from engine.strategies.pipeline.spec import micro_batches, replica_count, stage_count

SKEWED = ["--set", "parallel.strategy=pipeline", "--set", "model.hidden=512", "--set", "model.depth=3", "--set",
          'parallel.pipeline.partition=[["fc0"], ["act0", "fc1", "act1", "fc2", "act2", "head"]]']
MODEL = ["model.hidden=512", "model.depth=3"]


def test_the_grid_places_a_stages_replicas_on_neighbouring_ranks_by_default():
    grid = Grid.of(2, 4)
    assert grid.order == "stage" and (grid.stages, grid.replicas) == (2, 2)
    assert [grid.rank(s, p) for s in range(2) for p in range(2)] == [0, 1, 2, 3]
    assert grid.pipeline(1) == [1, 3] and grid.group_of(0) == [0, 1]
    assert [(grid.stage_of(r), grid.replica_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    other = Grid.of(2, 4, "replica")
    assert other.pipeline(1) == [2, 3] and other.group_of(0) == [0, 2]
    assert [(other.stage_of(r), other.replica_of(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for g in (Grid.of(4, 12), Grid.of(3, 12, "replica"), Grid.of(5, 5)):   # every rank once, pipelines rising
        ranks = sorted(g.rank(s, p) for s in range(g.stages) for p in range(g.replicas))
        assert ranks == list(range(g.stages * g.replicas))
        assert all(g.pipeline(p) == sorted(g.pipeline(p)) for p in range(g.replicas))
        assert all(g.stage_of(g.rank(s, p)) == s and g.replica_of(g.rank(s, p)) == p
                   for s in range(g.stages) for p in range(g.replicas))
    assert Grid.of(2, 4).said() == {"stages": 2, "replicas": 2, "order": "stage", "ranks": [[0, 1], [2, 3]]}
    with pytest.raises(ValueError, match="3 stages do not divide 4 workers"):
        Grid.of(3, 4)


def _error(parallel: dict, **more) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"parallel": parallel, **more})
    return str(e.value)


def test_the_stage_count_fixes_the_replicas_and_a_bad_grid_is_refused_by_name():
    cfg = config_from_dict({"parallel": {"strategy": "pipeline", "world_size": 4, "pipeline": {"stages": 2}}})
    assert (stage_count(cfg), replica_count(cfg)) == (2, 2)
    assert micro_batches(cfg) == (8, "parallel.pipeline.micro_batches = 4 x 2 replicas")
    one = config_from_dict({"parallel": {"strategy": "pipeline", "world_size": 4}})
    assert (stage_count(one), replica_count(one)) == (4, 1)
    pipe = {"strategy": "pipeline", "world_size": 6}
    assert _error({**pipe, "pipeline": {"stages": 4}}).startswith(
        "parallel.pipeline.stages = 4: must divide parallel.world_size = 6 into whole replicas (e.g. 1, 2, 3, 6)")
    assert _error({**pipe, "pipeline": {"stages": 3, "partition": [["fc0"], ["act0", "head"]]}},
                  model={"depth": 1}) == ("parallel.pipeline.partition lists 2 stages but parallel.pipeline.stages = 3")
    for strategy in ("param_server", "ddp"):
        assert _error({"strategy": strategy, "world_size": 4, "pipeline": {"stages": 2}}) == (
            f'parallel.pipeline.stages = 2: only with parallel.strategy = "pipeline" (got parallel.strategy = '
            f'"{strategy}")')
    # the batch splits over the replicas' micro-batches
    assert "data.batch_size = 36: must be divisible by parallel.pipeline.micro_batches = 4 x 2 replicas" in _error(
        {"strategy": "pipeline", "world_size": 4, "pipeline": {"stages": 2}}, data={"batch_size": 36})


def test_a_range_of_hosts_keeps_the_stage_count_and_needs_whole_replicas_at_every_count():
    base = {"parallel": {"strategy": "pipeline", "world_size": 6, "pipeline": {"stages": 2}}, "data": {"batch_size": 48}}
    hosts = {"min_nnodes": 1, "rdzv_endpoint": "10.0.0.1:29400"}
    config_from_dict({**base, "cluster": {"nnodes": 3, **hosts}})   # 1, 2, 3 hosts: 1, 2, 3 replicas
    with pytest.raises(ConfigError, match=r"with 1 of 2 hosts \(parallel.world_size 3\): parallel.pipeline.stages "
                                          r"= 2: must divide parallel.world_size = 3"):
        config_from_dict({"parallel": {"strategy": "pipeline", "world_size": 6, "pipeline": {"stages": 2}},
                          "data": {"batch_size": 48}, "cluster": {"nnodes": 2, **hosts}})


def _same_as_one_worker(path, overrides: list[str], steps: int) -> None:
    from engine.runtime.checkpoint import list_checkpoints, model_state
    from tests.test_training import single_process_reference
    got, want = model_state(list_checkpoints(path)[-1]), single_process_reference(overrides, steps)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("data", ["ddp", "sharded"])
def test_two_stages_of_two_replicas_equal_one_worker_across_a_migration_with_swap_recompute_and_host_updates(
        cli, data):
    from engine.telemetry.schema import RECORD_SCHEMA
    from tests.conftest import read_jsonl
    from tests.test_training import DEMO
    log = cli.tmp_path / "grid.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("grid"), *SKEWED,
                "--set", "parallel.world_size=4", "--set", "parallel.pipeline.stages=2",
                "--set", f"parallel.pipeline.data={data}", "--set", "parallel.sharded.slices=3",
                "--set", "parallel.pipeline.rebalance_check_every=10", "--set", "telemetry.layer_every=5",
                "--set", 'memory.policy={fc0 = "swap", fc1 = "recompute", fc2 = "swap"}',
                "--set", 'update.placement={fc1 = "host", head = "host"}',
                # stage 1 is the slow one for certain: the check at step 10 moves layers to stage 0
                "--set", "emulate.slow_layer=fc2", "--set", "emulate.slow_layer_ms=5", "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    for rec in records:
        jsonschema.validate(rec, RECORD_SCHEMA)
    start = records[0]
    assert start["layout"]["grid"] == {"stages": 2, "replicas": 2, "order": "stage", "ranks": [[0, 1], [2, 3]],
                                       "data": data, "owners": data == "sharded"}
    decided = [e for e in records if e.get("kind") == "rebalance"]
    moved = [e for e in records if e.get("kind") == "migration"]
    assert [e["step"] for e in decided] == [10] and [e["step"] for e in moved] == [11]
    steps = [rec for rec in records if rec["type"] == "step"]
    assert [s["layers"] for s in steps[-1]["stages"]] == moved[0]["stages"]
    assert all(len(s["replicas_ms"]) == 2 and s["rank"] in (2 * s["stage"], 2 * s["stage"] + 1)
               for s in steps[-1]["stages"])
    assert all("replica_reduce_ms" in e for e in steps[-1]["ranks"])
    table = next(rec["layers"] for rec in reversed(steps) if "layers" in rec)   # each layer once, on its stage
    assert sorted(e["name"] for e in table) == sorted(n for s in moved[0]["stages"] for n in s)
    # each update's placement, from the replica that runs it (sharded: the layer's owner)
    assert {e["name"]: e.get("placement") for e in table if e["name"].startswith(("fc", "head"))} == {
        "fc0": "device", "fc1": "host", "fc2": "device", "head": "host"}
    _same_as_one_worker(cli.tmp_path / "runs" / "grid", MODEL, 20)
    if data == "sharded":   # each layer's state on its owner only, written once; the forward gated on its slices
        _each_state_written_once_by_its_stages_owner(cli.tmp_path / "runs" / "grid", moved[0]["stages"])
        assert all("shard_gate_ms" in e for e in steps[-1]["ranks"])
    from tests.test_training import reference_accuracy, reference_val_loss, single_process_reference
    want = single_process_reference(MODEL, 20)   # evaluated through each replica's stages, its share each
    assert records[-1]["test_accuracy"] == pytest.approx(reference_accuracy(MODEL, want), abs=1e-6)
    assert records[-1]["val_loss"] == pytest.approx(reference_val_loss(MODEL, want), abs=1e-5)


def _each_state_written_once_by_its_stages_owner(runs, stages: list[list[str]]) -> None:
    """The last checkpoint: every optimizer entry in one rank's file, of a rank holding that layer's stage; both
    replicas of a stage own some of it (the greedy plan by bytes, and a migration's arrivals to the least loaded)."""
    from safetensors import safe_open
    from engine.runtime.checkpoint import list_checkpoints
    last = list_checkpoints(runs)[-1]
    seen: dict[str, int] = {}
    for rank in range(4):
        with safe_open(str(last / f"rank{rank}.safetensors"), "pt") as f:
            for key in f.keys():
                if key.startswith("optimizer/"):
                    assert key not in seen, (key, seen.get(key), rank)
                    seen[key] = rank
    names = ["fc0", "act0", "fc1", "act1", "fc2", "act2", "head"]   # the demo MLP's layers, in order
    stage_of = {f"layers.{i}.": s for s, layer_names in enumerate(stages) for i, n in enumerate(names) if n in layer_names}
    for key, rank in seen.items():
        prefix = key.split("/")[1].rsplit(".", 1)[0] + "."
        assert rank // 2 == stage_of[prefix], (key, rank)
    assert {rank for rank in seen.values()} == {0, 1, 2, 3}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("data", ["ddp", "sharded"])
def test_two_by_two_resumes_from_ddp_and_sharded_resumes_from_two_by_two_as_the_run_that_never_stopped(cli, data):
    """ddp 4 -> 2 x 2 (its replicas `data`) -> sharded 4: each resumes as the run that never stopped (with sharded
    replicas each layer's owner wrote its masters and state once)."""
    from engine.runtime.checkpoint import list_checkpoints
    from tests.test_training import DEMO
    runs = cli.tmp_path / "runs" / "shapes"
    model = ["--set", "model.hidden=512", "--set", "model.depth=3", "--set", "parallel.world_size=4"]
    r = cli.run("run", DEMO, "--headless", "--steps", "10", *cli.base_args("shapes"), *model)
    assert r.returncode == 0, r.stderr
    r = cli.run("run", DEMO, "--headless", "--steps", "20", *cli.base_args("shapes"), *SKEWED, *model,
                "--set", "parallel.pipeline.stages=2", "--set", f"parallel.pipeline.data={data}",
                "--resume", str(list_checkpoints(runs)[-1]))
    assert r.returncode == 0, r.stderr
    _same_as_one_worker(runs, MODEL, 20)
    manifest = json.loads((list_checkpoints(runs)[-1] / "manifest.json").read_text())
    assert manifest["layout"]["grid"]["replicas"] == 2
    r = cli.run("run", DEMO, "--headless", "--steps", "30", *cli.base_args("shapes"), *model,
                "--set", "parallel.strategy=sharded", "--resume", str(list_checkpoints(runs)[-1]))
    assert r.returncode == 0, r.stderr
    _same_as_one_worker(runs, MODEL, 30)


def test_owners_are_balanced_by_bytes_and_a_migration_keeps_the_owners_of_the_layers_that_stay():
    from engine.strategies.pipeline.shards import plan_owners
    sizes = {0: 8, 1: 0, 2: 4, 3: 4, 4: 4, 5: 2}
    first = plan_owners([[0, 1, 2], [3, 4, 5]], sizes, 2)
    assert first == {0: 0, 2: 1, 3: 0, 4: 1, 5: 0}   # a layer without parameters has no owner
    # layer 3 moves to stage 0: its old owner does not bind it there; the least-loaded replica takes it
    keep = {i: o for i, o in first.items() if i in (0, 2, 4, 5)}
    after = plan_owners([[0, 1, 2, 3], [4, 5]], sizes, 2, keep)
    assert {i: after[i] for i in keep} == keep and after[3] == 1   # stage 0's loads were 8 and 4
    assert plan_owners([[0, 2, 3, 4]], sizes, 4) == {0: 0, 2: 1, 3: 2, 4: 3}


def tied_grid_job(topo, variants) -> list[dict]:
    """2 stages x 2 replicas of the tied model (mid0 and mid1 share a weight, on different stages, until the
    migration brings them together): each replica takes its half of every batch."""
    from engine.runtime.devices import LedgerDevice
    from engine.strategies.pipeline import PipelineStage
    from engine.strategies.sharded.spec import ShardedConfig
    from tests.posting_order import PostingOrder
    from tests.test_pipeline import _pipe
    from tests.test_rebalance import MIGRATE_BEFORE, _batches, _tied_optim, tied_model
    out = []
    grid = Grid.of(2, 4)
    for optim, data, (start, then) in variants:
        stage = PipelineStage(tied_model(), start, topo, LedgerDevice(1 << 30), _tied_optim(optim), _pipe(2, "1f1b"),
                              grid=grid, sharded=ShardedConfig(slices=2) if data == "sharded" else None)
        half, losses, order = None, [], PostingOrder()
        for step, (x, y) in enumerate(_batches()):
            if step == MIGRATE_BEFORE:
                stage.migrate(then)
            half = x.shape[0] // 2
            mine = slice(stage.replica * half, (stage.replica + 1) * half)
            with order:
                losses.append(stage.train_step(x[mine], y[mine]))
        stage.sync()
        out.append({"state": {k: v.detach().clone() for k, v in stage.stage_state().items()}, "losses": losses,
                    "replica": stage.replica, "posted": order.log})
        stage.close()
    return out


@pytest.mark.timeout(180)
def test_a_weight_tied_across_stages_of_replicas_is_one_weight_with_ddp_and_sharded_replicas():
    from engine.processes.procpool import DistPool
    from tests.conftest import train_one_process
    from tests.posting_order import mismatched_pairs
    from tests.test_rebalance import TIED, _batches, _tied_optim, tied_model
    layouts = ([TIED[:3], TIED[3:]], [TIED[:5], TIED[5:]])   # mid1 joins mid0's stage at the migration
    variants = [("adamw+clip", "ddp", layouts), ("adamw+clip", "sharded", layouts)]
    with DistPool(4, timeout_s=30) as pool:
        results = pool.run(tied_grid_job, timeout=150, variants=variants)
    for k, (optim, data, _) in enumerate(variants):
        ref_state, ref_losses = train_one_process(tied_model(), _tied_optim(optim), _batches())
        for per_rank in results:   # every replica holds its stage's weights, equal to one process's
            for name, value in per_rank[k]["state"].items():
                torch.testing.assert_close(value, ref_state[name], atol=1e-5, rtol=0, msg=f"{data} {name}")
        last = [r[k]["losses"] for r in results if r[k]["losses"][0] is not None]   # the replicas' last stages
        torch.testing.assert_close([sum(s) / 2 for s in zip(*last)], ref_losses, atol=1e-5, rtol=0)
        # every pair's messages posted in one order at both ends, as NCCL needs (tests/posting_order.py)
        assert mismatched_pairs([per_rank[k]["posted"] for per_rank in results]) == [], data
