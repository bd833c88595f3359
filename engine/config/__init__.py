"""The run configuration: one typed dataclass per TOML section, validated at load.

    from engine.config import load_config, Config, ConfigError
    cfg = load_config("demo/configs/digits_ddp.toml", overrides=["run.steps=50"])

- declare.py: how a setting is declared (setting(), table()), ConfigError, sizes; settings.py: every training
  setting, declared once (default, allowed values, one line of docs); parallel.py: [parallel], the keys every
  strategy shares and a table per strategy in the registry ([parallel.sharded], ..., each declared in its
  strategy's spec.py); operations.py: checkpoint, telemetry, cluster, emulate.
- check.py: each value against its declaration, then the rules across keys (rules.py: CROSS_CHECKS); files.py: the
  files a config names (token files, a Hugging Face config) exist and fit; extras.py: the optional
  packages it needs (a tracker's) are installed; batch.py: the global batch splits
  over ranks, micro-batches and micro-steps, and the training loop's keys agree.
- load.py: TOML file + `--set` overrides -> a checked Config.
- reference.py: docs/config.md from the declarations; `python -m engine.config`.

A bad value raises ConfigError naming the key path, the value and what is allowed; the CLI turns
that into exit status 2. Imports nothing from the rest of engine but the strategies' torch-free descriptions
(engine/strategies/specs/ and each strategy's spec.py, on this floor): everything else may import it.

This file imports each name from its module when the name is first asked for (PEP 562), and nothing when
loaded: a strategy's spec.py declares its settings with engine.config.declare, which runs this file first,
while parallel.py reads the registry of those specs as it loads.
"""

import importlib

WHERE = {   # a name -> its module
    **dict.fromkeys(("config_from_dict", "load_config", "read_toml"), "engine.config.load"),
    "markdown_reference": "engine.config.reference",
    **dict.fromkeys(("CheckpointConfig", "ClusterConfig", "Config", "ConfigError", "DataConfig", "DeviceConfig",
                     "EmulateConfig", "MemoryConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
                     "PrecisionConfig", "RunConfig", "TelemetryConfig", "UpdateConfig", "config_to_toml",
                     "format_size", "parse_size", "save_config", "setting"), "engine.config.settings"),
    # the first four strategies' tables, here before each moved into its package (a later one's is its own)
    "DdpConfig": "engine.strategies.ddp.spec", "ShardedConfig": "engine.strategies.sharded.spec",
    "PipelineConfig": "engine.strategies.pipeline.spec", "ParamServerConfig": "engine.strategies.param_server.spec",
}

__all__ = sorted(WHERE)


def __getattr__(name: str):
    if name not in WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(WHERE))
