"""How a setting is declared (setting(): its default, allowed values and one line of docs), the error a bad
value raises, sizes ("512MiB") parsed and printed, and a value spelled as in TOML for messages (show). Everything in engine/config builds on it.

Imports nothing of the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def setting(default: Any, doc: str, *, choices: tuple | None = None,
            min: float | None = None, max: float | None = None,
            pattern: str | None = None, kind: str | None = None) -> Any:
    meta = {"doc": doc, "choices": choices, "min": min, "max": max,
            "pattern": pattern, "kind": kind}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def table(cls: type) -> Any:
    """A table inside a section (`[parallel.sharded]`): its own settings, documented by its class."""
    return field(default_factory=cls, metadata={"doc": cls.__doc__, "choices": None, "min": None, "max": None,
                                                "pattern": None, "kind": "table"})


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError("must be positive")
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError("not a size like '512MiB', '2GiB' or a number of bytes")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError("must be positive")
    return value


def format_size(n: float) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB (the inverse of parse_size, for messages)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# A `pattern` key's rule in words, for messages and docs (the regex is the rule itself).
PATTERN_WORDS = {"run.name": "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                 "cluster.interface": "a network interface name (up to 15 letters, digits, '_', '.', ':', '@' "
                                      "or '-'), or empty",
                 "telemetry.trace_steps": "steps as `FIRST-LAST` or `N` (1-based, like `20-22`), or empty"}


def show(value: Any) -> str:
    """A value spelled as in TOML, so a message quotes what the person wrote."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {show(v)}" for k, v in value.items()) + "}"
    return str(value)  # int, float (inf/nan as TOML spells them), dates
