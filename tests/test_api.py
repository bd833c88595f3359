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
