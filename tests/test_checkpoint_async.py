"""Checkpoints off the step path (engine/runtime/checkpoint_writer.py, engine/run/checkpointer.py): the step
waits for a snapshot in host memory, a thread writes it hashing as it writes, rank 0 publishes once every
rank's column of the boundary's exchange says its file is written; a failed write stops the run with the
full-disk error. An asynchronous checkpoint of step N equals a synchronous one tensor for tensor, in every
strategy, with host updates and sharded's overlapped broadcasts on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

from engine.run.checkpointer import Checkpointer
from engine.runtime import checkpoint as ckpt
from engine.runtime import checkpoint_files
from engine.runtime.checkpoint_files import RankFile, checksum_file
from engine.runtime.checkpoint_writer import HostSnapshot, Writer
from engine.runtime.control import FIELDS, row_values
from engine.runtime.run_core import RunCore
from tests.conftest import Told
from tests.test_param_server import ps_args
from tests.test_training import DEMO


def test_a_snapshot_is_a_copy_that_later_updates_miss_and_its_buffers_are_reused():
    weight, moment = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    snapshot = HostSnapshot()
    part = snapshot.take({"w": weight, "v": weight}, {"w": {"exp_avg": moment, "step": 3}}, {"torch": torch.ones(2)})
    held = part.tensors["weights/w"]
    weight.add_(100)   # the next step's in-place update
    moment.zero_()
    assert torch.equal(held, torch.arange(6.0).reshape(2, 3)) and torch.equal(part.tensors["optimizer/w/exp_avg"],
                                                                              torch.ones(3))
    assert part.aliases == {"weights/v": "weights/w"} and part.scalars == {"w/step": 3}
    again = snapshot.take({"w": weight}, {}, {})
    assert again.tensors["weights/w"].data_ptr() == held.data_ptr()   # the same buffer, this step's values
    assert torch.equal(held, weight) and set(snapshot.buffers) == {"weights/w"}   # a name gone: its buffer too


def test_a_file_is_hashed_as_it_is_written_and_finalize_takes_that_checksum(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "CHUNK", 1000)   # several chunks, hashed one behind the writer
    staged = ckpt.staging_dir(tmp_path, 4)
    said = ckpt.write_rank_file(staged, 0, {"w": torch.randn(700), "b": torch.zeros(0)}, {}, {})
    data = (staged / "rank0.safetensors").read_bytes()
    assert said == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert json.loads(checksum_file(staged, "rank0.safetensors").read_text()) == said

    def read_back(path):
        raise AssertionError(f"finalize read {path} back")
    monkeypatch.setattr(ckpt, "_sha256", read_back)
    path = ckpt.finalize(tmp_path, 4, {"world_size": 1}, keep=2)
    assert json.loads((path / "manifest.json").read_text())["files"]["rank0.safetensors"] == said
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank0.safetensors"]   # no checksum file
    monkeypatch.undo()
    ckpt.verify(path)


def test_a_publication_removes_only_the_staged_folders_of_earlier_steps(tmp_path):
    for step in (2, 6):   # 2: left by a rank that failed; 6: being written while 4 is published
        ckpt.write_rank_file(ckpt.staging_dir(tmp_path, step), 0, {"w": torch.zeros(2)}, {}, {})
    ckpt.write_rank_file(ckpt.staging_dir(tmp_path, 4), 0, {"w": torch.zeros(2)}, {}, {})
    ckpt.finalize(tmp_path, 4, {"world_size": 1}, keep=2)
    assert not ckpt.staging_dir(tmp_path, 2).exists() and ckpt.staging_dir(tmp_path, 6).exists()


def test_a_write_that_fails_in_the_background_is_said_and_nothing_later_is_written(tmp_path, monkeypatch):
    writer, snapshot = Writer(), HostSnapshot()
    part = snapshot.take({"w": torch.zeros(3)}, {}, {})
    writer.write(ckpt.staging_dir(tmp_path, 2), 0, part, 2, 0.0)
    writer.publish(tmp_path, 2, {"world_size": 1}, 3, 0.0)
    assert writer.wait(10) and writer.written == 2 and writer.failed is None
    [(step, path, _)] = writer.take_published()
    assert step == 2 and ckpt.verify(path)["step"] == 2

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint_files.os, "fsync", full)
    writer.write(ckpt.staging_dir(tmp_path, 4), 0, part, 4, 0.0)
    assert writer.wait(10)
    monkeypatch.undo()
    writer.write(ckpt.staging_dir(tmp_path, 6), 0, part, 6, 0.0)
    assert writer.wait(10) and writer.failed == (4, errno.ENOSPC) and writer.written == 2
    assert not ckpt.staging_dir(tmp_path, 6).exists()   # after a failure nothing more is written
    assert not any(ckpt.staging_dir(tmp_path, 4).iterdir())   # no half-written file, no checksum file


def _one_rank(tmp_path, background=True) -> tuple[Checkpointer, torch.Tensor]:
    weight = torch.arange(4.0)
    strategy = SimpleNamespace(sync=lambda: 0.0, layout=lambda: {"strategy": "ddp"},
                               checkpoint_state=lambda: ({"layers.0.weight": weight}, {}))
    cfg = SimpleNamespace(run_dir=tmp_path, run=SimpleNamespace(name="one"), data=SimpleNamespace(batch_size=2),
                          checkpoint=SimpleNamespace(keep=3, background=background), to_dict=lambda: {})
    topo = SimpleNamespace(rank=0, world_size=1, is_first=True, side=None)
    core = RunCore(SimpleNamespace(config=cfg), topo, Told(), driver=None)
    return Checkpointer(cfg, topo, strategy, torch.nn.Linear(1, 1), SimpleNamespace(kind="cpu"), core), weight


def _table(checkpoints: Checkpointer) -> torch.Tensor:
    return torch.tensor([row_values(checkpoints.columns())], dtype=torch.float64)


def test_a_checkpoint_is_published_at_the_boundary_after_every_rank_has_written_it(tmp_path):
    checkpoints, weight = _one_rank(tmp_path)
    checkpoints.take(2)
    weight.add_(1)   # the next step, while the file is written
    checkpoints.writer.wait(10)
    assert not ckpt.list_checkpoints(tmp_path)   # written, not yet agreed: nothing published
    checkpoints.boundary(_table(checkpoints))
    checkpoints.writer.wait(10)
    checkpoints.boundary(_table(checkpoints))   # the event, once its writer has published it
    [(kind, step, fields)] = checkpoints.tel.events
    assert (kind, step) == ("checkpoint", 2) and {"stall_ms", "write_ms", "published_ms", "bytes"} <= set(fields)
    assert torch.equal(ckpt.model_state(ckpt.list_checkpoints(tmp_path)[-1])["layers.0.weight"], torch.arange(4.0))
    checkpoints.take(4)
    assert checkpoints.drain() == 4 and ckpt.list_checkpoints(tmp_path)[-1].name == "step_000004"


def test_a_failed_write_stops_the_run_at_the_next_boundary_with_the_full_disk_error(tmp_path, monkeypatch):
    checkpoints, _ = _one_rank(tmp_path)
    checkpoints.take(2)
    checkpoints.writer.wait(10)
    checkpoints.boundary(_table(checkpoints))
    checkpoints.writer.wait(10)   # published

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint_files.os, "fsync", full)
    checkpoints.take(4)
    checkpoints.writer.wait(10)
    table = _table(checkpoints)
    assert table[0, FIELDS.index("ckpt_failed")] == 5
    with pytest.raises(ckpt.CheckpointWriteError, match="the checkpoint of step 4 could not be written in .*: No "
                                                        "space left on device \\(rank 0\\).*the previous checkpoint, "
                                                        ".*step_000002, is whole"):
        checkpoints.boundary(table)
    assert [c.name for c in ckpt.list_checkpoints(tmp_path)] == ["step_000002"]
    assert not list(ckpt.checkpoints_dir(tmp_path).glob("*.tmp"))


def test_a_synchronous_checkpoint_is_published_before_the_step_goes_on(tmp_path):
    checkpoints, _ = _one_rank(tmp_path, background=False)
    checkpoints.take(2)
    assert ckpt.list_checkpoints(tmp_path)[-1].name == "step_000002"
    [(_, _, fields)] = checkpoints.tel.events
    assert fields["stall_ms"] == fields["published_ms"]   # the step waited for all of it


# --- an asynchronous checkpoint equals a synchronous one, every strategy ----------------------------------

MODEL = ["model.hidden=256", "model.depth=3", "optim.name=adamw", "optim.lr=0.01", "run.eval_every=0",
         "checkpoint.every=2", "checkpoint.keep=3"]
STRATEGIES = {   # host updates everywhere they exist; sharded's broadcasts overlap the next forward by default
    "ddp": ["update.placement=host"],
    "sharded": ["parallel.strategy=sharded", "update.placement=host", "parallel.sharded.overlap_forward=true"],
    "pipeline": ["parallel.strategy=pipeline", "update.placement=host"],
}


def _tensors(folder) -> dict:
    out = {}
    for file in sorted(folder.glob("rank*.safetensors")):
        reader = RankFile(file)
        try:
            out.update({(file.name, name): reader.get_tensor(name) for name in reader.keys()})
        finally:
            reader.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", [*STRATEGIES, "param_server"])
def test_an_async_checkpoint_equals_a_synchronous_one_tensor_for_tensor(cli, strategy):
    """Step 2's checkpoint, written by a thread while steps 3 and 4 update the same tensors in place, against
    one the step waited for: every tensor of every rank file (weights, fp32 masters, optimizer state, RNG)."""
    sets = STRATEGIES.get(strategy)
    args = [a for o in (*MODEL, *sets) for a in ("--set", o)] if sets else [
        *[a for o in MODEL for a in ("--set", o)],
        *ps_args(1, 2, "--set", "parallel.param_server.sync=bsp")]
    folders = {}
    for background in ("true", "false"):
        name = f"{strategy}-{background}"
        r = cli.run("run", DEMO, "--headless", "--steps", "4", *cli.base_args(name), *args,
                    "--set", f"checkpoint.background={background}", timeout=100)
        assert r.returncode == 0, r.stderr
        folders[background] = next(c for c in ckpt.list_checkpoints(cli.tmp_path / "runs" / name)
                                   if c.name == "step_000002")
    got, want = _tensors(folders["true"]), _tensors(folders["false"])
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    files = {b: {k: v["sha256"] for k, v in ckpt.verify(f)["files"].items()} for b, f in folders.items()}
    assert files["true"] == files["false"]
