"""Layer 7, train: ``train(config) -> TrainResult`` and what keeps a run alive.

- :mod:`~meshkit.train.loop`: ``train()``, its setup and the driver loop.
- :mod:`~meshkit.train.models`: what a run trains: any NNX model from a factory and a
  loss (meshkit's MoE transformer by default), the rules for its logical names, its FLOPs.
- :mod:`~meshkit.train.programs`: the sharded state and the jitted train and eval steps.
- :mod:`~meshkit.train.hooks`: ``Hook(fn, every=N)``, what runs between steps; users add
  their own to those of :mod:`~meshkit.train.builtin_hooks` (metrics, eval,
  checkpoints, preemption, profiling, the progress bar).
- :mod:`~meshkit.train.preflight`: start-up checks, before anything compiles.
- :mod:`~meshkit.train.checkpoint`, :mod:`~meshkit.train.integrity`,
  :mod:`~meshkit.train.recovery`: save, check, resume from the newest intact checkpoint.
- :mod:`~meshkit.train.preemption`, :mod:`~meshkit.train.metrics`,
  :mod:`~meshkit.train.profiling`: SIGTERM, ``metrics.jsonl``/TensorBoard, traces.
"""

from meshkit.train.hooks import Hook, StepInfo
from meshkit.train.loop import TrainResult, config_dataset, train
from meshkit.train.models import (
    ModelSpec,
    build_model,
    next_token_loss,
    resolve_model,
    transformer_loss,
)
from meshkit.train.programs import (
    Programs,
    compile_step,
    init_state,
    make_lr,
    make_optimizer,
    step_flops,
)

__all__ = [
    "Hook",
    "ModelSpec",
    "Programs",
    "StepInfo",
    "TrainResult",
    "build_model",
    "compile_step",
    "config_dataset",
    "init_state",
    "make_lr",
    "make_optimizer",
    "next_token_loss",
    "resolve_model",
    "step_flops",
    "train",
    "transformer_loss",
]
