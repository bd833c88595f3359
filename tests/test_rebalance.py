"""Live pipeline rebalancing: layers that migrate between stages in the middle of a step leave training
equal to single-process training; the decision rule; the per-layer clock."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.config import ModelConfig
from engine.devices import LedgerDevice
from engine.models import build_model
from engine.pipeline import PipelineStage
from engine.procpool import DistPool
from tests.test_pipeline import META, _batches, _optim, reference

MODEL = ModelConfig(name="mlp", hidden=32, depth=3)
NAMES = ["fc0", "act0", "fc1", "act1", "fc2", "act2", "head"]
# (start layout, layout from step 7): both directions, several layers at once, layers moving two stages
LAYOUTS = {
    2: [([NAMES[:2], NAMES[2:]], [NAMES[:5], NAMES[5:]]),          # three layers move 1 -> 0
        ([NAMES[:6], NAMES[6:]], [NAMES[:1], NAMES[1:]])],         # five layers move 0 -> 1
    4: [([NAMES[:1], NAMES[1:2], NAMES[2:3], NAMES[3:]], [NAMES[:4], NAMES[4:5], NAMES[5:6], NAMES[6:]]),
        ([NAMES[:4], NAMES[4:5], NAMES[5:6], NAMES[6:]], [NAMES[:1], NAMES[1:3], NAMES[3:5], NAMES[5:]])],
}
MIGRATE_BEFORE = 6   # the forced migration runs during step 7 (steps count from 1)


def migrating_job(topo, variants) -> list[dict]:
    out = []
    for optim, schedule, micro, (start, then) in variants:
        model = build_model(MODEL, META, seed=0)
        device = LedgerDevice(1 << 30)
        stage = PipelineStage(model, start, topo, device, _optim(optim), micro, schedule)
        device.ledger.track_module(stage.ledger_module, stage.optimizer)
        losses, moved = [], []
        for step, (x, y) in enumerate(_batches()):
            if step == MIGRATE_BEFORE:
                stage.migrate(then)
            losses.append(stage.train_step(x, y))
            move = stage.take_migration()
            if move is not None:
                moved.append((step + 1, move.moves, move.sent_bytes))
        stage.sync()
        out.append({"state": {k: v.detach().clone() for k, v in stage.stage_state().items()},
                    "losses": losses, "stages": stage.stage_layers, "moved": moved,
                    "own_params": sum(p.numel() for p in stage.stage_params()),
                    "ledger_params": device.ledger.bytes["parameters"]})
        stage.close()
    return out


def check_migrated(results, variants):
    refs = {o: reference(o) for o in {v[0] for v in variants}}
    for k, (optim, schedule, micro, (start, then)) in enumerate(variants):
        ref_state, ref_losses = refs[optim]
        merged = {}
        for rank, per_rank in enumerate(results):
            r = per_rank[k]
            assert r["stages"] == then
            assert r["ledger_params"] == 4 * r["own_params"]   # the ledger follows the layers
            assert not set(merged) & set(r["state"])
            merged.update(r["state"])
        assert set(merged) == set(ref_state)
        for name in ref_state:
            torch.testing.assert_close(merged[name], ref_state[name], atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"{optim}/{schedule}/{micro} {name}: {m}")
        torch.testing.assert_close(results[-1][k]["losses"], ref_losses, atol=1e-5, rtol=0)
        moves = {n: (a, b) for per_rank in results for (step, ms, _) in per_rank[k]["moved"] for n, a, b in ms}
        assert all(step == MIGRATE_BEFORE + 1 for per_rank in results for step, _, _ in per_rank[k]["moved"])
        want = {n: (s, t) for s, names in enumerate(start) for n in names
                for t, names2 in enumerate(then) if n in names2 and s != t}
        assert moves == want
        senders = {n for per_rank in results for (_, ms, nbytes) in per_rank[k]["moved"] if nbytes for n, _, _ in ms}
        assert senders, "no bytes moved"


def _variants(world):
    return [(o, s, m, lay) for lay in LAYOUTS[world] for (o, s, m) in
            (("adamw", "1f1b", 4), ("sgd", "gpipe", 4), ("adamw", "gpipe", 1))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_a_migration_during_step_7_leaves_training_equal_to_one_process(world):
    with DistPool(world, timeout_s=30) as pool:
        variants = _variants(world)
        results = pool.run(migrating_job, timeout=150, variants=variants)
    check_migrated(results, variants)


def peer_dies_in_migration(topo, how: str, schedule: str) -> dict:
    """Layers move from stage 1 to stage 0 during step 3; rank 1 leaves (or goes silent) as that step
    starts. Rank 0 must fail with an error naming the migration, within the collective timeout."""
    class Leaving(PipelineStage):
        def train_step(self, x, y):
            if self.pending is not None and self.rank == 1:
                if how == "hang":
                    time.sleep(60)
                os._exit(7)
            return super().train_step(x, y)
    stage = Leaving(build_model(MODEL, META, seed=0), [NAMES[:2], NAMES[2:]], topo, LedgerDevice(1 << 30),
                    _optim("sgd"), 4, schedule)
    t0 = time.monotonic()
    try:
        for step, (x, y) in enumerate(_batches()[:5]):
            if step == 2:
                stage.migrate([NAMES[:4], NAMES[4:]])
            t0 = time.monotonic()
            stage.train_step(x, y)
    except Exception as e:   # noqa: BLE001 - the error is the result
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0, "step": step}
    return {"error": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, schedule", [("exit", "gpipe"), ("hang", "1f1b")])
def test_a_migration_whose_peer_dies_fails_within_the_collective_timeout(how, schedule):
    timeout_s = 4.0
    pool = DistPool(2, timeout_s=timeout_s)
    try:
        [result] = pool.run(peer_dies_in_migration, answer_from=[0], timeout=60, how=how, schedule=schedule)
    finally:
        pool.close()
    assert result["error"] and result["step"] == 2, result
    assert "fc1, act1" in result["error"] and ("migration" in result["error"] or "migrate" in result["error"])
    assert result["after_s"] < timeout_s + 5, result
