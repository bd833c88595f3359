"""`trainyard export` (engine/run/export.py): a run's model as a Hugging Face save_pretrained folder that
transformers loads with no missing or unexpected key and whose logits are the engine's, or a LayerList's
state dict as one safetensors file; refusals by name, nothing half-written.

    .venv/bin/python -m pytest tests/test_export.py -q

Five short runs serve every test (module fixture `runs`, about 40 s on 2 cores): a tied GPT-2 from a
save_pretrained folder with tokenizer files through `trainyard run` (pipeline), and through engine.train in
one process a GPT-2 given as an object (sharded), a Llama given as an object (pipeline), a Llama from a
config.json (sharded) and a user's LayerList with a tied head (one worker, two checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from engine import cli
from engine.runtime.checkpoint import list_checkpoints, model_state
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")
from engine.run.export import ExportError, copy_tokenizer, export, read_layer_state  # noqa: E402
from tests.user_models import SEQ_LEN, VOCAB, as_layers, gpt2_model, llama_model  # noqa: E402

pytestmark = pytest.mark.timeout(180)   # the first test waits for the runs
STEPS = 3
TOKENIZER = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
             "vocab.json": "{}", "merges.txt": "#version: 0.2\n"}

# engine.train as a user's script calls it, one run after the other in one process
SCRIPT = '''
import json, sys
import torch
import engine
from tests.user_models import VOCAB, gpt2_model, llama_model, token_data


def tied_layers(seed=0):
    """A user's LayerList whose head is its embedding's weight."""
    torch.manual_seed(seed)
    embed, mix, head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, VOCAB, bias=False)
    head.weight = embed.weight
    return engine.LayerList([("embed", embed), ("mix", mix), ("head", head)])


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, runs = sys.argv[1], json.loads(sys.argv[2])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = {}
    for run in runs:
        make = {"gpt2": gpt2_model, "llama": llama_model, "layers": tied_layers, None: lambda: None}[run["model"]]
        model = make()
        engine.train(run["config"], model=model, data=token_data() if model is not None else None)
        if hasattr(model, "config"):   # the caller's model holds the final weights
            with torch.no_grad():
                logits[run["config"]["run"]["name"]] = model.eval()(input_ids=ids).logits
    torch.save({"ids": ids, "logits": logits}, out)
'''


def _config(name: str, runs_dir: Path, strategy: str, **sections) -> dict:
    return {"run": {"name": name, "steps": STEPS, "dir": str(runs_dir)}, "data": {"batch_size": 8},
            "parallel": {"strategy": strategy, "world_size": 2}, "telemetry": {"hub": False}, **sections}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train the five runs (two processes side by side) and give their folders, the caller's logits and the
    CLI run's stderr."""
    import numpy as np
    root = tmp_path_factory.mktemp("export")
    runs_dir = root / "runs"
    weights = root / "gpt2-weights"   # where a user's model comes from: save_pretrained's folder, a tokenizer
    gpt2_model(seed=3).save_pretrained(weights)
    for name, text in TOKENIZER.items():
        (weights / name).write_text(text)
    llama_model(seed=0).config.to_json_file(root / "llama.json")
    np.random.default_rng(0).integers(0, VOCAB, 4096, dtype=np.uint16).tofile(root / "train.bin")
    (root / "gpt2.toml").write_text(
        f'[run]\nname = "gpt2-pipeline"\nsteps = {STEPS}\ndir = "{runs_dir}"\n[model]\nname = "hf"\n'
        f'hf_weights = "{weights}"\n[data]\nname = "tokens"\ntrain = "{root / "train.bin"}"\nseq_len = {SEQ_LEN}\n'
        f'batch_size = 8\n[parallel]\nstrategy = "pipeline"\nworld_size = 2\n[telemetry]\nhub = false\n')
    script_runs = [
        {"model": "gpt2", "config": _config("gpt2-sharded", runs_dir, "sharded")},
        {"model": "llama", "config": _config("llama-pipeline", runs_dir, "pipeline")},
        {"model": None, "config": {**_config("llama-sharded", runs_dir, "sharded"),
                                   "model": {"name": "hf", "hf_config": str(root / "llama.json")},
                                   "data": {"name": "tokens", "train": str(root / "train.bin"), "seq_len": SEQ_LEN,
                                            "batch_size": 8}}},
        {"model": "layers", "config": {**_config("layers", runs_dir, "ddp"), "parallel": {"world_size": 1},
                                       "run": {"name": "layers", "steps": 4, "dir": str(runs_dir)},
                                       "checkpoint": {"every": 2}}},
    ]
    (root / "script.py").write_text(SCRIPT)
    runtime = tempfile.mkdtemp(prefix="ty", dir="/tmp")   # the fork servers' sockets: a short path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRAINYARD_RUNTIME_DIR": runtime}
    start = dict(cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    procs = [subprocess.Popen([sys.executable, "-m", "engine.cli", "run", str(root / "gpt2.toml"), "--headless"],
                              **start),
             subprocess.Popen([sys.executable, str(root / "script.py"), str(root / "logits.pt"),
                               json.dumps(script_runs)], **start)]
    try:
        outputs = [proc.communicate(timeout=160) for proc in procs]
    finally:
        for proc in procs:   # nothing of the runs outlives the tests
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(runtime, ignore_errors=True)
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    saved = torch.load(root / "logits.pt")
    return {"root": root, "runs_dir": runs_dir, "weights": weights, "ids": saved["ids"], "logits": saved["logits"],
            "cli_stderr": outputs[0][1], "script_stderr": outputs[1][1]}


FAMILY = {"gpt2-pipeline": gpt2_model, "gpt2-sharded": gpt2_model, "llama-pipeline": llama_model,
          "llama-sharded": llama_model}


def engine_logits(run_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """The engine's LayerList of the run's model family, with the run's latest checkpoint's weights."""
    layers = as_layers(FAMILY[run_dir.name](seed=1))
    layers.load_state_dict(model_state(list_checkpoints(run_dir)[-1]))
    with torch.no_grad():
        return layers.eval()(ids)


def load(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("name", list(FAMILY))
def test_the_folder_a_run_leaves_at_its_end_loads_and_computes_the_engines_logits(runs, name):
    """runs/NAME/hf/, written when the run ended (trainyard run and engine.train): transformers loads it with
    no missing or unexpected key, a tied GPT-2 stays tied, and its logits are the engine's to 1e-5."""
    run_dir = runs["runs_dir"] / name
    model, info = load(run_dir / "hf")
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set(), info
    ids = runs["ids"]
    with torch.no_grad():
        got = model(input_ids=ids).logits
    want = engine_logits(run_dir, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if name in runs["logits"]:   # the caller's own model after engine.train
        torch.testing.assert_close(got, runs["logits"][name], rtol=0, atol=1e-5)
    start = FAMILY[name](seed=3 if name == "gpt2-pipeline" else 0)   # the weights the run started from
    with torch.no_grad():
        assert (as_layers(start).eval()(ids) - got).abs().max() > 1e-3   # trained
    if name.startswith("gpt2"):
        assert model.config.tie_word_embeddings and model.lm_head.weight is model.transformer.wte.weight


def test_a_run_says_where_its_folder_is_and_copies_the_tokenizer_it_started_from(runs):
    cli_run = runs["runs_dir"] / "gpt2-pipeline"
    assert f"as a Hugging Face folder (save_pretrained's): {cli_run / 'hf'}" in runs["cli_stderr"]
    assert {p.name for p in (cli_run / "hf").iterdir()} >= {*TOKENIZER, "config.json", "generation_config.json",
                                                             "model.safetensors"}
    assert (cli_run / "hf" / "merges.txt").read_text() == TOKENIZER["merges.txt"]
    for name in ("gpt2-sharded", "llama-pipeline", "llama-sharded"):
        assert str(runs["runs_dir"] / name / "hf") in runs["script_stderr"]
        assert not any(p.name.startswith("tokenizer") for p in (runs["runs_dir"] / name / "hf").iterdir())
    # a Hugging Face model given to engine.train keeps its config from the start; a LayerList leaves no folder
    assert (runs["runs_dir"] / "llama-pipeline" / "hf_config" / "config.json").is_file()
    assert not (runs["runs_dir"] / "layers" / "hf").exists()


def test_export_in_shards_with_their_index(runs, tmp_path):
    """The Python call, with shards small enough that there are several: transformers' shards and their
    index, loaded whole; the lines it returns say the step and that there is no tokenizer."""
    done = export(runs["runs_dir"] / "llama-sharded", tmp_path / "out", step=STEPS, max_shard_size="20KB")
    assert done.hugging_face and done.step == STEPS
    assert any("no tokenizer files" in line for line in done.lines)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors.index.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 2
    model, info = load(tmp_path / "out")
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=runs["ids"]).logits,
                                   engine_logits(runs["runs_dir"] / "llama-sharded", runs["ids"]), rtol=0, atol=1e-5)
    assert not list(tmp_path.glob("out.partial-*"))


def test_bf16_writes_the_checkpoints_weights_rounded_to_bf16(runs, tmp_path, capsys):
    run_dir = runs["runs_dir"] / "llama-pipeline"
    assert cli.main(["export", str(run_dir), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert "bf16" in capsys.readouterr().out
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = load(tmp_path / "bf16")
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    fp32, _ = load(run_dir / "hf")   # the engine's weights (the test above)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, fp32.get_parameter(name).to(torch.bfloat16)), name


def test_a_layer_list_is_written_as_its_state_dict_with_a_tie_stored_once(runs, tmp_path, capsys):
    from safetensors import safe_open
    run_dir = runs["runs_dir"] / "layers"
    assert cli.main(["export", str(run_dir), str(tmp_path / "out"), "--step", "2"]) == 0
    assert "not a Hugging Face folder" in capsys.readouterr().out
    want = model_state(list_checkpoints(run_dir)[0])
    got = read_layer_state(tmp_path / "out")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["layers.0.weight", "layers.1.bias", "layers.1.weight"]   # the head's: the tie
    info = json.loads((tmp_path / "out" / "trainyard.json").read_text())
    assert info["step"] == 2 and info["ties"] == [["layers.0.weight", "layers.2.weight"]]
    assert info["model"]["name"] == "user"


def test_refusals_name_the_problem_exit_2_and_leave_nothing(runs, tmp_path, capsys, monkeypatch):
    run_dir = runs["runs_dir"] / "layers"

    def refused(*args: str) -> str:
        assert cli.main(["export", *args]) == 2
        return " ".join(capsys.readouterr().err.split())

    (tmp_path / "taken").mkdir()
    assert "taken already exists: choose another DIR, or replace it with --overwrite" in refused(
        str(run_dir), str(tmp_path / "taken"))
    assert "no checkpoint of step 3; the run has checkpoints of steps 2, 4" in refused(
        str(run_dir), str(tmp_path / "out"), "--step", "3")
    monkeypatch.chdir(runs["root"])   # a name is looked up under runs/
    said = refused("no-such-run", str(tmp_path / "out"))
    assert "'no-such-run' is not a run" in said
    assert "runs there: gpt2-pipeline, gpt2-sharded, layers, llama-pipeline, llama-sharded" in said
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    latest = list_checkpoints(damaged)[-1]
    file = sorted(p for p in latest.iterdir() if p.name != "manifest.json")[0]
    file.write_bytes(file.read_bytes()[:-4] + b"oops")
    assert f"{file}: corrupted" in refused(str(damaged), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.partial-*"))


def test_overwrite_replaces_the_folder_only_once_the_new_one_is_whole(runs, tmp_path, monkeypatch):
    from engine.run import export as module
    run_dir = runs["runs_dir"] / "layers"
    old = tmp_path / "out"
    old.mkdir()
    (old / "mine.txt").write_text("kept until the new folder is whole")

    def fails(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(module, "_write_layers", fails)
    with pytest.raises(ExportError, match="the export stopped \\(disk full"):
        export(run_dir, old, overwrite=True)
    assert (old / "mine.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    assert export(run_dir, old, overwrite=True).step == 4
    assert sorted(p.name for p in old.iterdir()) == ["model.safetensors", "trainyard.json"]
    with pytest.raises(ExportError, match="holds the run"):
        export(run_dir, runs["runs_dir"], overwrite=True)


def test_tokenizer_files_are_copied_and_nothing_else(tmp_path):
    source = tmp_path / "hub"
    source.mkdir()
    wanted = ["added_tokens.json", "merges.txt", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
              "tokenizer_config.json", "vocab.json"]
    for name in [*wanted, "config.json", "model.safetensors", "README.md"]:
        (source / name).write_text(name)
    (tmp_path / "out").mkdir()
    assert copy_tokenizer(source, tmp_path / "out") == wanted
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == wanted
    assert copy_tokenizer(None, tmp_path / "out") == []


def _small_run(root: Path, log: str = "") -> Path:
    """A run folder as a LayerList's run leaves it, written in this process (no workers): config.toml (naming
    a telemetry log elsewhere where `log` says) and one checkpoint of step 2 written by the code's own
    functions (engine/runtime/checkpoint.py)."""
    from engine.runtime import checkpoint as ckpt
    run_dir = root / "runs" / "small"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(f'[run]\nname = "small"\n[telemetry]\nlog = "{log}"\n')
    ckpt.write_rank_file(ckpt.staging_dir(run_dir, 2), 0, {"layers.0.weight": torch.arange(6.0).reshape(2, 3)}, {},
                         {"torch": torch.get_rng_state()})
    ckpt.finalize(run_dir, 2, {"world_size": 1, "config": {"model": {"name": "user"}}, "tied": []}, keep=2)
    return run_dir


def test_a_target_the_run_writes_is_refused_even_with_overwrite(tmp_path):
    """Seen: `trainyard export RUN RUN/checkpoints --overwrite` replaced every checkpoint with the export. A
    target that is, holds or is inside what the run writes is refused by name; the run's own hf/ is not."""
    log = tmp_path / "logs" / "small.jsonl"
    run_dir = _small_run(tmp_path, str(log))
    (run_dir / "hf").mkdir()
    refused = {
        run_dir / "checkpoints": "it is the run's checkpoints",
        run_dir / "checkpoints" / "step_000002": "it is inside the run's checkpoints",
        run_dir / "checkpoints" / "new": "it is inside the run's checkpoints",
        run_dir / "config.toml": "it is the run's config",
        run_dir / "telemetry.jsonl": "it is its telemetry log",
        run_dir / "telemetry.3.jsonl": "it is a part of its telemetry log",
        run_dir / "agent" / "node0": "it is inside its agents' logs",
        run_dir / "pids": "it is its pid files",
        run_dir / "user_model.node1.pt": "it is a user's model handed to its workers",
        log: "it is its telemetry log",
        log.with_name("small.2.jsonl"): "it is a part of its telemetry log",
        log.parent: "it holds its telemetry log",
        tmp_path / "runs": "it holds the run",
    }
    for dest, why in refused.items():
        with pytest.raises(ExportError, match=f"{dest}: {why}") as info:
            export(run_dir, dest, overwrite=True)
        assert "which the run writes" in str(info.value) or "holds the run" in str(info.value)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002"]
    assert export(run_dir, run_dir / "hf", overwrite=True).step == 2   # where the run's end exports
    assert export(run_dir, run_dir / "mine").step == 2                 # a folder of one's own, in the run


@pytest.mark.parametrize("how", ["os", "safetensors"])
def test_a_full_disk_stops_the_export_naming_the_disk_and_leaves_nothing(tmp_path, monkeypatch, how):
    """ENOSPC midway through the write (Python's own, or safetensors' writer's, which reports it in its text):
    an ExportError naming the target's disk and its free bytes; neither a partial folder nor the new one is
    left, and the folder it would have replaced (--overwrite) is as it was."""
    import errno
    import safetensors.torch
    from engine.run import export as module
    run_dir = _small_run(tmp_path)
    old = tmp_path / "out"
    old.mkdir()
    (old / "mine.txt").write_text("kept")
    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)   # one file whole, then the disk fills
        if how == "os":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ExportError) as info:
        module.export(run_dir, old, overwrite=True)
    said = str(info.value)
    assert f"{old.resolve()}: the export stopped (No space left on device" in said
    assert f"its disk ({tmp_path.resolve()}, mounted at " in said and " free of " in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs"]   # no out.partial-PID, no out.old-PID
    assert sorted(p.name for p in old.iterdir()) == ["mine.txt"]
    assert cli.main(["export", str(run_dir), str(tmp_path / "new")]) == 2   # the command: refused, no traceback
    assert not (tmp_path / "new").exists()
