"""The optional packages a config needs are installed, checked before any worker starts (a CROSS_CHECKS rule of
engine/config/check.py): a tracker's (tensorboard, wandb). Looked up, never imported. Imports only the
standard library and engine.config.settings."""

from __future__ import annotations

from importlib.util import find_spec

from engine.config.settings import Config

# telemetry key -> (the package it needs, the pyproject extra that installs it)
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tb"), "wandb": ("wandb", "wandb")}


def trackers_installed(cfg: Config) -> str | None:
    """A tracker that is on (telemetry.tensorboard, telemetry.wandb) has its package installed on host 0, whose
    launcher runs the trackers (docs/telemetry.md, Trackers)."""
    if cfg.cluster.node_rank:
        return None
    for key, (package, extra) in TRACKER_PACKAGES.items():
        if getattr(cfg.telemetry, key) and find_spec(package) is None:
            return f"telemetry.{key} is on but {package} is not installed: pip install -e '.[{extra}]'"
    return None
