"""meshkit: parallel strategies as JAX meshes, a two-stage all-to-all, and MoE training.

``import meshkit`` imports neither JAX nor Flax: the names that need them load on first
use, so a script or the CLI can still set the simulated CPU device count (or call
``meshkit.distributed.initialize()``) after importing meshkit.

The training entry point is ``meshkit.train.train`` (not re-exported here: the name
``meshkit.train`` is its module).
"""

from __future__ import annotations

import importlib
from typing import Any

from meshkit.strategy import Strategy

# public name -> module that defines it
_LAZY = {
    "make_mesh": "meshkit.mesh",
    "hierarchical_all_to_all": "meshkit.exchange",
    "all_to_all": "meshkit.exchange",
    "Link": "meshkit.cost",
    "Topology": "meshkit.cost",
    "predict": "meshkit.cost",
    "choose": "meshkit.cost",
    "preset": "meshkit.cost",
    "default_topology": "meshkit.cost",
    "PRESETS": "meshkit.cost",
    "load_topology": "meshkit.cost",
    "Layout": "meshkit.plan",
    "PlanError": "meshkit.plan",
    "collectives": "meshkit.hlo",
    "Config": "meshkit.config",
    "ConfigError": "meshkit.config",
    "load_config": "meshkit.config",
    "MarkovSource": "meshkit.data",
    "make_dataset": "meshkit.data",
    "MoE": "meshkit.moe",
    "shard_model": "meshkit.moe",
    "Transformer": "meshkit.model",
    "TrainResult": "meshkit.train",
    "MeshkitError": "meshkit.errors",
    "UsageError": "meshkit.errors",
    "TrainingDiverged": "meshkit.errors",
    "Preempted": "meshkit.errors",
}

__all__ = ["Strategy", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
