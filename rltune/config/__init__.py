"""Experiment config: the schema (one frozen pydantic model per section) and its loader."""

from rltune.config.load import (
    ConfigError,
    config_base_dir,
    dump_config,
    load_config,
    save_resolved_config,
)
from rltune.config.schema import (
    AlgoConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    RewardFnConfig,
    RolloutConfig,
    RuntimeConfig,
    TrainConfig,
)

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "TrainConfig",
    "config_base_dir",
    "dump_config",
    "load_config",
    "save_resolved_config",
]
