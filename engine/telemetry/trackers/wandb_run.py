"""The Weights & Biases tracker: one W&B run per launch, its files under `<run dir>/wandb/`.

    wandb sync runs/NAME/wandb/offline-run-*      # an offline run, uploaded later

Offline unless WANDB_MODE says otherwise or an API key is there (WANDB_API_KEY, or `wandb login`'s entry in
~/.netrc); online without a key is a failure said at the start, never a prompt. The W&B run's id is kept in
`<run dir>/wandb/run_id`: a resumed run goes on in the same W&B run online (resume="allow"); offline, where W&B
cannot resume, a new run names its parent (`resumed_from` in its config, and its notes). W&B's cache (its
service's logs among them) goes to `<run dir>/wandb/cache` unless WANDB_CACHE_DIR says where, and its service
process ends when the tracker closes (wandb.teardown).
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return bool(netrc.netrc().authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE where it is set, else online with an API key, else offline."""
    return os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_dir: Path, resumed: bool):
        self.entity, _, self.project = project.rpartition("/")
        self.run_dir, self.folder, self.resumed = Path(run_dir), Path(run_dir) / "wandb", resumed
        self.run = None
        self.mode = wandb_mode()
        self.step = 0   # W&B keeps a run's steps increasing: a restart's repeated steps are left out
        self._cache_set = False

    @property
    def where(self) -> str:
        if self.run is None:
            return "wandb (no run started)"
        folder = Path(self.run.dir).parent
        sync = f" (upload: wandb sync {folder})" if self.mode == "offline" else ""
        return f"wandb {self.mode} in {folder}{sync}"

    def start(self, run_start: dict) -> None:
        if self.run is not None:   # a restart within this launch goes on in the same W&B run
            return
        if self.mode == "online" and not has_api_key():
            raise RuntimeError("WANDB_MODE=online but no API key: set WANDB_API_KEY or run `wandb login`")
        self.folder.mkdir(parents=True, exist_ok=True)
        if "WANDB_CACHE_DIR" not in os.environ:   # read by the service process, started by init
            os.environ["WANDB_CACHE_DIR"] = str(self.folder / "cache")
            self._cache_set = True
        import wandb
        id_file = self.folder / "run_id"
        parent = id_file.read_text().strip() if self.resumed and id_file.is_file() else None
        first = run_start.get("first_step", 0)
        config, notes, same = dict(run_start.get("config", {})), None, {}
        if parent and self.mode == "online":
            same = {"id": parent, "resume": "allow"}
        elif parent:
            config["resumed_from"] = parent
            notes = f"resumes W&B run {parent} from its checkpoint at step {first}"
        settings = wandb.Settings(mode=self.mode, silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True)   # the launcher's own CPU is not the run's
        self.run = wandb.init(project=self.project, entity=self.entity or None, name=run_start.get("name"),
                              dir=str(self.run_dir), config=config, notes=notes, settings=settings, **same)
        id_file.write_text(self.run.id)
        self.step = first

    def scalars(self, step: int, values: dict) -> None:
        if step >= self.step and values:
            self.step = step
            self.run.log(values, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.scalars(step, {tag: text})

    def close(self) -> None:
        import wandb
        try:
            if self.run is not None:
                self.run.finish()
        finally:
            wandb.teardown()   # ends the service process
            if self._cache_set:
                os.environ.pop("WANDB_CACHE_DIR", None)
