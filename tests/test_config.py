"""Config loading and checking: defaults, files, --set overrides, every kind of error, docs.

    python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from engine.config import (Config, ConfigError, config_from_dict, load_config,
                           markdown_reference, save_config)
from engine.config.declare import show
from engine.config.rules import either
from engine.strategies.specs import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]

FULL_TOML = """
[run]
name = "full-run_1.0"
steps = 7
seed = 3
dir = "elsewhere"
overwrite = true
eval_every = 2
step_pause_ms = 1.5

[model]
name = "transformer"
hidden = 32
depth = 3
d_model = 48
heads = 6
channels = 8
dropout = 0.1
compile = true
hf_config = "hf/config.json"
hf_weights = "hf/"

[data]
name = "text"
batch_size = 24
test_fraction = 0.25
eval_samples = 512
seq_len = 16
text_chars = 5000
samples = 100
features = 49
classes = 3
train = "train.bin"
val = "val.bin"
dtype = "uint32"
vocab_size = 100
accumulate = 2

[optim]
name = "adamw"
lr = 3e-4
momentum = 0.5
weight_decay = 0.01
beta1 = 0.8
beta2 = 0.99
eps = 1e-6
kernel = "foreach"
lr_schedule = "cosine"
warmup_steps = 10
min_lr = 1e-5
clip_grad_norm = 1.0
skip_nonfinite = true
clip_mode = "wait"

[parallel]
strategy = "sharded"
world_size = 4
backend = "gloo"
collective_timeout_s = 30
max_restarts = 0
shutdown_timeout_s = 2

[parallel.ddp]
find_unused_parameters = true

[parallel.sharded]
streams = 3
slices = 9
slice_assignment = "random"
overlap_forward = false
main_stream_communicates = true
hierarchical = false

[parallel.pipeline]
micro_batches = 2
schedule = "gpipe"
partition = [["fc0"], ["act0", "head"]]
rebalance = "manual"
imbalance_threshold = 5.0
rebalance_check_every = 3

[parallel.param_server]
servers = 2
workers = 2
sync = "asp"
staleness_bound = 5
staleness_scaling = false
staleness_unit = "versions"
slow_workers = {3 = 2.0}
sync_profile_steps = 4

[update]
placement = { fc0 = "host" }
planner = "local"
host_threads = 3
profile_steps = 6

[device]
kind = "cpu"
memory = "2GiB"
peak_tflops = 1.5

[memory]
policy = { fc0 = "swap", fc1 = "recompute" }
host_link_gbps = 12.5
planner = "exhaustive"

[checkpoint]
every = 5
keep = 1
background = false
at_end = false

[precision]
compute = "bf16"
params = "bf16"
reduce = "bf16"

[telemetry]
log = "t.jsonl"
hub = false
listen = "tcp://127.0.0.1:7077"
queue_len = 32
live_hz = 5.0
layer_every = 0
rank_every = 20
log_every = 2
log_max_mb = 64
tensorboard = true
wandb = "team/project"
tracker_queue_len = 16
trace_steps = "3-4"

[cluster]
nnodes = 2
min_nnodes = 2
node_rank = 1
rdzv_endpoint = "10.0.0.1:29400"
rdzv_timeout_s = 30.0
last_call_s = 5.0
host_timeout_s = 6.0
interface = "eth1"

[emulate]
slow_layer = "fc1"
slow_layer_ms = 5.0
slow_from_step = 20
slow_rank = 1
slow_rank_ms = 2.0
kill_rank = 1
kill_at = "broadcast"
kill_step = 4
kill_how = "error"
nonfinite_layer = "fc0"
nonfinite_step = 3
nonfinite_rank = 0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- loading ---------------------------------------------------------------------------

def test_defaults_load():
    assert load_config(None) == Config()
    assert config_from_dict({}) == Config()
    # device.memory = "auto": the device's own (a GPU's memory; 512 MiB of the CPU's simulated ledger)
    assert Config().device.memory == "auto" and Config().capacity_bytes is None


def test_full_file_loads_every_key(tmp_path):
    cfg = load_config(write(tmp_path, FULL_TOML))
    assert cfg.run.name == "full-run_1.0" and cfg.run.overwrite is True
    assert cfg.model.heads == 6 and cfg.data.batch_size == 24
    assert cfg.optim.lr == 3e-4 and cfg.optim.eps == 1e-6 and cfg.optim.kernel == "foreach"
    assert cfg.update.host_threads == 3
    assert cfg.parallel.collective_timeout_s == 30.0
    assert isinstance(cfg.parallel.collective_timeout_s, float)  # ints widen for float keys
    assert cfg.device.memory == "2GiB" and cfg.capacity_bytes == 2 * 2**30
    assert cfg.telemetry.log == "t.jsonl"
    assert cfg.parallel.sharded.streams == 3 and cfg.parallel.pipeline.schedule == "gpipe"
    assert cfg.parallel.param_server.slow_workers == {"3": 2.0} and cfg.renamed == ()
    defaults = dict(leaves(Config()))
    unchanged = [path for path, value in leaves(cfg) if value == defaults[path] and not path.startswith(UNWRITTEN)]
    assert unchanged == []  # the file moves every key off its default


# the tables of strategies registered after the file was written (its own tests move its keys)
UNWRITTEN = tuple(f"parallel.{name}." for name in STRATEGIES if f"[parallel.{name}]" not in FULL_TOML) + (
    # the replicas' keys, which came after the flat names (tests/test_pipeline_grid.py moves them)
    "parallel.pipeline.stages", "parallel.pipeline.data", "parallel.pipeline.order")


def leaves(obj, path: str = ""):
    """(key path, value) of every setting, into the tables inside a section (parallel.sharded.streams)."""
    for f in dataclasses.fields(obj):
        value, inner = getattr(obj, f.name), f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value):
            yield from leaves(value, inner)
        else:
            yield inner, value


FLAT = dict(line.split(" = ", 1) for line in FULL_TOML[FULL_TOML.index("[parallel.ddp]"):FULL_TOML.index("[update]")]
            .splitlines() if " = " in line)


def test_a_strategys_key_by_its_old_flat_name_still_works_and_says_its_new_place(tmp_path, capsys):
    """The layout before the tables: every strategy's key flat in [parallel]. The same Config, and one line
    per old name."""
    flat = FULL_TOML.replace(FULL_TOML[FULL_TOML.index("[parallel]"):FULL_TOML.index("[update]")],
                             "[parallel]\nstrategy = \"sharded\"\nworld_size = 4\nbackend = \"gloo\"\n"
                             "collective_timeout_s = 30\nmax_restarts = 0\nshutdown_timeout_s = 2\n"
                             + "".join(f"{k} = {v}\n" for k, v in FLAT.items()) + "\n")
    old = load_config(write(tmp_path, flat))
    assert old == load_config(write(tmp_path, FULL_TOML))
    assert len(old.renamed) == len(FLAT) == 21
    assert "parallel.streams is now parallel.sharded.streams (the old name still works; docs/config.md lists the " \
           "old names)" in old.renamed
    # --set by the old name goes to the new place, over what the file set there
    cfg = load_config(write(tmp_path, FULL_TOML), ["parallel.streams=2", "parallel.rebalance=off"])
    assert cfg.parallel.sharded.streams == 2 and cfg.parallel.pipeline.rebalance == "off"
    assert cfg.renamed == ("parallel.streams is now parallel.sharded.streams (the old name still works; "
                           "docs/config.md lists the old names)",
                           "parallel.rebalance is now parallel.pipeline.rebalance (the old name still works; "
                           "docs/config.md lists the old names)")
    # --set by the new name, over the file's old one
    assert load_config(write(tmp_path, flat), ["parallel.sharded.streams=5"]).parallel.sharded.streams == 5
    # both names in one file: one setting set twice
    assert error_of({"parallel": {"streams": 2, "sharded": {"streams": 3}}}) == (
        "parallel.streams and parallel.sharded.streams are one setting, set twice: keep parallel.sharded.streams")
    assert error_of({"parallel": {"sharded": {"stream": 3}}}) == (
        "unknown key 'parallel.sharded.stream' (did you mean 'parallel.sharded.streams'?); allowed keys in "
        "[parallel.sharded]: streams, slices, slice_assignment, overlap_forward, main_stream_communicates, hierarchical")
    assert error_of({"parallel": {"sharded": 3}}).startswith(
        "parallel.sharded = 3: expected a table of settings ([parallel.sharded] in TOML); keys: streams, slices")
    # the command says each line once, on stderr, and runs
    r = subprocess.run([sys.executable, "-m", "engine.config", "--set", "parallel.slices=8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "[parallel.sharded]\nstreams = 2\nslices = 8" in r.stdout
    assert r.stderr == ("trainyard: parallel.slices is now parallel.sharded.slices (the old name still works; "
                        "docs/config.md lists the old names)\n")


def test_file_keys_not_given_keep_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "[run]\nsteps = 9\n"))
    assert cfg.run.steps == 9 and cfg.run.name == "trainyard" and cfg.model == Config().model


@pytest.mark.parametrize("override, section, key, value", [
    ("data.batch_size=32", "data", "batch_size", 32),
    ("optim.lr=1e-3", "optim", "lr", 1e-3),
    ("optim.lr=1", "optim", "lr", 1.0),
    ("run.name=foo", "run", "name", "foo"),
    ('run.name="quoted"', "run", "name", "quoted"),
    ("run.name=2024", "run", "name", "2024"),  # text key: a number is taken as its text
    ("run.overwrite=true", "run", "overwrite", True),
    (" run.steps = 12 ", "run", "steps", 12),
    ("device.memory=2GiB", "device", "memory", "2GiB"),
    ("device.memory=1048576", "device", "memory", "1048576"),
    ("telemetry.log=", "telemetry", "log", ""),
])
def test_overrides_parse(override, section, key, value):
    got = getattr(getattr(load_config(None, [override]), section), key)
    assert got == value and type(got) is type(value)


def test_overrides_apply_over_file_and_base(tmp_path):
    path = write(tmp_path, "[run]\nsteps = 9\nseed = 4\n")
    base = {"run": {"steps": 1, "seed": 1, "eval_every": 5}, "optim": {"name": "adamw"}}
    cfg = load_config(path, ["run.seed=7"], base=base)
    assert (cfg.run.steps, cfg.run.seed, cfg.run.eval_every, cfg.optim.name) == (9, 7, 5, "adamw")
    assert base["run"]["steps"] == 1  # the caller's dict is left alone


@pytest.mark.parametrize("override", ["runsteps=5", "run.steps", "run=5", "a.b.c=1", ".x=1", "run.=1"])
def test_malformed_override(override):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert override in str(info.value) and "--set section.key=value" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config(tmp_path / "nope.toml")


def test_invalid_toml_names_file_and_position(tmp_path):
    path = write(tmp_path, "[run]\nname = \n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "line 2, column 8" in str(info.value)


# --- errors: key path, bad value, what is allowed ---------------------------------------

@pytest.mark.parametrize("data, expected", [
    ({"optim": {"lr": "fast"}}, 'optim.lr = "fast": expected a number (float) >= 0.0'),
    ({"data": {"batch_size": 32.5}}, "data.batch_size = 32.5: expected an integer (int) >= 1"),
    ({"data": {"batch_size": 32.0}}, "data.batch_size = 32.0: expected an integer (int) >= 1; write 32"),
    ({"data": {"batch_size": True}}, "data.batch_size = true: expected an integer (int) >= 1"),
    ({"run": {"overwrite": 1}}, "run.overwrite = 1: expected true or false (bool)"),
    ({"run": {"dir": 5}}, "run.dir = 5: expected a string (str)"),
    ({"model": {"name": 3}}, 'model.name = 3: expected a string (str), one of "mlp", "transformer", "branchy", "hf"'),
    ({"optim": {"lr": float("inf")}}, "optim.lr = inf: must be a finite number >= 0.0"),
])
def test_wrong_type(data, expected):
    assert error_of(data).startswith(expected)


@pytest.mark.parametrize("data, expected", [
    ({"data": {"batch_size": 0}}, "data.batch_size = 0: must be >= 1"),
    ({"model": {"dropout": 0.95}}, "model.dropout = 0.95: must be between 0.0 and 0.9"),
    ({"parallel": {"world_size": 300}}, "parallel.world_size = 300: must be between 1 and 256"),
    ({"optim": {"lr": -1}}, "optim.lr = -1.0: must be >= 0.0"),
])
def test_out_of_range(data, expected):
    assert error_of(data) == expected


def test_choices_with_and_without_suggestion():
    assert error_of({"parallel": {"strategy": "zero"}}) == \
        'parallel.strategy = "zero": must be one of ' + ", ".join(show(name) for name in STRATEGIES)
    assert error_of({"optim": {"name": "adamm"}}) == \
        'optim.name = "adamm": must be one of "sgd", "adamw" (did you mean "adamw"?)'
    assert error_of({"device": {"kind": "CUDA"}}).endswith('(did you mean "cuda"?)')


def test_slices_fewer_than_streams_names_both():
    assert error_of({"parallel": {"sharded": {"streams": 4, "slices": 2}}}) == (
        "parallel.sharded.slices = 2 is smaller than parallel.sharded.streams = 4: every stream needs at least one slice "
        "(set slices >= 4 or streams <= 2)")


def test_pattern_in_words():
    message = error_of({"run": {"name": "my run"}})
    assert message.startswith('run.name = "my run": must be 1 to 64 letters, digits')
    assert "starting with a letter or digit" in message
    assert error_of({"run": {"name": "x" * 65}}).startswith("run.name = ")


@pytest.mark.parametrize("value", ["lots", "12 parsecs", 0, -5, 1.5, True, "0B"])
def test_bad_size(value):
    message = error_of({"device": {"memory": value}})
    assert message.startswith("device.memory = ") and '"512MiB", "2GiB"' in message


def test_unknown_key_suggests_close_match():
    assert error_of({"optim": {"lrr": 0.1}}) == (
        "unknown key 'optim.lrr' (did you mean 'optim.lr'?); "
        "allowed keys in [optim]: name, lr, momentum, weight_decay, beta1, beta2, eps, kernel, lr_schedule, "
        "warmup_steps, min_lr, clip_grad_norm, skip_nonfinite, clip_mode")
    assert error_of({"optim": {"zzzz": 1}}).startswith("unknown key 'optim.zzzz'; allowed keys in [optim]: ")


def test_unknown_section_suggests_close_match():
    message = error_of({"optimm": {"lr": 0.1}})
    assert message.startswith("unknown section 'optimm' (did you mean 'optim'?); allowed sections: run, model")
    assert error_of({"zzzz": {}}).startswith("unknown section 'zzzz'; allowed sections: ")
    assert "did you mean 'run.steps'?" in error_of({"steps": 5})  # a key written outside its section
    assert error_of({"optim": 3}).startswith("optim = 3: expected a table")


def test_unknown_key_from_override_and_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr' \(did you mean 'optim.lr'\?\)"):
        load_config(None, ["optim.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown section 'optimm' \(did you mean 'optim'\?\)"):
        load_config(write(tmp_path, "[optimm]\nlr = 0.1\n"))


# the strategies that take a slow rank, as the message offers them ("ddp" or "sharded")
TAKE_SLOW_RANK = either(name for name, spec in STRATEGIES.items() if "emulate.slow_rank" not in spec.refuses)


@pytest.mark.parametrize("data, expected", [
    ({"data": {"batch_size": 50}, "parallel": {"world_size": 4}},
     "data.batch_size = 50: must be divisible by parallel.world_size = 4 (e.g. 48 or 52)"),
    ({"data": {"batch_size": 3}},  # world_size keeps its default, 2
     "data.batch_size = 3: must be divisible by parallel.world_size = 2 (e.g. 2 or 4)"),
    ({"model": {"name": "transformer", "d_model": 66}, "data": {"name": "text"}},
     'model.d_model = 66: must be divisible by model.heads = 4 when model.name = "transformer" (e.g. 64 or 68)'),
    ({"model": {"name": "transformer"}},
     'model.name = "transformer": requires data.name = "text" or "tokens" (got data.name = "digits")'),
    ({"data": {"name": "text"}},
     'data.name = "text": requires model.name = "transformer" or "hf" (got model.name = "mlp")'),
    ({"model": {"name": "branchy"}, "data": {"name": "synthetic", "features": 50}},
     'data.features = 50: must be a perfect square when model.name = "branchy" (e.g. 49 or 64)'),
    ({"emulate": {"slow_layer": "fc1"}},
     'emulate.slow_layer = "fc1" needs emulate.slow_layer_ms > 0 (how many milliseconds each of its forwards sleeps)'),
    ({"emulate": {"slow_layer": "fc1", "slow_layer_ms": 3.0},
      "parallel": {"strategy": "param_server", "world_size": 2, "param_server": {"servers": 1, "workers": 1}}},
     'emulate.slow_layer = "fc1": not available with parallel.strategy = "param_server" (emulate a slow worker '
     'with parallel.param_server.slow_workers)'),
    ({"emulate": {"slow_rank": 1}},
     "emulate.slow_rank = 1 needs emulate.slow_rank_ms > 0 (how many milliseconds its forward sleeps each step)"),
    ({"emulate": {"slow_rank": 2, "slow_rank_ms": 5.0}},
     "emulate.slow_rank = 2: no such rank; parallel.world_size = 2 has ranks 0 to 1"),
    ({"emulate": {"slow_rank": 1, "slow_rank_ms": 5.0}, "parallel": {"strategy": "pipeline"}},
     f'emulate.slow_rank = 1: only with parallel.strategy = {TAKE_SLOW_RANK} (a pipeline\'s slow stage is '
     "emulate.slow_layer; a parameter server's slow workers are parallel.param_server.slow_workers)"),
    ({"telemetry": {"trace_steps": "5-3"}},
     'telemetry.trace_steps = "5-3": steps count from 1, and FIRST-LAST needs FIRST <= LAST (like "20-22")'),
    ({"telemetry": {"trace_steps": "0"}},
     'telemetry.trace_steps = "0": steps count from 1, and FIRST-LAST needs FIRST <= LAST (like "20-22")'),
])
def test_cross_field_rules(data, expected):
    assert error_of(data) == expected


def test_cross_field_rules_accept_valid_pairs():
    config_from_dict({"model": {"name": "transformer", "d_model": 48, "heads": 6}, "data": {"name": "text"}})
    config_from_dict({"model": {"name": "branchy"}, "data": {"name": "digits", "features": 50}})
    config_from_dict({"model": {"name": "branchy"}, "data": {"name": "synthetic", "features": 49}})
    config_from_dict({"model": {"d_model": 66}})  # heads only matter for the transformer


# --- writing, docs, command line ---------------------------------------------------------

def test_round_trip_through_toml(tmp_path):
    for cfg in (Config(), load_config(write(tmp_path, FULL_TOML)), load_config(None, ["device.memory=4096"])):
        path = tmp_path / "saved.toml"
        save_config(cfg, path)
        assert load_config(path) == cfg
        assert config_from_dict(cfg.to_dict()) == cfg


@settings(max_examples=50, deadline=None)
@given(lr=st.floats(min_value=0.0, allow_infinity=False), steps=st.integers(1, 2**62),
       name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True))
def test_round_trip_keeps_values_exactly(tmp_path_factory, lr, steps, name):
    cfg = config_from_dict({"optim": {"lr": lr}, "run": {"steps": steps, "name": name}})
    path = tmp_path_factory.mktemp("rt") / "cfg.toml"
    save_config(cfg, path)
    assert load_config(path) == cfg


def test_docs_match_declarations():
    docs = ROOT / "docs" / "config.md"
    assert docs.exists() and docs.read_text() == markdown_reference(), (
        "docs/config.md is out of date with engine/config/settings.py; regenerate it with:\n"
        "    python -m engine.config --markdown > docs/config.md")


def test_reference_covers_every_key():
    text = markdown_reference()
    tables = [(section.name, section.default_factory) for section in dataclasses.fields(Config)]
    for path, cls in tables:
        assert f"## [{path}]" in text
        for f in dataclasses.fields(cls):
            if f.metadata["kind"] == "table":
                tables.append((f"{path}.{f.name}", f.default_factory))
            else:
                assert f"| `{f.name}` |" in text.split(f"## [{path}]")[1].split("## ")[0], f"{path}.{f.name}"
    assert "## [parallel.sharded]" in text and "| `parallel.streams` | `parallel.sharded.streams` |" in text
    assert "--set section.key=value" in text and "exit\nstatus 2" in text


def test_command_line_check_exits_2_on_error(tmp_path):
    run = [sys.executable, "-m", "engine.config"]
    ok = subprocess.run(run + ["--set", "run.steps=5"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "steps = 5" in ok.stdout
    bad = subprocess.run(run + ["--set", "optim.lrr=1"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown key 'optim.lrr'" in bad.stderr


def test_update_placement_is_a_side_auto_or_a_table_of_sides():
    assert error_of({"update": {"placement": "hots"}}) == (
        'update.placement = "hots": expected "auto", "device", "host", or a table of layer names to "device" or '
        '"host" (did you mean "host"?)')
    assert error_of({"update": {"placement": {"fc0": "gpu"}}}) == 'update.placement.fc0 = "gpu": must be "device" or "host"'
    assert error_of({"update": {"placement": 3}}).startswith("update.placement = 3: expected ")
    assert config_from_dict({"update": {"placement": {"fc0": "host"}}}).update.placement == {"fc0": "host"}



def test_pipeline_settings_are_checked_against_each_other():
    pipe = {"strategy": "pipeline", "world_size": 2}
    assert error_of({"parallel": {**pipe, "pipeline": {"micro_batches": 5}}, "data": {"batch_size": 64}}).startswith(
        "data.batch_size = 64: must be divisible by parallel.pipeline.micro_batches = 5")
    assert error_of({"parallel": {**pipe, "pipeline": {"partition": [["fc0"], ["act0"], ["head"]]}}}) == (
        "parallel.pipeline.partition lists 3 stages but parallel.world_size = 2 (one stage per worker)")
    assert config_from_dict({"parallel": {**pipe, "pipeline": {"partition": "balanced"}}}).parallel.pipeline.partition == "balanced"
    assert error_of({"parallel": {**pipe, "pipeline": {"rebalance": "sometimes"}}}).startswith('parallel.pipeline.rebalance = "sometimes"')
    assert error_of({"parallel": {**pipe, "pipeline": {"imbalance_threshold": -1}}}).startswith("parallel.pipeline.imbalance_threshold = -1")
    assert error_of({"parallel": {**pipe, "pipeline": {"rebalance_check_every": 0}}}).startswith("parallel.pipeline.rebalance_check_every = 0")
    assert error_of({"parallel": {**pipe, "pipeline": {"partition": [["fc0"], []]}}}).startswith("parallel.pipeline.partition = ")
    assert error_of({"parallel": {**pipe, "pipeline": {"partition": "unifrom"}}}).endswith('(did you mean "uniform"?)')


@pytest.mark.parametrize("path", sorted((ROOT / "demo" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_demo_config_loads(path):
    if path.name == "llm.toml":   # its files are the demo's to write (demo/prepare.py; tests/test_demos.py)
        with pytest.raises(ConfigError, match='data.name = "tokens": requires data.train'):
            load_config(path)
        return
    cfg = load_config(path)
    assert cfg.run.name and cfg.parallel.world_size >= 1


def test_param_server_settings_are_checked_together():
    ps = {"strategy": "param_server", "world_size": 6, "param_server": {"servers": 2, "workers": 4}}

    def ps_with(**keys):
        return {"parallel": {**ps, "param_server": {**ps["param_server"], **keys}}}
    assert config_from_dict(ps_with(slow_workers={"5": 3})).parallel.param_server.slow_workers == {"5": 3.0}
    assert error_of(ps_with(workers=3)) == (
        "parallel.param_server.servers = 2 + parallel.param_server.workers = 3 must equal parallel.world_size = 6 (set world_size = 5)")
    assert error_of(ps_with(slow_workers={"1": 3.0})) == (
        "parallel.param_server.slow_workers.1: rank 1 is not a worker; worker ranks are 2 to 5")
    assert error_of(ps_with(slow_workers={"5": 0.5})).startswith(
        "parallel.param_server.slow_workers.5 = 0.5: expected a slow-down factor >= 1")
    assert error_of(ps_with(slow_workers={"x": 2})).startswith(
        "parallel.param_server.slow_workers.x: expected a worker rank")
    assert error_of(ps_with(sync="fast")).startswith(
        'parallel.param_server.sync = "fast": must be one of "soft", "bsp", "asp", "ssp"')
    assert error_of({"parallel": ps, "data": {"batch_size": 66}}).startswith(
        "data.batch_size = 66: must be divisible by parallel.param_server.workers = 4")
    assert error_of({"parallel": ps, "memory": {"policy": "swap"}}) == (
        'memory.policy = "swap": not available with parallel.strategy = "param_server" (use "keep")')
    assert error_of({"parallel": ps, "update": {"placement": "host"}}).startswith(
        'update.placement = "host": not available with parallel.strategy = "param_server"')


# --- a range of hosts (cluster.min_nnodes) ----------------------------------------------------------

HOSTS = {"nnodes": 4, "node_rank": 0, "rdzv_endpoint": "10.0.0.1:29400"}


def test_every_host_count_of_a_range_is_checked_and_refused_by_name():
    ok = config_from_dict({"cluster": {**HOSTS, "min_nnodes": 2},
                           "parallel": {"world_size": 8}, "data": {"batch_size": 24}})
    assert ok.cluster.min_nnodes == 2   # 4, 6 and 8 ranks all divide 24
    # 3 hosts of 4 (2 ranks each): 6 ranks do not divide 32
    assert error_of({"cluster": {**HOSTS, "min_nnodes": 2}, "parallel": {"world_size": 8},
                     "data": {"batch_size": 32}}) == (
        "with 3 of 4 hosts (parallel.world_size 6): data.batch_size = 32: must be divisible by "
        "parallel.world_size = 6 (e.g. 30 or 36)")
    assert error_of({"cluster": {**HOSTS, "min_nnodes": 5}, "parallel": {"world_size": 8}}) == (
        "cluster.min_nnodes = 5: must be at most cluster.nnodes = 4 (`--nnodes MIN:MAX`)")
    # a parameter server keeps its servers and a worker at every count
    assert error_of({"cluster": {**HOSTS, "min_nnodes": 1},
                     "parallel": {"strategy": "param_server", "world_size": 4,
                                  "param_server": {"servers": 1, "workers": 3}},
                     "data": {"batch_size": 24}, "optim": {"name": "sgd"}}) == (
        "with 1 of 4 hosts (parallel.world_size 1) the parameter server's 1 servers leave no worker: "
        "set cluster.min_nnodes above 1 or fewer servers")
    # a pipeline's stage count follows the world: a partition list fixes it
    assert error_of({"cluster": {**HOSTS, "min_nnodes": 2}, "parallel": {
        "strategy": "pipeline", "world_size": 4, "pipeline": {"partition": [["fc0"], ["act0"], ["fc1"], ["head"]]}}}
    ).startswith("parallel.pipeline.partition lists 4 stages: with a range of hosts")
    # an emulated rank must exist at the smallest count
    assert error_of({"cluster": {**HOSTS, "min_nnodes": 1}, "parallel": {"world_size": 8},
                     "data": {"batch_size": 24}, "emulate": {"slow_rank": 5, "slow_rank_ms": 1.0}}).startswith(
        "with 1 of 4 hosts (parallel.world_size 2): emulate.slow_rank = 5: no such rank")
