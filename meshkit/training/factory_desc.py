"""Describe a user's model (``model.factory``) for the planner by measuring it.

No formula knows a model meshkit never saw, so :func:`describe_factory` reads it: the
parameters from ``jax.eval_shape`` of the factory (the abstract state the trainer
builds, nothing allocated), which of them the fsdp role shards from their logical names
under the config's rules, and the FLOPs and bytes of its training step from XLA
(``cost_analysis()`` and ``memory_analysis()``) compiled on one device at one and two
sequences a step: the difference is one sequence's FLOPs and bytes, and the line
through the two gives the bytes at no tokens (state, gradients, the update's
temporaries). The result is a :class:`meshkit.plan.model_desc.ModelDesc` whose
``measured`` replaces the formulas, ranked by the same step and memory model as every
other (:mod:`meshkit.plan.model_plan`).

Importing the factory runs the user's code: only ``meshkit plan CONFIG`` with a config
that names ``model.factory`` calls this, and the import is announced on stderr
(:meth:`meshkit.config.ModelConfig.factory_function`), as ``meshkit train`` announces
it. It lives beside :mod:`meshkit.training.measured`, a layer above the planner, which
takes it as an argument (:func:`meshkit.plan.config_plan.config_desc`): the planner stays
numpy.
"""

from __future__ import annotations

from typing import Any

from meshkit.config import Config, with_overrides
from meshkit.plan.model_desc import Measured, ModelDesc
from meshkit.plan.planner import Layout

__all__ = ["describe_factory"]

#: Sequences a step of the two one-device compiles: their difference is one sequence.
PROBE_SEQUENCES = (1, 2)


def _compile(config: Config, sequences: int) -> tuple[float, int]:
    """``(FLOPs, XLA's bytes)`` of the step compiled on one device at ``sequences``."""
    from meshkit.plan.verify import xla_bytes
    from meshkit.training import compile_step, step_flops

    compiled = compile_step(with_overrides(config, [f"train.batch_size={sequences}"]))
    return float(step_flops(compiled) or 0.0), xla_bytes(compiled.memory_analysis())[0]


def _params(config: Config) -> tuple[int, int]:
    """``(parameter elements, of them those the fsdp role shards)`` of the factory's
    model, by ``jax.eval_shape`` and the parameters' logical names under the rules of a
    config with an fsdp axis (a config: no devices needed)."""
    import math

    import jax
    from flax import nnx

    from meshkit.training import Programs
    from meshkit.training.models import config_rules

    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        state = Programs(config, mesh).abstract_state
    rules = config_rules(with_overrides(config, Layout(fsdp=2).overrides()))
    fsdp_axes = set(rules.by_role().get("fsdp", ()))
    total = sharded = 0
    # The state is nnx.state((model, optimizer)): the model's variables are under key 0.
    for _, var in nnx.to_flat_state(state[0]):
        if not isinstance(var, nnx.Param):
            continue
        size = math.prod(var.shape)
        total += size
        names = getattr(var, "out_sharding", None) or ()
        spec = rules.spec(*names) if names else ()
        used: set[Any] = set()
        for entry in spec:
            used |= set(entry) if isinstance(entry, tuple) else {entry}
        if used & fsdp_axes:
            sharded += size
    return total, sharded


def describe_factory(config: Config) -> ModelDesc:
    """The planner's description of ``config``'s ``model.factory`` model, measured.

    Args:
        config: a config naming ``model.factory`` on one device (as
            :func:`meshkit.plan.planner.planning_config` gives it).

    Returns:
        A :class:`~meshkit.plan.model_desc.ModelDesc` with ``measured`` set, the
        config's batch, vocabulary, dtype and choices.

    Raises:
        ConfigError: the factory does not import, or the model does not build or compile
            (naming ``model.factory``).

    Example::

        desc = describe_factory(planning_config("qwen3.yaml", []))
        desc.params, desc.flops_per_token()
    """
    from meshkit.config import ConfigError

    fn = config.model.factory
    seq_len = config.train.seq_len
    params, fsdp_params = _params(config)  # imports the factory: announced on stderr
    try:
        (f1, b1), (f2, b2) = (_compile(config, n) for n in PROBE_SEQUENCES)
    except ConfigError:
        raise
    except Exception as e:  # the user's model failed to trace or compile: name it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.factory: {fn}: its training step does not compile on one "
                          f"device: {type(e).__name__}: {first}") from None
    extra = PROBE_SEQUENCES[1] - PROBE_SEQUENCES[0]
    per_token = (b2 - b1) / (extra * seq_len)
    at_zero = b1 - per_token * PROBE_SEQUENCES[0] * seq_len
    measured = Measured(
        params=params, fsdp_params=fsdp_params,
        flops_per_token=(f2 - f1) / (extra * seq_len),
        bytes_per_token=max(per_token, 0.0), bytes_per_param=max(at_zero, 0.0) / params,
        source=f"jax.eval_shape; XLA's one-device step at {PROBE_SEQUENCES[0]} and "
               f"{PROBE_SEQUENCES[1]} sequences of {seq_len}")
    # The shape fields are placeholders: a measured model's figures replace them.
    return ModelDesc(name=fn or "model.factory", vocab_size=config.model.vocab_size,
                     d_model=1, num_layers=1, num_heads=1, d_ff=1, seq_len=seq_len,
                     batch_size=config.train.batch_size, compute_dtype=config.model.dtype,
                     remat=config.model.remat, attention=config.model.attention,
                     schedule=config.parallel.schedule, zero1=config.parallel.zero1,
                     grad_accum=1, megatron_tp=False, measured=measured)
