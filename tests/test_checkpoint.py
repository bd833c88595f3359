"""Checkpoint files: atomic publication, verification, pruning."""

from __future__ import annotations

import json
import os

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


def _two_ranks(run_dir, step=7):
    """A format-2 checkpoint as two ranks of a sharded run would write it: each its own parameters' fp32
    masters and AdamW state, rank 0 the tied weight once (under two names) and a buffer, both their RNG."""
    shared = torch.arange(6.0).reshape(2, 3)
    staged = ckpt.staging_dir(run_dir, step)
    adam = {"exp_avg": torch.ones(2, 3), "exp_avg_sq": torch.full((2, 3), 2.0), "step": torch.tensor(7.0)}
    ckpt.write_rank_file(staged, 0, {"layers.0.weight": shared, "layers.2.weight": shared,
                                     "layers.1.running": torch.zeros(3)},
                         {"layers.0.weight": adam}, {"torch": torch.get_rng_state()}, {"note": {"a": 1}})
    ckpt.write_rank_file(staged, 1, {"layers.1.weight": torch.full((3,), 5.0)},
                         {"layers.1.weight": {"momentum_buffer": torch.ones(3), "lr_seen": 0.5}},
                         {"torch": torch.get_rng_state()})
    return ckpt.finalize(run_dir, step, {"world_size": 2, "tied": [["layers.0.weight", "layers.2.weight"]]}, keep=3)


def test_every_rank_file_is_read_by_name_whatever_wrote_it(tmp_path):
    path = _two_ranks(tmp_path)
    manifest = ckpt.verify(path)
    assert manifest["format"] == 3 and set(manifest["files"]) == {"rank0.safetensors", "rank1.safetensors"}
    assert manifest["index"]["weights"]["layers.1.weight"] == ["rank1.safetensors", [3], "F32"]
    with ckpt.Reader(path, manifest) as reader:
        assert torch.equal(reader.weight("layers.2.weight"), torch.arange(6.0).reshape(2, 3))
        assert torch.equal(reader.weight("layers.1.weight"), torch.full((3,), 5.0))
        entry = reader.optimizer_entry("layers.0.weight")
        assert set(entry) == {"exp_avg", "exp_avg_sq", "step"} and float(entry["step"]) == 7.0
        assert reader.optimizer_entry("layers.1.weight")["lr_seen"] == 0.5   # a scalar, from the header
        assert reader.optimizer_entry("layers.1.running") is None and "layers.9.weight" not in reader.optimizer
        assert reader.rng(1) is not None and reader.rng(2) is None
        assert reader.extras() == {"note": {"a": 1}}
        with pytest.raises(ckpt.CheckpointError, match=r"its 'layers.1.weight' is \(3,\); this model's is \(4,\)"):
            reader.weight("layers.1.weight", (4,))
        with pytest.raises(ckpt.CheckpointError, match="holds no weight 'layers.5.weight'"):
            reader.weight("layers.5.weight")
    state = ckpt.model_state(path)
    assert sorted(state) == ["layers.0.weight", "layers.1.running", "layers.1.weight", "layers.2.weight"]
    assert state["layers.0.weight"] is state["layers.2.weight"]   # a tied weight: one tensor under both keys


def test_a_rank_file_is_refused_naming_it_when_damaged(tmp_path):
    path = _two_ranks(tmp_path)
    file = path / "rank1.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=f"{file}: corrupted"):
        ckpt.model_state(path)


def test_a_user_model_of_other_shapes_is_refused_by_name(tmp_path):
    path = _two_ranks(tmp_path)
    model = torch.nn.Module()
    layers = torch.nn.ModuleList([torch.nn.Linear(3, 2, bias=False), torch.nn.Module(), torch.nn.Linear(3, 2, bias=False)])
    layers[1].weight = torch.nn.Parameter(torch.zeros(4))
    model.layers = layers
    with pytest.raises(ckpt.CheckpointError, match=r"its 'layers.1.weight' is \(3,\); this model's is \(4,\)"):
        ckpt.check_shapes(path, ckpt.verify(path), model)


def test_a_write_that_fails_leaves_no_file(tmp_path, monkeypatch):
    """A full disk shows at the write or the fsync, as an OSError (engine/run/worker.py: every rank agrees the
    write failed, and the run stops naming the previous checkpoint); nothing is left under either name."""
    import errno
    from engine.runtime import checkpoint_files

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint_files.os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device"):
        ckpt.write_rank_file(tmp_path, 0, {"w": torch.zeros(3)}, {}, {})
    assert list(tmp_path.iterdir()) == []


def test_a_rank_file_is_a_safetensors_file(tmp_path):
    """What safetensors itself reads (export, transformers and other tools), bf16 and 0-d tensors included."""
    from safetensors import safe_open
    weights = {"a": torch.randn(3, 5), "b": torch.randn(4).bfloat16(), "c": torch.tensor(2.5)}
    ckpt.write_rank_file(tmp_path, 3, weights, {}, {})
    with safe_open(str(tmp_path / "rank3.safetensors"), framework="pt") as f:
        for key, value in weights.items():
            assert torch.equal(f.get_tensor(f"weights/{key}"), value), key


def _flip(file, at: int, mask: int) -> bytes:
    """Flip the bits `mask` of byte `at` of `file`; returns the bytes it held."""
    was = file.read_bytes()
    changed = bytearray(was)
    changed[at] ^= mask
    file.write_bytes(bytes(changed))
    return was


def _positions(path, name: str) -> dict[str, int]:
    """Where to flip a byte of each file of a checkpoint: its start, its header, its middle and its end; a rank
    file's header length, tensor table, trainyard's metadata and padding; the manifest's format, step, a
    file's checksum and its own."""
    data = (path / name).read_bytes()
    at = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}
    if name.endswith(".safetensors"):
        head = int.from_bytes(data[:8], "little")
        at |= {"header length": 7, "header open": 8, "tensor table": data.index(b"data_offsets"),
               "trainyard step": data.index(b'\\"step\\": ') + 10, "header end": 8 + head - 1, "data": 8 + head}
    else:
        text = data.decode()
        at |= {"format": text.index('"format": ') + 10, "step": text.index('"step": ') + 8,
               "a file's checksum": text.index('"sha256": "') + 11,
               "own checksum": text.index('"manifest_sha256": "') + 20,
               "a key": text.index('"world_size"') + 3, "whitespace": text.index("\n  ") + 1}
    return at


def test_one_byte_flipped_anywhere_in_what_a_resume_reads_is_refused_by_name(tmp_path):
    """A resume reads a checkpoint's manifest.json and its rank files, nothing else. A byte flipped in any
    of them, at any kind of place, is refused by verify naming the file; in the manifest a flip that changes no
    value it says (whitespace for whitespace) is harmless, and verify gives the same manifest."""
    path = _two_ranks(tmp_path)
    clean = ckpt.verify(path)
    for name in ("manifest.json", "rank0.safetensors", "rank1.safetensors"):
        for where, at in _positions(path, name).items():
            for mask in (0x01, 0x02, 0x10, 0xFF):
                was = _flip(path / name, at, mask)
                try:
                    ckpt.verify(path)
                except ckpt.CheckpointError as e:
                    assert str(path / name) in str(e), (name, where, mask, str(e))
                else:
                    raise AssertionError(f"{name}: a flip at its {where} ({mask:#x}) was believed")
                finally:
                    (path / name).write_bytes(was)
    # "\n" for "\r": JSON's whitespace either way, and the checksum is of the values, not of the bytes
    _flip(path / "manifest.json", _positions(path, "manifest.json")["whitespace"] - 1, 0x07)
    assert ckpt.verify(path) == clean


def test_a_manifest_edited_or_its_folder_renamed_is_refused_naming_both_steps(tmp_path):
    """Seen: "step": 30 edited to 38 resumed at step 38. The manifest's own checksum refuses the edit; an edit
    that recomputes the checksum is refused by the folder's name and by every rank file's header."""
    path = _two_ranks(tmp_path)
    manifest_path = path / "manifest.json"
    manifest_path.write_text(manifest_path.read_text().replace('"step": 7', '"step": 9'))
    with pytest.raises(ckpt.CheckpointError, match=f"{manifest_path}: corrupted \\(its checksum does not match\\)"):
        ckpt.verify(path)
    edited = json.loads(manifest_path.read_text())
    edited["manifest_sha256"] = ckpt.manifest_checksum(edited)
    manifest_path.write_text(json.dumps(edited))
    with pytest.raises(ckpt.CheckpointError, match="says step 9, but its folder's name step_000007 says step 7"):
        ckpt.verify(path)
    moved = path.rename(path.with_name("step_000009"))
    with pytest.raises(ckpt.CheckpointError, match=r"rank0.safetensors: its header says step 7; the manifest says "
                                                   r"step 9"):
        ckpt.verify(moved)
    with ckpt.Reader(moved, edited) as reader, pytest.raises(ckpt.CheckpointError, match="its header says step 7; "
                                                                                        "the manifest says step 9"):
        reader.weight("layers.1.weight")   # a reader given a manifest checks it too


def test_a_rank_file_of_another_step_is_refused(tmp_path):
    staged = ckpt.staging_dir(tmp_path, 4)
    ckpt.write_rank_file(staged, 0, {"w": torch.zeros(2)}, {}, {}, step=3)   # a stale file of step 3
    path = ckpt.finalize(tmp_path, 4, {"world_size": 1}, keep=2)
    with pytest.raises(ckpt.CheckpointError, match=f"{path / 'rank0.safetensors'}: its header says step 3; the "
                                                   f"manifest says step 4"):
        ckpt.verify(path, checksums=False)


def _as_format_2(run_dir, step=7):
    """A checkpoint as the code before format 3 wrote it: no step in the rank files, no manifest_sha256."""
    old = run_dir / "old"
    ckpt.write_rank_file(old, 0, {"layers.0.weight": torch.arange(4.0)}, {"layers.0.weight": {"m": torch.ones(4)}},
                         {"torch": torch.get_rng_state()})
    ckpt.staging_dir(run_dir, step).parent.mkdir(parents=True, exist_ok=True)
    old.rename(ckpt.staging_dir(run_dir, step))
    path = ckpt.finalize(run_dir, step, {"world_size": 1, "layout": {"strategy": "ddp"}}, keep=3)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": 2}, indent=2))
    return path


def test_a_format_2_checkpoint_still_resumes_and_exports_checked_against_its_folder(tmp_path):
    path = _as_format_2(tmp_path)
    manifest = ckpt.verify(path)
    ckpt.check_format(path, manifest)   # resumable
    assert torch.equal(ckpt.model_state(path)["layers.0.weight"], torch.arange(4.0))
    with ckpt.Reader(path, manifest) as reader:
        assert torch.equal(reader.optimizer["layers.0.weight"]["m"], torch.ones(4))
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"step": 7', '"step": 8'))
    with pytest.raises(ckpt.CheckpointError, match="says step 8, but its folder's name step_000007 says step 7"):
        ckpt.verify(path)
    (path / "manifest.json").write_text(text.replace('"F32"', '"F16"'))   # its index, unchecksummed
    with pytest.raises(ckpt.CheckpointError, match="its index is not what the rank files' headers hold"):
        ckpt.verify(path)


def test_a_full_disk_names_the_disk_and_the_checkpoint_to_resume_from(tmp_path):
    write(tmp_path, 3)
    said = str(ckpt.write_failed(tmp_path, 6, "No space left on device"))
    assert said.startswith(f"the checkpoint of step 6 could not be written in {tmp_path / 'checkpoints'}: No space "
                           f"left on device (its disk ({tmp_path / 'checkpoints'}, mounted at ")
    assert " free of " in said and f"resume from it with --resume {tmp_path}" in said
