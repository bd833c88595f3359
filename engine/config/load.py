"""Read a config: a TOML file, then `--set` overrides, then every check (engine/config/check.py).

    cfg = load_config("demo/configs/digits_ddp.toml", overrides=["run.steps=50"])
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

from engine.config.check import apply_overrides, check_config_table
from engine.config.settings import Config, ConfigError


def config_from_dict(data: dict) -> Config:
    """Check a table of sections (as parsed from TOML) and build the Config; missing keys
    keep their defaults. Raises ConfigError naming the first problem."""
    return check_config_table(data)


def load_config(path: str | Path | None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read a TOML file (None: defaults only) over `base`, apply `--set section.key=value`
    overrides, and check the result."""
    table = copy.deepcopy(base) if base else {}
    if path is not None:
        for section, values in read_toml(path).items():
            if isinstance(values, dict) and isinstance(table.get(section), dict):
                table[section].update(values)
            else:
                table[section] = values
    renamed: list[str] = []
    return check_config_table(apply_overrides(table, overrides, renamed), renamed)


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
