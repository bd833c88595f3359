"""A checkpoint outlives the job's shape: a run stopped at step 20 resumes at another world size, as another
strategy, or both, and its steps 21-30 are the run that never stopped (engine/runtime/checkpoint.py, format 3);
a checkpoint of format 2, written before format 3, resumes too.

Three 30-step runs write the checkpoints (ddp 2, which is also the run that never stopped; sharded 2; a
pipeline of 2 that migrated layers), shared by the module; each case resumes one's step-20 checkpoint for
steps 21-30.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from engine.runtime.checkpoint import list_checkpoints, model_state, verify
from tests.conftest import CLI, ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")
# no clipping: a parameter server refuses it; no dropout in the MLP: the losses are the weights' alone
SETTINGS = ["model.hidden=512", "model.depth=3", "optim.name=adamw", "optim.lr=0.01", "optim.lr_schedule=cosine",
            "optim.warmup_steps=3", "optim.min_lr=0.001", "checkpoint.every=10", "checkpoint.keep=3",
            "run.eval_every=0"]
SKEWED = ["parallel.strategy=pipeline", 'parallel.pipeline.partition=[["fc0"], ["act0", "fc1", "act1", "fc2", "act2", '
          '"head"]]', "parallel.pipeline.rebalance_check_every=3"]
SOURCES = {"ddp2": ["parallel.world_size=2"],
           "sharded2": ["parallel.strategy=sharded", "parallel.world_size=2"],
           "pipeline2": [*SKEWED, "parallel.world_size=2"]}
PS = ["parallel.strategy=param_server", "parallel.world_size=3", "parallel.param_server.servers=1",
      "parallel.param_server.workers=2", "parallel.param_server.sync=bsp"]
CASES = {"ddp2-ddp4": ("ddp2", ["parallel.world_size=4"]),
         "ddp2-ddp1": ("ddp2", ["parallel.world_size=1"]),
         # balanced: the layers a stage takes at the first step get their state from the checkpoint
         "sharded2-pipeline2": ("sharded2", ["parallel.strategy=pipeline", "parallel.world_size=2",
                                             "parallel.pipeline.partition=balanced"]),
         "pipeline2-sharded4": ("pipeline2", ["parallel.strategy=sharded", "parallel.world_size=4"]),
         "ddp2-param_server": ("ddp2", PS)}
TOLERANCE = 1e-5   # fp32 sums in another order (the all-reduce, the owners, the stages): the strategies' own


def _sets(*groups: list[str]) -> list[str]:
    return [a for group in groups for o in group for a in ("--set", o)]


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(log) if r["type"] == "step"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The three source runs, 30 steps each (the learning rate's schedule is the 30-step run's): ddp 2 is the
    run that never stopped; each one's step-20 checkpoint is where a run stopped there would resume."""
    root = tmp_path_factory.mktemp("resume")
    runtime = Path(tempfile.mkdtemp(prefix="ty", dir="/tmp"))
    runner = CLI(root, runtime)
    try:
        for name, sets in SOURCES.items():
            r = runner.run("run", DEMO, "--headless", "--steps", "30", *runner.base_args(name),
                           *_sets(SETTINGS, sets), "--telemetry-log", str(root / f"{name}.jsonl"), timeout=150)
            assert r.returncode == 0, r.stderr
    finally:
        runner.reap()
        shutil.rmtree(runtime, ignore_errors=True)
    return root


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumed_at_another_shape_goes_on_as_the_run_that_never_stopped(cli, written, case):
    source, sets = CASES[case]
    at_20 = next(c for c in list_checkpoints(written / "runs" / source) if c.name == "step_000020")
    if source == "pipeline2":   # the source had migrated layers: its checkpoint holds the layout it reached
        moved = [e for e in read_jsonl(written / "pipeline2.jsonl") if e.get("kind") == "migration"]
        assert moved and verify(at_20)["layout"]["stages"] == moved[-1]["stages"], "the pipeline never migrated"
    log = cli.tmp_path / "resumed.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "30", *cli.base_args(case), *_sets(SETTINGS, sets),
                "--resume", str(at_20), "--telemetry-log", str(log), timeout=150)
    assert r.returncode == 0, r.stderr
    # the run that never stopped is the source's own to step 30: a pipeline's losses differ from ddp's by fp32 sums
    # in another order (2.8e-5 on one machine, under 1e-5 on another), a resume must not add to that
    straight, resumed = _losses(written / f"{source}.jsonl"), _losses(log)
    assert sorted(resumed) == list(range(21, 31))
    worst = max(abs(resumed[s] - straight[s]) for s in resumed)
    print(f"{case}: largest loss difference at steps 21-30: {worst:.3g}")
    assert worst <= TOLERANCE, f"{case}: steps 21-30 differ from the run that never stopped by {worst}"
    # the weights: the source's own run to step 30 (AdamW's steps on a weight whose gradients are ~0 follow fp32
    # noise, and the pipeline's order of sums is not ddp's: up to 7e-4 apart on fc2 from ddp's own)
    want = model_state(list_checkpoints(written / "runs" / source)[-1])
    got = model_state(list_checkpoints(cli.tmp_path / "runs" / case)[-1])
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=TOLERANCE, msg=key)
    if "param_server" not in case:   # the rank's random streams are the old shape's: started afresh, said once
        assert r.stderr.count("random stream (dropout) starts afresh from run.seed") == 1, r.stderr


def _as_format_2(path: Path) -> None:
    """A checkpoint as trainyard wrote it before format 3: no step in the rank files' headers, no
    manifest_sha256, the files' checksums those of the files so rewritten."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        size = int.from_bytes(data[:8], "little")
        table = json.loads(data[8:8 + size])
        meta = json.loads(table["__metadata__"]["trainyard"])
        del meta["step"]
        table["__metadata__"]["trainyard"] = json.dumps(meta)
        head = json.dumps(table, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        rewritten = len(head).to_bytes(8, "little") + head + data[8 + size:]
        (path / name).write_bytes(rewritten)
        manifest["files"][name] = {"sha256": hashlib.sha256(rewritten).hexdigest(), "bytes": len(rewritten)}
    del manifest["manifest_sha256"]
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": 2}, indent=2))


@pytest.mark.timeout(300)
def test_a_format_2_checkpoint_resumes_as_the_run_that_never_stopped(cli, written):
    """Users' runs outlive the upgrade to format 3: ddp 2's step-20 checkpoint, as format 2 wrote it, resumes
    at its own shape and gives steps 21-30 of the run that never stopped."""
    at_20 = cli.tmp_path / "old" / "step_000020"
    shutil.copytree(next(c for c in list_checkpoints(written / "runs" / "ddp2") if c.name == "step_000020"), at_20)
    _as_format_2(at_20)
    assert verify(at_20)["format"] == 2
    log = cli.tmp_path / "resumed.jsonl"
    r = cli.run("run", DEMO, "--headless", "--steps", "30", *cli.base_args("format2"),
                *_sets(SETTINGS, SOURCES["ddp2"]), "--resume", str(at_20), "--telemetry-log", str(log), timeout=150)
    assert r.returncode == 0, r.stderr
    straight, resumed = _losses(written / "ddp2.jsonl"), _losses(log)
    assert sorted(resumed) == list(range(21, 31))
    assert max(abs(resumed[s] - straight[s]) for s in resumed) <= TOLERANCE
    assert verify(list_checkpoints(cli.tmp_path / "runs" / "format2")[-1])["format"] == 3
