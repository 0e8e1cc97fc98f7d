"""Layer 7, train: ``train(config) -> TrainResult`` and what keeps a run alive.

- :mod:`~meshkit.training.loop`: ``train()``, its setup and the driver loop.
- :mod:`~meshkit.training.models`: what a run trains: any NNX model from a factory and a
  loss (meshkit's MoE transformer by default), the rules for its logical names, its FLOPs.
- :mod:`~meshkit.training.programs`: the sharded state and the jitted train and eval steps.
- :mod:`~meshkit.training.hooks`: ``Hook(fn, every=N)``, what runs between steps; users add
  their own to those of :mod:`~meshkit.training.builtin_hooks` (metrics, eval,
  checkpoints, preemption, profiling, the progress bar).
- :mod:`~meshkit.training.preflight`: start-up checks, before anything compiles.
- :mod:`~meshkit.training.checkpoint`, :mod:`~meshkit.training.integrity`,
  :mod:`~meshkit.training.recovery`: save, check, resume from the newest intact checkpoint.
- :mod:`~meshkit.training.preemption`, :mod:`~meshkit.training.metrics`,
  :mod:`~meshkit.training.profiling`: SIGTERM, ``metrics.jsonl``/TensorBoard, traces.
"""

from meshkit.training.hooks import Hook, StepInfo
from meshkit.training.loop import TrainResult, config_dataset, train
from meshkit.training.models import (
    ModelSpec,
    build_model,
    next_token_loss,
    resolve_model,
    transformer_loss,
)
from meshkit.training.programs import (
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
