"""Layer 3, config: the run configuration, from YAML plus ``key=value`` overrides.

Never imports JAX: the CLI loads and checks the config first, then sets the simulated device
count before JAX starts.
"""

from meshkit.config.schema import (
    Config,
    ConfigError,
    DataConfig,
    ExchangeConfig,
    MeshConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_devices,
    format_reference,
    load_config,
    read_config_file,
    validate,
    with_overrides,
)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "ExchangeConfig",
    "MeshConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_devices",
    "format_reference",
    "load_config",
    "read_config_file",
    "validate",
    "with_overrides",
]
