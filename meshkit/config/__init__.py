"""Layer 3, config: the run configuration, from YAML plus ``key=value`` overrides.

Pydantic models, one per section (:mod:`~meshkit.config.sections`), checked across
sections by :mod:`~meshkit.config.rules`, read by :mod:`~meshkit.config.load` and
documented by :mod:`~meshkit.config.reference`. Never imports JAX: the CLI loads and
checks the config first, then sets the simulated device count before JAX starts.
"""

from meshkit.config.load import check_devices, load_config, read_config_file, with_overrides
from meshkit.config.reference import format_reference, json_schema
from meshkit.config.rules import validate
from meshkit.config.sections import (
    Config,
    DataConfig,
    ExchangeConfig,
    MeshConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    all_keys,
)
from meshkit.config.values import ConfigError

__all__ = [
    "Config", "ConfigError", "DataConfig", "ExchangeConfig", "MeshConfig", "ModelConfig",
    "ParallelConfig", "TrainConfig", "all_keys", "check_devices", "format_reference",
    "json_schema", "load_config", "read_config_file", "validate", "with_overrides",
]
