"""``meshkit.distributed``, kept as an entry point: the code is :mod:`meshkit.runtime.distributed`.
"""

from meshkit.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    MAX_SIMULATED_DEVICES,
    initialize,
    launcher_env,
    num_processes_from_env,
    set_cpu_device_count,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "MAX_SIMULATED_DEVICES",
    "initialize",
    "launcher_env",
    "num_processes_from_env",
    "set_cpu_device_count",
]
