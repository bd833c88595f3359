"""The Python API, exactly as README.md shows it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(120)
def test_the_readme_example_trains_a_users_own_model(tmp_path):
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## Bring your own model.*?```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=100, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                              "PYTHONPATH": str(ROOT)}, start_new_session=True)
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.9
    assert (tmp_path / "runs" / "my-model" / "checkpoints").is_dir()


def test_train_refuses_a_model_that_is_not_a_layer_list():
    import torch.nn as nn

    import engine
    with pytest.raises(TypeError, match="LayerList"):
        engine.train({}, model=nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_readme_hugging_face_example_trains_a_llama_on_a_token_file(tmp_path):
    import numpy as np
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"\*\*A Hugging Face decoder, as it is\.\*\*.*?```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "example.py").write_text(example)
    rng = np.random.default_rng(0)   # the README's token files: ids below its models' vocab_size
    rng.integers(0, 512, 20_000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 512, 4_000).astype(np.uint16).tofile(tmp_path / "val.bin")
    result = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=170, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                              "PYTHONPATH": str(ROOT)}, start_new_session=True)
    assert result.returncode == 0, result.stderr
    assert "'embed', 'block0', 'block1', 'block2', 'block3', 'norm', 'head'" in result.stdout
    assert float(re.search(r"final loss ([0-9.]+)", result.stdout).group(1)) < 6.3   # ln 512 = 6.24 at the start


@pytest.mark.timeout(120)
def test_a_users_own_loss_trains_a_regression(tmp_path):
    """engine.train(..., loss_fn=f): f is the mean over a share's samples; ranks weigh alike, so world 2 equals
    one process, and a regression reports no accuracy."""
    script = tmp_path / "regress.py"
    script.write_text('''
import json, sys, torch, torch.nn as nn, torch.nn.functional as F
import engine

def mse(out, y):
    return F.mse_loss(out, y)

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g); y = x @ torch.randn(8, 1, generator=g)
    data = engine.tensor_dataset(x[:192], y[:192], x[192:], y[192:])
    out = {}
    for world in (1, 2):
        torch.manual_seed(0)
        model = engine.LayerList([("fc", nn.Linear(8, 1))])
        s = engine.train({"run": {"name": f"r{world}", "steps": 100}, "parallel": {"world_size": world},
                          "data": {"batch_size": 32}, "optim": {"lr": 0.05}}, model=model, data=data, loss_fn=mse)
        out[world] = [s["final_loss"], s["test_accuracy"], model.layers[0].weight.detach().flatten().tolist()]
    print(json.dumps(out))
''')
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=110, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                              "PYTHONPATH": str(ROOT)}, start_new_session=True)
    assert result.returncode == 0, result.stderr
    import json
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["1"][1] is None and out["2"][1] is None   # no classes: no accuracy
    assert out["1"][0] < 0.05   # learned: the targets are a linear function of x
    assert out["2"][0] == pytest.approx(out["1"][0], abs=1e-6)
    assert out["2"][2] == pytest.approx(out["1"][2], abs=1e-6)
