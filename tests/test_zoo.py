"""Every built-in model trains end to end on its data through the CLI."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model,data,extra", [
    ("transformer", "text", ["model.depth=1", "model.d_model=32", "data.seq_len=16", "data.text_chars=20000",
                             "optim.name=adamw", "optim.lr=0.003"]),
    ("branchy", "digits", ["model.depth=1", "model.channels=4"]),
    ("mlp", "synthetic", ["data.samples=1024", "data.features=16"]),
])
def test_each_model_trains_on_its_data(cli, model, data, extra):
    log = cli.tmp_path / "run.jsonl"
    sets = [arg for kv in [f"model.name={model}", f"data.name={data}", *extra] for arg in ("--set", kv)]
    r = cli.run("run", DEMO, "--headless", "--steps", "30", *cli.base_args(model), *sets,
                "--telemetry-log", str(log))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(log)
    losses = [rec["loss"] for rec in records if rec["type"] == "step"]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5])   # it learns
    assert records[-1]["test_accuracy"] is not None
