"""meshkit: parallel strategies as JAX meshes, a two-stage all-to-all, and MoE training.

``import meshkit`` imports neither JAX nor Flax: the names that need them load on first
use, so a script or the CLI can still set the simulated CPU device count (or call
``meshkit.distributed.initialize()``) after importing meshkit. Type checkers see every
name with its real type through the ``TYPE_CHECKING`` imports below, which
``tests/test_init.py`` holds equal to ``_LAZY``.

The training entry point is ``meshkit.train.train`` (not re-exported here: the name
``meshkit.train`` is its subpackage).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    from meshkit.exchange.cost import PRESETS as PRESETS
    from meshkit.exchange.cost import Link as Link
    from meshkit.exchange.cost import Topology as Topology
    from meshkit.exchange.cost import choose as choose
    from meshkit.exchange.cost import default_topology as default_topology
    from meshkit.exchange.cost import load_topology as load_topology
    from meshkit.exchange.cost import predict as predict
    from meshkit.exchange.cost import preset as preset
    from meshkit.exchange.dispatch import Dispatcher as Dispatcher
    from meshkit.exchange.dispatch import ExpertBatch as ExpertBatch
    from meshkit.exchange.dispatch import Routing as Routing
    from meshkit.exchange.two_stage import all_to_all as all_to_all
    from meshkit.exchange.two_stage import hierarchical_all_to_all as hierarchical_all_to_all
    from meshkit.model.attention import attention as attention
    from meshkit.model.dispatchers import make_dispatcher as make_dispatcher
    from meshkit.model.experts import Experts as Experts
    from meshkit.model.experts import FunctionExperts as FunctionExperts
    from meshkit.model.experts import MLPExperts as MLPExperts
    from meshkit.model.experts import SwiGLUExperts as SwiGLUExperts
    from meshkit.model.experts import expert_param as expert_param
    from meshkit.model.moe import MoE as MoE
    from meshkit.model.pipeline import pipeline as pipeline
    from meshkit.model.pipeline import pipeline_loss as pipeline_loss
    from meshkit.model.remat import remat as remat
    from meshkit.model.router import Router as Router
    from meshkit.model.transformer import Transformer as Transformer
    from meshkit.plan.planner import Layout as Layout
    from meshkit.plan.planner import PlanError as PlanError
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
    from meshkit.train import TrainResult as TrainResult

# public name -> module that defines it
_LAZY = {
    "Strategy": "meshkit.strategy",
    "make_mesh": "meshkit.strategy.mesh",
    "hierarchical_all_to_all": "meshkit.exchange.two_stage",
    "all_to_all": "meshkit.exchange.two_stage",
    "Link": "meshkit.exchange.cost",
    "Topology": "meshkit.exchange.cost",
    "predict": "meshkit.exchange.cost",
    "choose": "meshkit.exchange.cost",
    "preset": "meshkit.exchange.cost",
    "default_topology": "meshkit.exchange.cost",
    "PRESETS": "meshkit.exchange.cost",
    "load_topology": "meshkit.exchange.cost",
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
    "remat": "meshkit.model.remat",
    "attention": "meshkit.model.attention",
    "ColumnParallelLinear": "meshkit.sharding.linear",
    "RowParallelLinear": "meshkit.sharding.linear",
    "ParallelEmbed": "meshkit.sharding.linear",
    "Transformer": "meshkit.model.transformer",
    "TrainResult": "meshkit.train",
    "MeshkitError": "meshkit.errors",
    "UsageError": "meshkit.errors",
    "TrainingDiverged": "meshkit.errors",
    "Preempted": "meshkit.errors",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
