"""Checks that turn a config table (parsed TOML plus `--set` overrides) into a Config.

    from engine.config import config_from_dict      # the public door to these checks
    cfg = config_from_dict({"optim": {"lr": 0.1}, "data": {"batch_size": 32}})

Every problem is a ConfigError with one line that starts with the key path, shows the
bad value as it would be written in TOML and says what is allowed:

    optim.lr = "fast": expected a number (float) >= 0.0
    data.batch_size = 0: must be >= 1
    unknown key 'optim.lrr' (did you mean 'optim.lr'?); allowed keys in [optim]: name, lr, ...

Per-key checks run first (type, range, choices, pattern), then the rules that relate
keys to each other (CROSS_CHECKS); the first problem found is reported.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import ipaddress
import math
import re
import tomllib
from typing import Any, Callable

from engine.config.batch import batch_splits_over_ranks, near_multiples, schedule_ends_low
from engine.config.files import files_exist
from engine.config.settings import PATTERN_WORDS, Config, ConfigError, parse_size

SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
SIZE_WORDS = '"auto" or a positive size like "512MiB", "2GiB" or a number of bytes'
_TYPE_WORDS = {"int": "an integer (int)", "float": "a number (float)",
               "bool": "true or false (bool)", "str": "a string (str)"}


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


def check_config_table(data: Any) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a table of sections, got {show(data)}")
    sections = {}
    for name, table in data.items():
        if name not in SECTIONS:
            raise ConfigError(_unknown_section(name))
        if not isinstance(table, dict):
            raise ConfigError(f"{name} = {show(table)}: expected a table of settings ([{name}] in TOML); "
                              f"keys: {', '.join(_keys(name))}")
        sections[name] = _check_section(name, table)
    cfg = Config(**sections)
    for check in CROSS_CHECKS:
        problem = check(cfg)
        if problem:
            raise ConfigError(problem)
    return cfg


def _keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _unknown_section(name: Any) -> str:
    owners = [f"{s}.{name}" for s in SECTIONS if name in _keys(s)]  # a key written outside its section
    hint = f" (did you mean '{owners[0]}'?)" if owners else did_you_mean(name, SECTIONS, "'{}'".format)
    return f"unknown section '{name}'{hint}; allowed sections: {', '.join(SECTIONS)}"


def _check_section(section: str, table: dict) -> Any:
    cls = SECTIONS[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            hint = did_you_mean(key, fields, lambda k: f"'{section}.{k}'")
            raise ConfigError(f"unknown key '{section}.{key}'{hint}; "
                              f"allowed keys in [{section}]: {', '.join(fields)}")
        values[key] = check_value(f"{section}.{key}", fields[key], value)
    return cls(**values)


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


# --- overrides: --set section.key=value ------------------------------------------------

def parse_override(text: str) -> tuple[str, str, Any]:
    """'data.batch_size=32' -> ('data', 'batch_size', 32); the value is read as TOML, else as text."""
    name, eq, raw = str(text).partition("=")
    parts = name.strip().split(".")
    if not eq or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {show(str(text))}: expected the form --set section.key=value "
                          f"(e.g. --set run.steps=50)")
    section, key = parts
    raw = raw.strip()
    try:
        parsed = tomllib.loads("v = " + raw)
        value = parsed["v"] if list(parsed) == ["v"] else raw  # 'x\ny = 1' stays text
    except tomllib.TOMLDecodeError:
        value = raw  # run.name=foo, device.memory=2GiB
    if not isinstance(value, str) and _field_type(section, key) == "str":
        value = raw  # run.name=2024 means the text "2024"
    return section, key, value


def _field_type(section: str, key: str) -> str | None:
    fields = dataclasses.fields(SECTIONS[section]) if section in SECTIONS else ()
    f = next((f for f in fields if f.name == key), None)
    return None if f is None else f.metadata["kind"] or str(f.type)


def apply_overrides(table: dict, overrides) -> dict:
    for text in [overrides] if isinstance(overrides, str) else overrides:
        section, key, value = parse_override(text)
        target = table.setdefault(section, {})
        if isinstance(target, dict):  # otherwise the section's own check reports the file's value
            target[key] = value
    return table


# --- rules across keys: each returns a message or None; its docstring goes to docs/config.md ---

def model_matches_data(cfg: Config) -> str | None:
    """Language models take token data (`text` or `tokens`), and token data needs a language model."""
    model, data = cfg.model.name, cfg.data.name
    if model == "user":   # engine.train's model: it is the user's to fit their data
        return None
    if model in ("transformer", "hf") and data not in ("text", "tokens"):
        return (f'model.name = {show(model)}: requires data.name = "text" or "tokens" '
                f'(got data.name = {show(data)})')
    if data in ("text", "tokens") and model not in ("transformer", "hf"):
        return (f'data.name = {show(data)}: requires model.name = "transformer" or "hf" '
                f'(got model.name = {show(model)})')
    return None


def branchy_has_square_images(cfg: Config) -> str | None:
    """`model.name = "branchy"` needs square images: `data.name = "digits"`, or `"synthetic"`
    with `data.features` a perfect square."""
    if cfg.model.name != "branchy":
        return None
    if cfg.data.name not in ("digits", "synthetic"):
        return (f'model.name = "branchy": requires data.name = "digits" or "synthetic" '
                f"(got data.name = {show(cfg.data.name)})")
    n = cfg.data.features
    root = math.isqrt(n)
    if cfg.data.name == "synthetic" and root * root != n:
        return (f'data.features = {n}: must be a perfect square when model.name = "branchy" '
                f"(e.g. {root * root} or {(root + 1) ** 2})")
    return None


def param_server_ranks(cfg: Config) -> str | None:
    """param_server: `parallel.servers + parallel.workers = parallel.world_size`; `slow_workers` names
    worker ranks only; `memory.policy = "keep"` and `update.placement = "device"` (the servers update;
    the workers keep their activations)."""
    p = cfg.parallel
    if p.strategy != "param_server":
        return None
    if p.servers + p.workers != p.world_size:
        return (f"parallel.servers = {p.servers} + parallel.workers = {p.workers} must equal parallel.world_size "
                f"= {p.world_size} (set world_size = {p.servers + p.workers})")
    for rank in p.slow_workers:
        if not p.servers <= int(rank) < p.world_size:
            return (f"parallel.slow_workers.{rank}: rank {rank} is not a worker; worker ranks are "
                    f"{p.servers} to {p.world_size - 1}")
    if cfg.memory.policy != "keep":
        return (f'memory.policy = {show(cfg.memory.policy)}: not available with parallel.strategy = '
                f'"param_server" (use "keep")')
    if cfg.update.placement != "device":
        return (f'update.placement = {show(cfg.update.placement)}: not available with parallel.strategy = '
                f'"param_server" (its servers run the updates; use "device")')
    return None


def heads_split_width(cfg: Config) -> str | None:
    """transformer: `model.d_model` is divisible by `model.heads`."""
    d_model, heads = cfg.model.d_model, cfg.model.heads
    if cfg.model.name == "transformer" and d_model % heads:
        return (f'model.d_model = {d_model}: must be divisible by model.heads = {heads} when '
                f'model.name = "transformer" (e.g. {near_multiples(d_model, heads)})')
    return None


def listen_is_loopback(cfg: Config) -> str | None:
    """`telemetry.listen` is empty or `tcp://HOST:PORT` with a loopback HOST (127.0.0.1, ::1, localhost)."""
    listen = cfg.telemetry.listen
    if not listen:
        return None
    m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", listen)
    if not m or int(m.group(2)) > 65535:
        return f'telemetry.listen = {show(listen)}: expected "tcp://127.0.0.1:PORT" (PORT 0 to 65535)'
    host = m.group(1).strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return (f"telemetry.listen = {show(listen)}: only loopback addresses (127.0.0.1, [::1], localhost) "
                f"are allowed; reach a remote run through an SSH tunnel")
    return None


def slices_cover_streams(cfg: Config) -> str | None:
    """`parallel.slices` must be at least `parallel.streams`: every stream carries at least one slice."""
    p = cfg.parallel
    if p.slices < p.streams:
        return (f"parallel.slices = {p.slices} is smaller than parallel.streams = {p.streams}: every stream "
                f"needs at least one slice (set slices >= {p.streams} or streams <= {p.slices})")
    return None


def hosts_split_workers(cfg: Config) -> str | None:
    """`cluster.nnodes` divides `parallel.world_size` (the same number of workers on every host);
    `cluster.node_rank < nnodes`; `cluster.rdzv_endpoint` is `HOST:PORT` when nnodes > 1."""
    c, world = cfg.cluster, cfg.parallel.world_size
    if world % c.nnodes:
        return (f"parallel.world_size = {world}: must be divisible by cluster.nnodes = {c.nnodes} (every host "
                f"runs the same number of workers)")
    if c.node_rank >= c.nnodes:
        return f"cluster.node_rank = {c.node_rank}: must be below cluster.nnodes = {c.nnodes} (0 to {c.nnodes - 1})"
    if c.nnodes > 1 or c.rdzv_endpoint:
        m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", c.rdzv_endpoint)
        if not m or not 0 < int(m.group(2)) <= 65535:
            what = "is required when cluster.nnodes > 1" if not c.rdzv_endpoint else "is not HOST:PORT"
            return (f"cluster.rdzv_endpoint = {show(c.rdzv_endpoint)}: {what} (host 0's address and a free "
                    f"port, the same on every host, e.g. \"10.0.0.1:29400\")")
    return None


def slow_layer_is_whole(cfg: Config) -> str | None:
    """`emulate.slow_layer` needs `emulate.slow_layer_ms` > 0, and is not available with
    `parallel.strategy = "param_server"` (whose slow machines are `parallel.slow_workers`)."""
    e = cfg.emulate
    if not e.slow_layer:
        return None
    if cfg.parallel.strategy == "param_server":
        return (f"emulate.slow_layer = {show(e.slow_layer)}: not available with parallel.strategy = "
                f"\"param_server\" (emulate a slow worker with parallel.slow_workers)")
    if e.slow_layer_ms <= 0:
        return (f"emulate.slow_layer = {show(e.slow_layer)} needs emulate.slow_layer_ms > 0 (how many "
                f"milliseconds each of its forwards sleeps)")
    return None


def slow_rank_is_whole(cfg: Config) -> str | None:
    """`emulate.slow_rank` names a rank of a data-parallel run and needs `emulate.slow_rank_ms` > 0."""
    e = cfg.emulate
    if e.slow_rank < 0:
        return None
    if cfg.parallel.strategy not in ("ddp", "sharded"):
        return (f"emulate.slow_rank = {e.slow_rank}: only with parallel.strategy = \"ddp\" or \"sharded\" "
                f"(a pipeline's slow stage is emulate.slow_layer; a parameter server's slow workers are "
                f"parallel.slow_workers)")
    if e.slow_rank >= cfg.parallel.world_size:
        return (f"emulate.slow_rank = {e.slow_rank}: no such rank; parallel.world_size = "
                f"{cfg.parallel.world_size} has ranks 0 to {cfg.parallel.world_size - 1}")
    if e.slow_rank_ms <= 0:
        return (f"emulate.slow_rank = {e.slow_rank} needs emulate.slow_rank_ms > 0 (how many milliseconds its "
                f"forward sleeps each step)")
    return None


def kill_has_its_moment(cfg: Config) -> str | None:
    """`emulate.kill_rank` names a rank of the run whose strategy has the moment `emulate.kill_at` names:
    `migration` a pipeline that rebalances, `broadcast` sharded, `host_update` updates placed on the host
    (`update.placement = "host"`, `"auto"` or a table naming `"host"`), `window` a parameter server
    (`kill_rank` one of its servers) with `parallel.sync = "soft"` or `"bsp"`."""
    e, p = cfg.emulate, cfg.parallel
    if e.kill_rank < 0:
        return None
    if e.kill_rank >= p.world_size:
        return (f"emulate.kill_rank = {e.kill_rank}: no such rank; parallel.world_size = {p.world_size} has ranks "
                f"0 to {p.world_size - 1}")
    at = f"emulate.kill_at = {show(e.kill_at)}"
    if e.kill_at == "migration" and (p.strategy != "pipeline" or p.rebalance == "off"):
        return (f'{at}: needs parallel.strategy = "pipeline" with parallel.rebalance = "auto" or "manual", where '
                f'layers migrate (got parallel.strategy = {show(p.strategy)}, parallel.rebalance = '
                f'{show(p.rebalance)})')
    if e.kill_at == "broadcast" and p.strategy != "sharded":
        return f'{at}: needs parallel.strategy = "sharded", whose broadcast it is (got {show(p.strategy)})'
    placement = cfg.update.placement
    on_host = "host" in placement.values() if isinstance(placement, dict) else placement in ("host", "auto")
    if e.kill_at == "host_update" and not on_host:
        return f'{at}: needs update.placement = "host", "auto" or a table naming "host" (got {show(placement)})'
    if e.kill_at == "window":
        if p.strategy != "param_server" or p.sync not in ("soft", "bsp"):
            return (f'{at}: needs parallel.strategy = "param_server" with parallel.sync = "soft" or "bsp" (got '
                    f'parallel.strategy = {show(p.strategy)}, parallel.sync = {show(p.sync)})')
        if e.kill_rank >= p.servers:
            servers = "rank 0" if p.servers == 1 else f"ranks 0 to {p.servers - 1}"
            return f"{at}: emulate.kill_rank = {e.kill_rank} is a worker; the windows are the servers' ({servers})"
    return None


def precision_makes_sense(cfg: Config) -> str | None:
    """bf16 weights need bf16 compute (an fp32 forward cannot multiply by bf16 weights); a bf16 sum needs
    bf16 gradients (fp32 gradients summed in bf16 would be compression, which is not built)."""
    p = cfg.precision
    if p.params == "bf16" and p.compute != "bf16":
        return (f"precision.params = \"bf16\" needs precision.compute = \"bf16\" (got {show(p.compute)}): an fp32 "
                f"forward cannot compute with bf16 weights")
    if p.reduce == "bf16" and p.params != "bf16":
        return (f"precision.reduce = \"bf16\" needs precision.params = \"bf16\" (got {show(p.params)}): fp32 "
                f"gradients are summed in fp32; summing them in bf16 would be gradient compression, which "
                f"trainyard does not do")
    return None


CROSS_CHECKS = [schedule_ends_low, hosts_split_workers, listen_is_loopback, slices_cover_streams, model_matches_data, files_exist,
                branchy_has_square_images, param_server_ranks, batch_splits_over_ranks, heads_split_width,
                slow_layer_is_whole, slow_rank_is_whole, kill_has_its_moment, precision_makes_sense]
