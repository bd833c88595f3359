"""`trainyard plan` (docs/plan.md): the layouts of hosts x devices on paper, no worker, the model on meta. The
8B figures are checked against a hand count of the Llama-3-8B shapes (tests/fixtures/plan/llama3_8b.json)."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.plan import make_plan, table, to_json
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "plan"
CFG_8B = FIXTURES / "llama3_8b.toml"
ON_META = [f"model.hf_config={FIXTURES / 'llama3_8b.json'}"]   # wherever pytest runs from
DEMO = ROOT / "demo" / "configs" / "text_sharded.toml"

# Llama-3-8B, by hand: hidden 4096, intermediate 14336, 32 layers, 8 KV heads of 128, vocab 128256, untied
H, I, L, KV, V = 4096, 14336, 32, 8 * 128, 128256
BLOCK = [H * H, H * KV, H * KV, H * H, H * I, H * I, I * H, H, H]   # q k v o gate up down, two norms
LAYER = {"embed": [V * H], "norm": [H], "head": [V * H], **{f"block{i}": BLOCK for i in range(L)}}
P = sum(sum(t) for t in LAYER.values())
TENSORS = sum(len(t) for t in LAYER.values())


def adam_on_device(shapes: list[int]) -> dict[str, int]:
    """bf16 weights and gradients, fp32 master, AdamW's two fp32 moments and its fp32 step counter a tensor."""
    n = sum(shapes)
    return dict(parameters=2 * n, gradients=2 * n, master=4 * n, optimizer_state=8 * n + 4 * len(shapes))


@pytest.fixture(scope="module")
def plan_8b():
    return make_plan(CFG_8B, 8, 8, "80GB", ON_META)


def test_the_hand_count_is_llama_3_8b():
    assert P == 8_030_261_248 and TENSORS == 291


def test_8b_on_64_devices_of_80gb_ddp_does_not_fit_some_pipeline_and_sharded_layouts_do(plan_8b):
    rows = {(r["layout"], r["weights"], r["updates"]): r for r in json.loads(to_json(plan_8b)[0])["layouts"]}
    ddp = rows["ddp", "bf16", "device"]
    assert ddp["configured"] and ddp["fits"] == "no"
    assert {k: ddp[k] for k in adam_on_device([0])} == adam_on_device(sum(LAYER.values(), []))
    assert 16 * P > 80 * 10**9   # 128 GB of weights and state alone
    assert ddp["need_bytes"] > 80 * 10**9
    # host updates take the master and the moments off the device: it fits then, and the row says so
    assert rows["ddp", "bf16", "host"]["master"] == rows["ddp", "bf16", "host"]["optimizer_state"] == 0
    fitting = [r for r in rows.values() if r["configured"] and r["fits"] != "no"]
    assert any(r["strategy"] == "pipeline" and r["data"] == "sharded" for r in fitting)
    assert any(r["strategy"] == "pipeline" and r["data"] == "ddp" for r in fitting)
    for r in fitting:
        assert r["need_bytes" if r["fits"] == "keep" else "recompute_need_bytes"] <= 80 * 10**9
    # a pipeline's tightest stage holds its own layers' weights and state, by hand
    p8 = rows["pipeline 8 + ddp", "bf16", "device"]
    assert [len(s) for s in p8["stage_layers"]] == [5, 5, 5, 4, 4, 4, 4, 4]   # 35 clusters, uniform
    mine = sum((LAYER[n] for n in p8["stage_layers"][p8["stage"]]), [])
    assert {k: p8[k] for k in adam_on_device([0])} == adam_on_device(mine)
    # sharded: whole weights and gradients everywhere; the state of what the largest owner holds
    sh = rows["sharded", "bf16", "device"]
    assert sh["parameters"] == 2 * P and sh["gradients"] > 2 * P   # and its receive buffers
    assert 4 * V * H <= sh["master"] < 4 * P // 10   # the embedding's owner: far below ddp's whole copy
    # the batch of 64 does not split into 32 replicas x 8 micro-batches: said, not fitted
    assert "does not split" in rows["pipeline 2 + ddp", "bf16", "device"]["problem"]


def test_8b_table_lists_every_layout_with_its_figures(plan_8b):
    lines = table(plan_8b)
    assert "8,030,261,248 parameters" in lines[0] and "world 64" in lines[0]
    assert lines[1].split()[:2] == ["layout", "S"]
    body = lines[2:-1]
    assert body[0].startswith("ddp ") and body[0].split()[-1] == "no"
    for label in ("sharded", "pipeline 8 + ddp", "pipeline 8 + sharded", "pipeline 32 + sharded"):
        assert any(line.startswith(label + " ") for line in body), label
    assert any(line.split()[-1] in ("keep", "recompute") for line in body)
    assert "25% more" in lines[-1]


def test_nothing_fits_a_tiny_device_exit_2_with_the_smallest_need(capsys):
    assert main(["plan", str(DEMO), "--hosts", "1", "--per-host", "4", "--memory", "64KiB"]) == 2
    out = capsys.readouterr().out
    assert "no layout fits 64.0 KiB a device: the smallest need is" in out and "recompute floor" in out


def test_a_demo_config_plans_from_its_own_device_memory(capsys):
    assert main(["plan", str(DEMO), "--hosts", "2", "--per-host", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["capacity_bytes"] == 16 * 2**20 and found["world"] == 4
    labels = {r["layout"] for r in found["layouts"]}
    assert {"ddp", "sharded", "pipeline 2 + ddp", "pipeline 2 + sharded", "pipeline 4"} <= labels
    ddp = next(r for r in found["layouts"] if r["layout"] == "ddp" and r["configured"])
    assert ddp["fits"] == "keep" and ddp["weights"] == "fp32" and ddp["master"] == 0
    assert ddp["optimizer_state"] > 2 * ddp["parameters"]   # AdamW's two moments and a step counter a tensor


@pytest.mark.parametrize("args,said", [
    (["--hosts", "0", "--per-host", "8"], "plan refused: --hosts 0"),
    (["--hosts", "2", "--per-host", "2", "--memory", "lots"], "plan refused: --memory 'lots'"),
    (["--hosts", "2", "--per-host", "2", "--set", "optim.lrr=1"], "config error: unknown key 'optim.lrr'"),
    (["--hosts", "2", "--per-host", "2", "--set", "device.memory=auto"], 'device.memory = "auto"'),
])
def test_a_bad_flag_or_config_is_named_exit_2(capsys, args, said):
    assert main(["plan", str(DEMO), *args]) == 2
    assert said in capsys.readouterr().err


def test_a_missing_flag_is_argparses(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(DEMO), "--hosts", "2"])
    assert e.value.code == 2 and "--per-host" in capsys.readouterr().err
