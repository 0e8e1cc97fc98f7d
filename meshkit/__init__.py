"""meshkit: parallel strategies as JAX meshes, a two-stage all-to-all, and MoE training.

``import meshkit`` imports neither JAX nor Flax: the names that need them load on first
use, so a script or the CLI can still set the simulated CPU device count (or call
``meshkit.distributed.initialize()``) after importing meshkit. Type checkers see every
name with its real type through the ``TYPE_CHECKING`` imports below, which
``tests/test_init.py`` holds equal to ``_LAZY``.

Each public name has one import path: ``meshkit.NAME`` for the names in ``__all__``,
``meshkit.exchange.cost`` for the exchange's cost model and ``meshkit.distributed`` for
multi-process start-up. Names that moved still resolve, with a ``DeprecationWarning``
naming the new path (``_MOVED``); ``meshkit.train`` is the training function, and its
modules are ``meshkit.training``.

Examples:
    >>> import meshkit
    >>> meshkit.Strategy.from_axes({"node": 2, "device": 4}).group(5, "node")
    (1, 5)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from meshkit._version import __version__ as __version__

if TYPE_CHECKING:  # ``X as X``: an explicit re-export, for mypy and ruff
    from meshkit.config import Config as Config
    from meshkit.config import ConfigError as ConfigError
    from meshkit.config import load_config as load_config
    from meshkit.data.sources import MarkovSource as MarkovSource
    from meshkit.data.sources import make_dataset as make_dataset
    from meshkit.errors import MeshkitError as MeshkitError
    from meshkit.errors import Preempted as Preempted
    from meshkit.errors import TrainingDiverged as TrainingDiverged
    from meshkit.errors import UsageError as UsageError
    from meshkit.exchange.dispatch import Dispatcher as Dispatcher
    from meshkit.exchange.dispatch import ExpertBatch as ExpertBatch
    from meshkit.exchange.dispatch import Routing as Routing
    from meshkit.exchange.two_stage import all_to_all as all_to_all
    from meshkit.exchange.two_stage import hierarchical_all_to_all as hierarchical_all_to_all
    from meshkit.model.attention import attention as attention
    from meshkit.model.context import context_attention as context_attention
    from meshkit.model.context import from_zigzag as from_zigzag
    from meshkit.model.context import to_zigzag as to_zigzag
    from meshkit.model.dispatchers import make_dispatcher as make_dispatcher
    from meshkit.model.experts import Experts as Experts
    from meshkit.model.experts import FunctionExperts as FunctionExperts
    from meshkit.model.experts import MLPExperts as MLPExperts
    from meshkit.model.experts import SwiGLUExperts as SwiGLUExperts
    from meshkit.model.experts import expert_param as expert_param
    from meshkit.model.moe import MoE as MoE
    from meshkit.model.pipeline import pipeline as pipeline
    from meshkit.model.pipeline import pipeline_loss as pipeline_loss
    from meshkit.model.pipelined import Pipelined as Pipelined
    from meshkit.model.remat import remat as remat
    from meshkit.model.router import Router as Router
    from meshkit.model.transformer import Transformer as Transformer
    from meshkit.plan.planner import Layout as Layout
    from meshkit.plan.planner import PlanError as PlanError
    from meshkit.sharding.activations import constrain as constrain
    from meshkit.sharding.fsdp import FSDP as FSDP
    from meshkit.sharding.linear import ColumnParallelLinear as ColumnParallelLinear
    from meshkit.sharding.linear import ParallelEmbed as ParallelEmbed
    from meshkit.sharding.linear import RowParallelLinear as RowParallelLinear
    from meshkit.sharding.params import gather_fsdp as gather_fsdp
    from meshkit.sharding.params import shard_call as shard_call
    from meshkit.sharding.place import logical_shardings as logical_shardings
    from meshkit.sharding.place import shard_model as shard_model
    from meshkit.sharding.rules import ShardingRules as ShardingRules
    from meshkit.strategy import Strategy as Strategy
    from meshkit.strategy.hlo import collectives as collectives
    from meshkit.strategy.mesh import make_mesh as make_mesh
    from meshkit.training import Hook as Hook
    from meshkit.training import StepInfo as StepInfo
    from meshkit.training import TrainResult as TrainResult
    from meshkit.training import train as train

# public name -> module that defines it
_LAZY = {
    "Strategy": "meshkit.strategy",
    "make_mesh": "meshkit.strategy.mesh",
    "hierarchical_all_to_all": "meshkit.exchange.two_stage",
    "all_to_all": "meshkit.exchange.two_stage",
    "Layout": "meshkit.plan.planner",
    "PlanError": "meshkit.plan.planner",
    "collectives": "meshkit.strategy.hlo",
    "Config": "meshkit.config",
    "ConfigError": "meshkit.config",
    "load_config": "meshkit.config",
    "MarkovSource": "meshkit.data.sources",
    "make_dataset": "meshkit.data.sources",
    "MoE": "meshkit.model.moe",
    "Experts": "meshkit.model.experts",
    "SwiGLUExperts": "meshkit.model.experts",
    "MLPExperts": "meshkit.model.experts",
    "FunctionExperts": "meshkit.model.experts",
    "expert_param": "meshkit.model.experts",
    "Router": "meshkit.model.router",
    "make_dispatcher": "meshkit.model.dispatchers",
    "Routing": "meshkit.exchange.dispatch",
    "ExpertBatch": "meshkit.exchange.dispatch",
    "Dispatcher": "meshkit.exchange.dispatch",
    "shard_model": "meshkit.sharding.place",
    "logical_shardings": "meshkit.sharding.place",
    "ShardingRules": "meshkit.sharding.rules",
    "gather_fsdp": "meshkit.sharding.params",
    "shard_call": "meshkit.sharding.params",
    "pipeline": "meshkit.model.pipeline",
    "pipeline_loss": "meshkit.model.pipeline",
    "Pipelined": "meshkit.model.pipelined",
    "remat": "meshkit.model.remat",
    "attention": "meshkit.model.attention",
    "context_attention": "meshkit.model.context",
    "to_zigzag": "meshkit.model.context",
    "from_zigzag": "meshkit.model.context",
    "ColumnParallelLinear": "meshkit.sharding.linear",
    "RowParallelLinear": "meshkit.sharding.linear",
    "ParallelEmbed": "meshkit.sharding.linear",
    "FSDP": "meshkit.sharding.fsdp",
    "constrain": "meshkit.sharding.activations",
    "Transformer": "meshkit.model.transformer",
    "train": "meshkit.training",
    "TrainResult": "meshkit.training",
    "Hook": "meshkit.training",
    "StepInfo": "meshkit.training",
    "MeshkitError": "meshkit.errors",
    "UsageError": "meshkit.errors",
    "TrainingDiverged": "meshkit.errors",
    "Preempted": "meshkit.errors",
}

#: old public name -> the module it lives in now (each warns once used, and goes in 0.3)
_MOVED = {
    name: "meshkit.exchange.cost"
    for name in ("Link", "Topology", "predict", "choose", "preset", "default_topology",
                 "PRESETS", "load_topology")
}

__all__ = [*_LAZY]



def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        warnings.warn(f"meshkit.{name} moved to {_MOVED[name]}.{name}; the old name goes in "
                      f"meshkit 0.3", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")


class _TrainModulesMoved(importlib.abc.MetaPathFinder):
    """``import meshkit.train.X`` names where ``X`` is now, rather than "no module".

    ``meshkit.train`` is the training function since 0.2, so its old modules cannot stay
    importable under that name (Python would bind the module over the function).
    """

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "meshkit.train" or fullname.startswith("meshkit.train."):
            raise ModuleNotFoundError(
                "meshkit.train's modules are meshkit.training's since meshkit 0.2 "
                "(meshkit.train is the training function: `from meshkit import train`)",
                name=fullname)
        return None


if not any(isinstance(finder, _TrainModulesMoved) for finder in sys.meta_path):
    sys.meta_path.append(_TrainModulesMoved())


def __dir__() -> list[str]:
    return sorted(__all__)
