"""``meshkit plan CONFIG``: a config's model ranked by the one planner (numpy only).

A config's model is described (:meth:`meshkit.plan.model_desc.ModelDesc.of_config` for
meshkit's transformer; a ``describe`` function, which measures it, for a
``model.factory``) and ranked by :func:`meshkit.plan.model_plan.plan_model`, the step model
and memory model ``meshkit plan --model FILE`` uses, keeping the layouts the config's
own rules accept (:func:`meshkit.plan.planner.rejection`) with the config's remat,
attention, schedule and ZeRO-1. ``--verify K`` compiles the config itself under each of
the best ``K`` layouts (:func:`meshkit.plan.verify.verify_plan`).

Examples:
    >>> from meshkit.config import load_config
    >>> from meshkit.exchange.cost import preset
    >>> best = plan(load_config(None), devices=8, topology=preset("h100-8x400g", 1))[0]
    >>> best.layout.devices, best.predicted_step_s > 0
    (8, True)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from meshkit._fs import cannot_write, write_file
from meshkit.config import Config
from meshkit.errors import UsageError
from meshkit.exchange import cost
from meshkit.plan.model_desc import ModelDesc
from meshkit.plan.model_plan import (
    Candidate,
    ModelPlanReport,
    ModelPrediction,
    auto_context_method,
    model_rejection,
    plan_model,
    predict_model,
)
from meshkit.plan.planner import (
    Layout,
    PlanError,
    check_layout,
    planning_config,
    rejection,
    resolve_topology,
)

__all__ = ["candidate_of", "config_desc", "plan", "predict", "run_plan"]

#: A description field :func:`meshkit.plan.model_plan.model_rejection` names → the config
#: key that sets it, so that a config's plan names its own keys.
_CONFIG_KEYS = {"num_heads": "model.num_heads", "num_kv_heads": "model.num_heads",
                "num_experts": "model.num_experts", "num_layers": "parallel.pipeline",
                "schedule": "parallel.schedule", "batch_size": "train.batch_size",
                "micro_batch_size": "parallel.microbatches", "d_model": "model.d_model",
                "d_ff": "model.d_ff", "expert_d_ff": "model.d_ff", "zero1": "parallel.zero1"}


def config_desc(config: Config, *, name: str = "meshkit",
                describe: Callable[[Config], ModelDesc] | None = None) -> ModelDesc:
    """The description a config's model is planned by.

    Args:
        config: the config (its mesh is not read).
        name: a label.
        describe: measures a ``model.factory`` model (the command passes
            :func:`meshkit.training.factory_desc.describe_factory`, which imports the
            factory and JAX; the planner, a layer below the training step, takes it as
            an argument).

    Returns:
        The description.

    Raises:
        PlanError: a config with ``model.factory`` and no ``describe``.
    """
    if config.model.factory is None:
        return ModelDesc.of_config(config, name=name)
    if describe is None:
        raise PlanError(f"model.factory: {config.model.factory} is planned by measuring it "
                        "(jax.eval_shape and a one-device compile): pass describe="
                        "meshkit.training.factory_desc.describe_factory")
    return describe(config)


def candidate_of(config: Config, layout: Layout) -> Candidate:
    """The candidate a config runs under ``layout``: its remat, attention and schedule.

    Args:
        config: the config.
        layout: the layout.

    Returns:
        The :class:`~meshkit.plan.model_plan.Candidate`.

    Examples:
        >>> from meshkit.config import load_config
        >>> candidate_of(load_config(None), Layout(data=8)).name()
        'dp8'
    """
    m, p = config.model, config.parallel
    piped = layout.pipeline > 1
    schedule = p.schedule if piped else "gpipe"
    return Candidate(layout, remat=m.remat, attention=m.attention, grad_accum=1,
                     schedule=schedule,
                     virtual_stages=p.virtual_stages if schedule == "interleaved" else 1)


def _layout_rules(config: Config, desc: ModelDesc, topology: cost.Topology
                  ) -> Callable[[Layout], str | None]:
    """The config's rules for a layout: :func:`rejection`, then its context method, one
    of the config's choices as its remat and attention are: the one it names, or under
    ``auto`` the cost model's pick for the layout's context axes
    (:func:`~meshkit.plan.model_plan.auto_context_method`), the method the model runs."""
    configured = config.parallel.context_method

    def reject(layout: Layout) -> str | None:
        why = rejection(config, layout)
        if why is not None or layout.context == 1:
            return why
        want = (configured if configured != "auto"
                else auto_context_method(desc, layout, topology))
        return None if layout.context_method == want else "parallel.context_method"

    return reject


def _rules(config: Config, desc: ModelDesc) -> Callable[[Candidate], str | None]:
    """The config's rules for a candidate beyond its layout's (:func:`rejection`, which
    :func:`plan` checks first, once per layout), naming config keys: the config's
    virtual stages, then the description's rules."""
    virtual = config.parallel.virtual_stages

    def reject(cand: Candidate) -> str | None:
        if cand.schedule == "interleaved" and cand.virtual_stages != virtual:
            return "parallel.virtual_stages"
        why = model_rejection(desc, cand)
        if why is None or "." in why:  # a measured model's rules name config keys
            return why
        return _CONFIG_KEYS.get(why, f"model.{why}")

    return reject


def predict(config: Config, layout: Layout, topology: cost.Topology, *,
            desc: ModelDesc | None = None) -> ModelPrediction:
    """Predict one training step of ``config``'s model and batch under ``layout``: a
    thin call into :func:`meshkit.plan.model_plan.predict_model`.

    Args:
        config: the model and batch; its mesh is ignored.
        layout: the layout (valid for the config: :func:`meshkit.plan.planner.rejection`).
        topology: the cluster, with ``flops_per_s`` and the layout's device count.
        desc: the config's description (default :func:`config_desc`).

    Returns:
        The :class:`~meshkit.plan.model_plan.ModelPrediction`.

    Raises:
        ValueError: a topology without ``flops_per_s`` or of another device count.

    Examples:
        >>> from meshkit.config import load_config
        >>> from meshkit.exchange.cost import preset
        >>> p = predict(load_config(None), Layout(data=8), preset("h100-8x400g", 1))
        >>> p.terms["exchange"], p.bottleneck
        (0.0, 'gradients')
    """
    return predict_model(desc or config_desc(config), candidate_of(config, layout), topology)


def plan(config: Config, *, devices: int, topology: cost.Topology,
         desc: ModelDesc | None = None) -> list[ModelPrediction]:
    """Every valid layout of ``devices`` devices that fits in memory, fastest first.

    Args:
        config: the model and the global batch.
        devices: the device count.
        topology: the cluster (``devices`` of them; see
            :func:`meshkit.plan.planner.sized_topology`), with ``flops_per_s``; layouts
            needing more than ``memory_bytes`` per device are dropped.
        desc: the config's description (default :func:`config_desc`).

    Returns:
        Predictions, ranked by predicted step time (then memory).

    Raises:
        PlanError: no layout satisfies the config's rules (the message names the key
            that rejected most), none fits in memory (it names the smallest need), or the
            topology's numbers make a predicted step time inf or NaN.
    """
    desc = desc or config_desc(config)
    return plan_model(desc, devices=devices, topology=topology,
                      reject=_rules(config, desc),
                      reject_layout=_layout_rules(config, desc, topology),
                      rules="satisfies the config's rules")


def _name(config_path: str | None) -> str:
    return "default config" if config_path is None else os.path.basename(config_path)


def run_plan(config_path: str | None, overrides: Sequence[str], *, devices: int | None,
             topology: str | None = None, preset: str | None = None,
             nodes: int | None = None, top: int = 5, write: str | None = None,
             verify: int | None = None, extrapolate: bool = False,
             describe: Callable[[Config], ModelDesc] | None = None,
             progress: Callable[[str], None] | None = None) -> ModelPlanReport:
    """``meshkit plan [CONFIG]``: rank the layouts; ``--verify K`` compiles the best K;
    optionally write the best one's config.

    Args:
        config_path: the YAML config (``None``: the embedded default).
        overrides: ``key=value`` overrides of it.
        devices, topology, preset, nodes: the cluster (see
            :func:`meshkit.plan.planner.resolve_topology`).
        top: how many layouts to show (>= 1).
        write: write the best layout's config to this file.
        verify: compile the config under this many of the best layouts (``None``: none).
        extrapolate: compile few layers and extrapolate (meshkit's model only).
        describe: measures a ``model.factory`` model (see :func:`config_desc`).
        progress: progress lines of the measuring and the compiles.

    Returns:
        A :class:`~meshkit.plan.model_plan.ModelPlanReport` (the command prints its
        ``text()`` or ``to_json()``).

    Raises:
        PlanError: bad flags, no valid layout, none that fits, an unwritable ``write``.
        ConfigError: a bad config (its mesh aside: the planner replaces it; see
            :func:`meshkit.plan.planner.planning_config`).
        VerifyError: a bad ``--verify`` count or a device count beyond the host's.

    Examples:
        >>> report = run_plan(None, [], devices=8, top=1)
        >>> len(report.ranked) > 1, report.written
        (True, None)
    """
    from meshkit.plan.verify import check_simulated, verify_plan

    if isinstance(top, bool) or top < 1:
        raise PlanError(f"--top: must be a positive integer, got {top!r}")
    if write is not None:
        problem = cannot_write(write)  # before the search, not after it
        if problem is not None:
            raise PlanError(f"--write: cannot write {write}: {problem}")
    config = planning_config(config_path, overrides)
    if extrapolate and config.model.factory is not None:
        raise PlanError("--verify-extrapolate: compiles meshkit's transformer at other layer "
                        f"counts; model.factory ({config.model.factory}) has no layer count "
                        "to set: drop it")
    sized = resolve_topology(devices=devices, topology=topology, preset=preset, nodes=nodes)
    if verify is not None:
        check_simulated(sized.devices)  # before measuring or ranking, not after
    if config.model.factory is not None and progress is not None:
        progress(f"plan: measuring model.factory {config.model.factory} on one device ...")
    desc = config_desc(config, name=_name(config_path), describe=describe)
    ranked = plan(config, devices=sized.devices, topology=sized, desc=desc)
    if verify is not None:
        ranked = verify_plan(desc, ranked, devices=sized.devices, count=verify,
                             memory_bytes=sized.memory_bytes, extrapolate=extrapolate,
                             progress=progress, config=(config_path, tuple(overrides)))
    if write is not None:
        best = check_layout(config, ranked[0].layout)
        try:
            write_file(write, best.to_yaml(), flag="--write")
        except UsageError as e:
            raise PlanError(str(e)) from None
    return ModelPlanReport(desc, ranked, ranked[:max(top, verify or 0)], sized,
                           verified=verify or 0, written=write)
