"""Layer 7, train: ``train(config) -> TrainResult`` and what keeps a run alive.

- :mod:`~meshkit.train.loop`: the programs, the step, the driver.
- :mod:`~meshkit.train.preflight`: start-up checks, before anything compiles.
- :mod:`~meshkit.train.checkpoint`, :mod:`~meshkit.train.integrity`,
  :mod:`~meshkit.train.recovery`: save, check, resume from the newest intact checkpoint.
- :mod:`~meshkit.train.preemption`, :mod:`~meshkit.train.metrics`,
  :mod:`~meshkit.train.profiling`: SIGTERM, ``metrics.jsonl``/TensorBoard, traces.
"""

from meshkit.train.loop import (
    Programs,
    TrainResult,
    build_model,
    compile_step,
    config_dataset,
    init_state,
    make_lr,
    make_optimizer,
    train,
)

__all__ = [
    "Programs",
    "TrainResult",
    "build_model",
    "compile_step",
    "config_dataset",
    "init_state",
    "make_lr",
    "make_optimizer",
    "train",
]
