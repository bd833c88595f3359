"""`[model] compile` (engine/models/compile.py): each layer's own forward compiled on its own, the techniques
around it in eager. A compiled run equals the eager one at every one of 20 steps (1e-4 relative, fp32) in every
strategy, with swap and recompute, and across a pipeline's live migration; after each layer's first compile
nothing compiles again (`recompiles` is 0).

The eager reference is one process (tests/test_precision.py one_process_losses), which every strategy's eager
run equals (their own parity tests; here measured 0 to 6e-8 apart). Inductor builds C++ on the CPU: the first
compile of the tiny transformer's five graphs took ~20 s on 2 cores, later ones read the session's cache
(conftest.py sets TORCHINDUCTOR_CACHE_DIR for every process the tests start), so the in-process test runs
first and warms it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from engine.config import load_config
from engine.models import build_model
from engine.models.compile import FIGURES, compile_figures, compile_layers, eager_layers, uncompile
from engine.runtime.control import FIELDS, Peaks, rank_rows, row_values
from engine.run.compiles import CompileReport
from engine.training.data import batch_for, load_dataset
from engine.training.loss import cross_entropy
from tests.conftest import read_jsonl
from tests.test_precision import one_process_losses
from tests.test_training import DEMO

STEPS = 20
TINY = ["model.name=transformer", "model.d_model=32", "model.heads=4", "model.depth=2", "data.name=text",
        "data.seq_len=16", "data.batch_size=16", "device.memory=64MiB", "run.eval_every=0"]
SWAP_RECOMPUTE = ['memory.policy={"block0.attn" = "swap", "block1.mlp" = "recompute"}', "telemetry.rank_every=1"]
CASES = {
    "ddp": ["parallel.strategy=ddp", *SWAP_RECOMPUTE],
    "sharded-gated": ["parallel.strategy=sharded", "parallel.sharded.overlap_forward=true", *SWAP_RECOMPUTE],
    # block0 moves to stage 0 at the check after step 3: it arrives where no attention or MLP ran before
    "pipeline-migration": ["parallel.strategy=pipeline", "parallel.pipeline.micro_batches=2",
                           'parallel.pipeline.partition=[["embed"], ["block0.attn", "block0.mlp", "block1.attn", '
                           '"block1.mlp", "norm", "head"]]', "parallel.pipeline.rebalance_check_every=3",
                           *SWAP_RECOMPUTE],
    # a known peak: the first step's FLOPs are counted, its layers eager (under the counter dynamo would skip
    # their code for good: an H200's compiled run never compiled), and they compile at step 2
    "ddp-counted": ["parallel.strategy=ddp", "device.peak_tflops=0.5"],
    "param_server": ["parallel.strategy=param_server", "parallel.world_size=3", "parallel.param_server.servers=1",
                     "parallel.param_server.workers=2", "parallel.param_server.sync=bsp"],
}
_reference: list[float] = []


def eager_losses() -> list[float]:
    if not _reference:
        _reference.extend(one_process_losses(TINY, STEPS))
    return _reference


@pytest.mark.slow   # ~27 s: inductor's first compile of five graphs, in this process
@pytest.mark.timeout(300)
def test_layers_of_one_class_share_a_graph_and_the_techniques_stay_outside():
    """Five classes, five graphs (the two blocks share theirs); hooks run eager on every call; recompute's
    checkpoint and a saved-tensor hook around the compiled call; equal to eager; no grad runs eager."""
    cfg = load_config(DEMO, TINY)
    ds = load_dataset(cfg.data, cfg.run.seed)
    eager = build_model(cfg.model, ds.meta, cfg.run.seed)
    model = copy.deepcopy(eager)
    dynamo, recompiles = FIGURES.dynamo, FIGURES.recompiles
    assert compile_layers(model) == []
    calls = []
    model.layers[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    saved = []

    def run(m, x, y):
        out = x
        for name, layer in m:   # block1.mlp recomputed, as the memory policy does
            out = checkpoint(layer, out, use_reentrant=False) if name == "block1.mlp" else layer(out)
        return cross_entropy(out, y)

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        x, y = batch_for(ds, step, 16, 0)
        losses = []
        for m, opt in zip((eager, model), opts):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
                loss = run(m, x, y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert FIGURES.dynamo - dynamo == 5   # embed, attention, MLP, norm, head: blocks 0 and 1 share two
    assert FIGURES.recompiles == recompiles
    assert len(calls) == 3 and saved   # the hook on every call; the saved-tensor hook saw the graphs' tensors
    with torch.no_grad():   # an evaluation: eager, nothing compiled (grad mode is guarded)
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    with eager_layers(list(model.layers)):   # a migration's arrivals
        run(model, x, y).backward()
    assert FIGURES.dynamo - dynamo == 5 and compile_figures()["compile_ms"] > 0
    uncompile(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_hf_embed_and_head_run_eager_said_in_a_line_and_blocks_compile_the_models_own_block():
    pytest.importorskip("transformers")
    from engine.models.hf import layers
    from engine.models.hf.parts import DecoderBlock
    from tests.hf_families import build
    model = layers(build("llama"), check=False)
    notes = compile_layers(model)
    assert [n.split(" ")[0] for n in notes] == ["embed", "head"] and all("runs eager" in n for n in notes)
    blocks = [layer for layer in model.layers if isinstance(layer, DecoderBlock)]
    assert blocks and all(type(b.block.__dict__["forward"]).__name__ == "CompiledForward" for b in blocks)
    uncompile(model)


def test_compile_time_is_an_event_and_in_the_summary_apart_from_the_steps():
    report = CompileReport(2)

    def table(ms, recompiles=(0, 0)):
        return torch.tensor([row_values({"compile_ms": m, "recompiles": n}) for m, n in zip(ms, recompiles)],
                            dtype=torch.float64)
    (first,) = report.events(1, table([2000.0, 3000.0]))
    assert first.kind == "compile" and first.fields["compile_s"] == 3.0 and first.fields["recompiles"] == 0
    assert report.events(2, table([2000.0, 3000.0])) == []
    (again,) = report.events(7, table([2500.0, 3000.0], (1, 0)))
    assert again.fields == {"compile_s": 0.5, "compile_s_per_rank": [0.5, 0.0], "total_s": 3.0, "recompiles": 1}
    assert "recompile" in again.note
    peaks = Peaks(2)
    peaks.note(rank_rows(table([0.0, 0.0])))
    assert "compile_s" not in peaks.summary() and "compile_ms" not in rank_rows(table([0.0, 0.0]))[0]
    peaks.note(rank_rows(table([2500.0, 3000.0], (1, 0))))
    assert peaks.summary()["compile_s"] == 3.0 and peaks.summary()["recompiles"] == 1
    assert "compile_ms" in FIELDS and load_config(DEMO).model.compile is False


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_run_equals_the_eager_one_at_every_step(cli, case):
    log = cli.tmp_path / f"{case}.jsonl"
    sets = [*TINY, *CASES[case], "model.compile=true"]
    r = cli.run("run", DEMO, "--headless", "--steps", str(STEPS), *cli.base_args(f"compiled-{case}"),
                *(a for s in sets for a in ("--set", s)), "--telemetry-log", str(log), timeout=330)
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    got = [rec["loss"] for rec in records if rec["type"] == "step"]
    want = eager_losses()
    assert len(got) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= 1e-4, (worst, got, want)
    summary = records[-1]
    assert summary["type"] == "summary" and summary["compile_s"] > 0 and summary["recompiles"] == 0, summary
    assert "compiled again" not in r.stderr and "compile time" in r.stdout
    compiles = [rec for rec in records if rec.get("kind") == "compile"]
    ranks = [row for rec in records if rec["type"] == "step" for row in rec.get("ranks", [])]
    if case == "ddp-counted":
        assert compiles and compiles[0]["step"] == 2 and summary["mfu"] > 0, (compiles, summary)
    elif case != "param_server":   # the parameter server says its compile time in the summary alone
        assert compiles and compiles[0]["step"] == 1 and all(c["recompiles"] == 0 for c in compiles)
        assert any(row.get("swap_layers") for row in ranks) and any(row.get("recompute_layers") for row in ranks)
    if case.startswith("pipeline"):   # block0 arrived on stage 0: eager in its migration step, compiled after
        (move,) = [rec for rec in records if rec.get("kind") == "migration"]
        assert any(c["step"] == move["step"] + 1 and c["compile_s_per_rank"][0] > 0 for c in compiles), compiles
        assert not any(c["step"] == move["step"] for c in compiles)
