"""Checks that turn a config table (parsed TOML plus `--set` overrides) into a Config.

    from engine.config import config_from_dict      # the public door to these checks
    cfg = config_from_dict({"optim": {"lr": 0.1}, "data": {"batch_size": 32}})

Every problem is a ConfigError with one line that starts with the key path, shows the
bad value as it would be written in TOML and says what is allowed:

    optim.lr = "fast": expected a number (float) >= 0.0
    data.batch_size = 0: must be >= 1
    unknown key 'optim.lrr' (did you mean 'optim.lr'?); allowed keys in [optim]: name, lr, ...

Per-key checks run first (type, range, choices, pattern), then the rules that relate
keys to each other (rules.py: CROSS_CHECKS); the first problem found is reported.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from typing import Any, Callable

from engine.config.declare import show
from engine.config.parallel import MOVED
from engine.config.rules import CROSS_CHECKS  # noqa: F401  (engine/config/reference.py reads them here)
from engine.config.settings import PATTERN_WORDS, Config, ConfigError, parse_size

SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
SIZE_WORDS = '"auto" or a positive size like "512MiB", "2GiB" or a number of bytes'
_TYPE_WORDS = {"int": "an integer (int)", "float": "a number (float)",
               "bool": "true or false (bool)", "str": "a string (str)"}


def did_you_mean(word: Any, candidates, quote: Callable[[str], str] = show) -> str:
    names = [str(c) for c in candidates]
    lowered = [n for n in names if n.lower() == str(word).lower()]  # 'DDP' -> 'ddp'
    close = lowered or difflib.get_close_matches(str(word), names, n=1)
    return f" (did you mean {quote(close[0])}?)" if close else ""


def range_words(meta) -> str:
    lo, hi = meta["min"], meta["max"]
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else (f"<= {hi}" if hi is not None else "")


def allowed_words(path: str, f: dataclasses.Field) -> str:
    """What a key accepts, in the words the messages and docs/config.md use."""
    meta = f.metadata
    if meta["kind"] == "size":
        return SIZE_WORDS
    if meta["kind"] == "placement":
        return PLACEMENT_WORDS
    if meta["kind"] == "policy":
        return POLICY_WORDS
    if meta["kind"] == "partition":
        return PARTITION_WORDS
    if meta["kind"] == "slow_workers":
        return SLOW_WORDS
    if meta["choices"]:
        return "one of " + ", ".join(show(c) for c in meta["choices"])
    if meta["pattern"]:
        return PATTERN_WORDS.get(path, f"text matching the pattern {meta['pattern']}")
    return range_words(meta)


def check_config_table(data: Any, renamed: list[str] | None = None) -> Config:
    """The Config of a table of sections. A strategy's key written by its old, flat name (`parallel.streams`)
    is moved into its table and a line naming the new place is added to `renamed` (and to `Config.renamed`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a table of sections, got {show(data)}")
    renamed = [] if renamed is None else renamed
    sections = {}
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(_unknown_section(name))
        sections[name] = _check_table(name, SECTIONS[name], table, renamed)
    cfg = Config(**sections)
    for check in CROSS_CHECKS:
        problem = check(cfg)
        if problem:
            raise ConfigError(problem)
    cfg.renamed = tuple(dict.fromkeys(renamed))
    return cfg


def _keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _unknown_section(name: Any) -> str:
    owners = [f"{s}.{name}" for s in SECTIONS if name in _keys(s)]  # a key written outside its section
    hint = f" (did you mean '{owners[0]}'?)" if owners else did_you_mean(name, SECTIONS, "'{}'".format)
    return f"unknown section '{name}'{hint}; allowed sections: {', '.join(SECTIONS)}"


def _check_table(path: str, cls: type, table: Any, renamed: list[str]) -> Any:
    """A section (`parallel`) or a table inside one (`parallel.sharded`), checked key by key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(table, dict):
        raise ConfigError(f"{path} = {show(table)}: expected a table of settings ([{path}] in TOML); "
                          f"keys: {', '.join(fields)}")
    values = {}
    for key, value in _move_flat_keys(path, table, renamed).items():
        if key not in fields:
            hint = did_you_mean(key, fields, lambda k: f"'{path}.{k}'")
            raise ConfigError(f"unknown key '{path}.{key}'{hint}; allowed keys in [{path}]: {', '.join(fields)}")
        f = fields[key]
        if f.metadata["kind"] == "table":
            values[key] = _check_table(f"{path}.{key}", f.default_factory, value, renamed)
        else:
            values[key] = check_value(f"{path}.{key}", f, value)
    return cls(**values)


def _move_flat_keys(path: str, table: dict, renamed: list[str]) -> dict:
    """`table` with each key written by its old, flat name (MOVED) moved into the table it lives in now."""
    moved = MOVED.get(path, {})
    if not any(key in moved for key in table):
        return table
    out = {key: value for key, value in table.items() if key not in moved}
    for key, value in table.items():
        if key not in moved:
            continue
        inner, new = out.get(moved[key], {}), f"{path}.{moved[key]}.{key}"
        if not isinstance(inner, dict):   # that table's own check names the problem
            return table
        if key in inner:
            raise ConfigError(f"{path}.{key} and {new} are one setting, set twice: keep {new}")
        out[moved[key]] = {**inner, key: value}
        renamed.append(rename_line(f"{path}.{key}", new))
    return out


def rename_line(old: str, new: str) -> str:
    return f"{old} is now {new} (the old name still works; docs/config.md lists the old names)"


def check_value(path: str, f: dataclasses.Field, value: Any) -> Any:
    """One key's value, converted (int -> float, int size -> str); ConfigError if not allowed."""
    meta = f.metadata
    if meta["kind"] == "size":
        return _check_size(path, value)
    if meta["kind"] == "placement":
        return _check_placement(path, value)
    if meta["kind"] == "policy":
        return _check_policy(path, value)
    if meta["kind"] == "partition":
        return _check_partition(path, value)
    if meta["kind"] == "slow_workers":
        return _check_slow_workers(path, value)
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if not ok:
        allowed = allowed_words(path, f)
        extra = f"; write {int(value)}, without the decimal point" if (
            kind == "int" and isinstance(value, float) and value.is_integer()) else ""
        sep = ", " if meta["choices"] or meta["pattern"] else " "
        raise ConfigError(f"{path} = {show(value)}: expected {_TYPE_WORDS[kind]}"
                          f"{sep + allowed if allowed else ''}{extra}")
    if kind == "float":
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path} = {show(value)}: must be a finite number {range_words(meta)}".rstrip())
    lo, hi = meta["min"], meta["max"]
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{path} = {show(value)}: must be {range_words(meta)}")
    choices = meta["choices"]
    if choices and value not in choices:
        listed = ", ".join(show(c) for c in choices)
        raise ConfigError(f"{path} = {show(value)}: must be one of {listed}{did_you_mean(value, choices)}")
    if meta["pattern"] and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(f"{path} = {show(value)}: must be {allowed_words(path, f)}")
    return value


PLACEMENT_WORDS = '"auto", "device", "host", or a table of layer names to "device" or "host"'
POLICY_WORDS = '"keep", "swap", "recompute", "auto", or a table of layer names to "keep", "swap" or "recompute"'


def _check_per_layer(path: str, value: Any, per_layer: tuple[str, ...], words: str) -> str | dict:
    """`auto`, one of `per_layer` for every layer, or a table of layer names to one of `per_layer`."""
    if isinstance(value, str):
        if value not in per_layer + ("auto",):
            raise ConfigError(f"{path} = {show(value)}: expected {words}{did_you_mean(value, per_layer + ('auto',))}")
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{path} = {show(value)}: expected {words}")
    listed = ", ".join(f'"{c}"' for c in per_layer[:-1]) + f' or "{per_layer[-1]}"'
    for layer, choice in value.items():
        if choice not in per_layer:
            hint = did_you_mean(choice, per_layer) if isinstance(choice, str) else ""
            raise ConfigError(f"{path}.{layer} = {show(choice)}: must be {listed}{hint}")
    return dict(value)


def _check_placement(path: str, value: Any) -> str | dict:
    return _check_per_layer(path, value, ("device", "host"), PLACEMENT_WORDS)


def _check_policy(path: str, value: Any) -> str | dict:
    return _check_per_layer(path, value, ("keep", "swap", "recompute"), POLICY_WORDS)


PARTITION_WORDS = '"uniform", "balanced", or a list of stages, each a non-empty list of layer names'


def _check_partition(path: str, value: Any) -> str | list:
    if value in ("uniform", "balanced"):
        return value
    if isinstance(value, str):
        raise ConfigError(f"{path} = {show(value)}: expected {PARTITION_WORDS}"
                          f"{did_you_mean(value, ('uniform', 'balanced'))}")
    if not isinstance(value, list) or not value or not all(
            isinstance(stage, list) and stage and all(isinstance(n, str) for n in stage) for stage in value):
        raise ConfigError(f"{path} = {show(value)}: expected {PARTITION_WORDS}")
    return [list(stage) for stage in value]


SLOW_WORDS = "a table of worker ranks to slow-down factors >= 1, e.g. {5 = 3.0}"


def _check_slow_workers(path: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path} = {show(value)}: expected {SLOW_WORDS}")
    out = {}
    for rank, factor in value.items():
        if not str(rank).isdigit():
            raise ConfigError(f"{path}.{rank}: expected a worker rank (a whole number), e.g. {path}.5 = 3.0")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor < 1:
            raise ConfigError(f"{path}.{rank} = {show(factor)}: expected a slow-down factor >= 1 (3.0: three "
                              f"times slower)")
        out[str(int(rank))] = float(factor)
    return out


def _check_size(path: str, value: Any) -> str:
    try:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError
        if value != "auto":
            parse_size(value)
    except ValueError:
        raise ConfigError(f"{path} = {show(value)}: expected {SIZE_WORDS}") from None
    return str(value)


# --- overrides: --set section.key=value, --set section.table.key=value ---------------------

def parse_override(text: str) -> tuple[list[str], Any]:
    """'data.batch_size=32' -> (['data', 'batch_size'], 32); 'parallel.sharded.streams=4' -> (['parallel',
    'sharded', 'streams'], 4); the value is read as TOML, else as text."""
    name, eq, raw = str(text).partition("=")
    parts = name.strip().split(".")
    if not eq or not 2 <= len(parts) <= 3 or not all(parts) or (len(parts) == 3 and _field_type(parts[:2]) != "table"):
        raise ConfigError(f"--set {show(str(text))}: expected the form --set section.key=value "
                          f"(e.g. --set run.steps=50, --set parallel.sharded.streams=4)")
    raw = raw.strip()
    try:
        parsed = tomllib.loads("v = " + raw)
        value = parsed["v"] if list(parsed) == ["v"] else raw  # 'x\ny = 1' stays text
    except tomllib.TOMLDecodeError:
        value = raw  # run.name=foo, device.memory=2GiB
    if not isinstance(value, str) and _field_type(parts) == "str":
        value = raw  # run.name=2024 means the text "2024"
    return parts, value


def _field_type(parts: list[str]) -> str | None:
    """The kind of setting `parts` name (section, [table,] key): its declared kind ("table" for a table inside
    a section, "size", ...) or its type; None for no such setting."""
    cls = SECTIONS.get(parts[0])
    for i, name in enumerate(parts[1:], 1):
        f = next((f for f in dataclasses.fields(cls) if f.name == name), None) if cls else None
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.metadata["kind"] or str(f.type)
        cls = f.default_factory if f.metadata["kind"] == "table" else None
    return None


def apply_overrides(table: dict, overrides, renamed: list[str] | None = None) -> dict:
    """`overrides` written into `table`; an old, flat name (`parallel.streams`) goes to its new place, named in
    `renamed`, and replaces what the file set there."""
    for text in [overrides] if isinstance(overrides, str) else overrides:
        parts, value = parse_override(text)
        moved = MOVED.get(parts[0], {})
        if len(parts) == 2 and parts[1] in moved:
            new = [parts[0], moved[parts[1]], parts[1]]
            if renamed is not None:
                renamed.append(rename_line(".".join(parts), ".".join(new)))
            parts = new
        target = table.setdefault(parts[0], {})
        if len(parts) == 3 and isinstance(target, dict):
            if moved.get(parts[2]) == parts[1]:   # the file's flat name of the same key: replaced too
                target.pop(parts[2], None)
            target = target.setdefault(parts[1], {})
        if isinstance(target, dict):  # otherwise the table's own check reports the file's value
            target[parts[-1]] = value
    return table
