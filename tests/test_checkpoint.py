"""Checkpoint files: atomic publication, verification, pruning."""

from __future__ import annotations

import json

import pytest
import torch

from engine.runtime import checkpoint as ckpt


def write(run_dir, step, keep=3):
    staged = ckpt.staging_dir(run_dir, step)
    ckpt.write_file(staged, "model.pt", {"w": torch.full((4,), float(step))})
    ckpt.write_file(staged, "rank0.pt", {"torch": torch.get_rng_state()})
    return ckpt.finalize(run_dir, step, {"world_size": 1}, keep=keep)


def test_a_published_checkpoint_verifies_and_loads(tmp_path):
    path = write(tmp_path, 5)
    assert path.name == "step_000005" and not ckpt.staging_dir(tmp_path, 5).exists()
    manifest = ckpt.verify(path)
    assert manifest["step"] == 5 and set(manifest["files"]) == {"model.pt", "rank0.pt"}
    assert torch.equal(ckpt.load_file(path, "model.pt")["w"], torch.full((4,), 5.0))


def test_staging_folders_are_invisible_and_old_checkpoints_pruned(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step, keep=2)
    ckpt.write_file(ckpt.staging_dir(tmp_path, 9), "model.pt", {})   # a crash mid-write
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert ckpt.resolve(tmp_path).name == "step_000004"


@pytest.mark.parametrize("damage,words", [
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 0xFF])), "corrupted"),
    (lambda p: p.unlink(), "missing"),
])
def test_damage_is_refused_naming_the_file(tmp_path, damage, words):
    path = write(tmp_path, 1)
    damage(path / "model.pt")
    with pytest.raises(ckpt.CheckpointError, match=words) as info:
        ckpt.verify(path)
    assert str(path / "model.pt") in str(info.value)


def test_a_damaged_manifest_is_refused(tmp_path):
    path = write(tmp_path, 1)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="manifest.json: corrupted"):
        ckpt.verify(path)
    (path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ckpt.CheckpointError, match="not a trainyard checkpoint"):
        ckpt.verify(path)


def test_resolve_explains_what_is_missing(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        ckpt.resolve(tmp_path / "nope")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in this directory"):
        ckpt.resolve(tmp_path)
