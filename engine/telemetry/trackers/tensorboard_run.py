"""The TensorBoard tracker: `<run dir>/tb/`, written with torch.utils.tensorboard's SummaryWriter.

    tensorboard --logdir runs/NAME/tb

The config is recorded as hparams (HPARAMS tab, `section.key`), the figures as scalars, events as text. A fresh
start empties tb/; a resumed run (or a restart within a launch) writes on in the same folder with `purge_step`
at its checkpoint's next step, so TensorBoard drops what the earlier attempt wrote past the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FLUSH_S = 5   # how stale a TensorBoard watching the folder may be


def flat_config(config: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}; what hparams cannot hold (a list, a table) as JSON text."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= flat_config(value, f"{prefix}{key}.")
        elif isinstance(value, (bool, int, float, str)):
            flat[f"{prefix}{key}"] = value
        else:
            flat[f"{prefix}{key}"] = json.dumps(value)
    return flat


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, folder: Path, resumed: bool):
        self.folder, self.resumed = Path(folder), resumed
        self.writer = None
        self.step = 0   # the latest step written

    @property
    def where(self) -> str:
        return f"tensorboard in {self.folder}"

    def start(self, run_start: dict) -> None:
        first = run_start.get("first_step", 0)
        if self.writer is not None:   # a restart within this launch
            if first >= self.step:
                return
            self.writer.close()
        elif not self.resumed:
            shutil.rmtree(self.folder, ignore_errors=True)   # an earlier run's, overwritten
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        purge = first + 1 if self.resumed or self.writer is not None else None
        reopened = self.writer is not None
        self.writer = SummaryWriter(str(self.folder), purge_step=purge, flush_secs=FLUSH_S)
        if not reopened:
            for summary in hparams(flat_config(run_start.get("config", {})), {"train/loss": 0.0}):
                self.writer.file_writer.add_summary(summary)
        self.step = first

    def scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.step = max(self.step, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
