"""The run configuration: one typed dataclass per TOML section, validated at load.

    from engine.config import load_config, Config, ConfigError
    cfg = load_config("demo/configs/digits_ddp.toml", overrides=["run.steps=50"])

- declare.py: how a setting is declared (setting(), table()), ConfigError, sizes; settings.py: every training
  setting, declared once (default, allowed values, one line of docs); parallel.py: [parallel], the keys every
  strategy shares and a table per strategy ([parallel.sharded], ...); operations.py: checkpoint, telemetry,
  cluster, emulate.
- check.py: each value against its declaration, then the rules across keys (rules.py: CROSS_CHECKS); files.py: the
  files a config names (token files, a Hugging Face config) exist and fit; batch.py: the global batch splits
  over ranks, micro-batches and micro-steps, and the training loop's keys agree.
- load.py: TOML file + `--set` overrides -> a checked Config.
- reference.py: docs/config.md from the declarations; `python -m engine.config`.

A bad value raises ConfigError naming the key path, the value and what is allowed; the CLI turns
that into exit status 2. Imports nothing from the rest of engine but the strategies' torch-free descriptions
(engine/strategies/specs/, on this floor): everything else may import it.
"""

from engine.config.load import config_from_dict, load_config, read_toml
from engine.config.parallel import DdpConfig, ParamServerConfig, PipelineConfig, ShardedConfig
from engine.config.reference import markdown_reference
from engine.config.settings import (CheckpointConfig, ClusterConfig, Config, ConfigError, DataConfig, DeviceConfig,
                                    EmulateConfig, MemoryConfig, ModelConfig, OptimConfig, ParallelConfig,
                                    PrecisionConfig, RunConfig, TelemetryConfig, UpdateConfig, config_to_toml, format_size,
                                    parse_size, save_config, setting)

__all__ = ["CheckpointConfig", "ClusterConfig", "Config", "ConfigError", "DataConfig", "DdpConfig", "DeviceConfig",
           "EmulateConfig", "ParamServerConfig", "PipelineConfig", "ShardedConfig",
           "MemoryConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig", "TelemetryConfig",
           "UpdateConfig", "config_from_dict", "config_to_toml", "format_size", "load_config", "markdown_reference",
           "parse_size", "read_toml", "save_config", "setting"]
