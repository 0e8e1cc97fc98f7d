"""Checks across sections: roles on mesh axes, and sizes the mesh must divide."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshkit.choices import LOGICAL_AXES, ROLES
from meshkit.config.moe_tensor import resolve as moe_tensor
from meshkit.config.values import ConfigError
from meshkit.strategy.axes import axis_names

if TYPE_CHECKING:
    from meshkit.config.sections import Config, ExchangeConfig, ParallelConfig

TEXT_VOCAB = 256  # byte-level text needs one id per byte value


def attention_chunk_problem(chunk: int, seq_len: int, *, seq_key: str) -> str | None:
    """Why ``chunked`` attention cannot cut ``seq_len`` tokens into blocks of ``chunk``.

    The one check behind ``meshkit train``'s ``model.attention_chunk`` and a planner
    model description's ``attention_chunk``, so the planner ranks no layout that
    training refuses.

    Args:
        chunk: the block length (a block longer than the sequence is the whole sequence).
        seq_len: tokens per sequence.
        seq_key: how the message names the sequence length (``train.seq_len``).

    Returns:
        The problem, to follow the chunk's key in one line, or ``None``.

    Examples:
        >>> attention_chunk_problem(7, 4096, seq_key="seq_len")
        '7 does not divide seq_len=4096 (chunked attention cuts the sequence into blocks)'
        >>> attention_chunk_problem(128, 100, seq_key="seq_len") is None
        True
    """
    if seq_len % min(chunk, seq_len):
        return (f"{chunk} does not divide {seq_key}={seq_len} (chunked attention cuts the "
                "sequence into blocks)")
    return None


def role_claims(
    parallel: ParallelConfig, exchange: ExchangeConfig
) -> dict[str, list[tuple[str, str]]]:
    """Axis -> ``(role, config key)`` for each key that names it (expert: the exchange).

    The context claim comes last, so a context axis that another key names too is
    reported under ``parallel.context``.
    """
    p = parallel
    claims: dict[str, list[tuple[str, str]]] = {}
    for role, key, value in (
        ("data", "parallel.data", p.data),
        ("fsdp", "parallel.fsdp", p.fsdp),
        ("tensor", "parallel.tensor", p.tensor),
        ("pipeline", "parallel.pipeline", p.pipeline or ()),
        ("expert", "exchange.node_axis", exchange.node_axis),
        ("expert", "exchange.device_axis", exchange.device_axis),
        ("context", "parallel.context", p.context),
    ):
        for axis in axis_names(value, key):
            claims.setdefault(axis, []).append((role, key))
    return claims


def validate(config: Config) -> None:
    """Check the combinations of sections (each section has checked itself already).

    ``Config`` runs this on construction.

    Args:
        config: the config.

    Raises:
        ConfigError: roles on axes that are missing or taken twice, a logical axis
            mapped to something that is neither a role, a logical name nor mesh axes, or
            sizes the mesh does not divide (batch; and for meshkit's transformer, not a
            ``model.factory``: experts, heads, vocabulary, width, layers), or
            ``parallel.zero1`` with no data axis, or context parallelism that cannot
            run (:func:`_check_context`); the message names the key and explains the
            numbers.

    Examples:
        >>> from meshkit.config import Config
        >>> validate(Config())
    """
    shape = config.mesh.strategy().shape
    m, t, p = config.model, config.train, config.parallel
    for axis, named in role_claims(p, config.exchange).items():
        if axis not in shape:
            raise ConfigError(f"{named[0][1]}: {axis!r} is not an axis of the mesh "
                              f"(mesh.axes: {', '.join(shape)})")
        if len(named) > 1 and named[-1][0] == "context":
            raise ConfigError(
                f"parallel.context: axis {axis!r} already has a role ({named[0][0]}, from "
                f"{named[0][1]}); a context axis has no other role (it splits each sequence, "
                "not the batch)")
        if len(named) > 1 and [role for role, _ in named] != ["fsdp", "expert"]:
            raise ConfigError(
                f"{named[1][1]}: axis {axis!r} already has a role ({named[0][0]}, from "
                f"{named[0][1]}); each mesh axis has at most one role (an expert axis may "
                "also be named in parallel.fsdp)")

    if p.zero1 and not config.axes_with_role("data"):
        roles = ", ".join(f"{a}={r}" for a, r in config.roles.items())
        raise ConfigError(f"parallel.zero1: shards the optimizer state over the data axes, "
                          f"but the mesh has none ({roles}); give an axis no role or name "
                          "it in parallel.data")
    _check_logical_axes(config)
    if p.pipeline is None and p.schedule != "gpipe":
        raise ConfigError(f"parallel.schedule: {p.schedule!r} needs a pipeline axis "
                          "(parallel.pipeline is null)")
    if p.virtual_stages != 1 and p.schedule != "interleaved":
        raise ConfigError(f"parallel.virtual_stages: {p.virtual_stages} chunks per stage need "
                          f"parallel.schedule: interleaved, got {p.schedule!r}")
    if p.schedule == "interleaved" and p.pipeline is not None and (
            p.microbatches < shape[p.pipeline]):
        raise ConfigError(f"parallel.microbatches: the interleaved schedule needs at least as "
                          f"many microbatches as stages, got {p.microbatches} for "
                          f"{shape[p.pipeline]} stages (axis {p.pipeline!r})")
    if m.factory is None:
        _check_transformer(config)
    _check_context(config)  # after the heads are known to divide over the tensor axes
    batch_devices = config.batch_devices
    if t.batch_size % batch_devices:
        batch = "×".join(f"{a}={shape[a]}" for a in config.batch_axes) or "none"
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is not divisible by the {batch_devices} "
            f"batch devices (the batch is split over the data, fsdp and expert axes: {batch})")
    local = t.batch_size // batch_devices
    if local % p.microbatches:
        raise ConfigError(
            f"parallel.microbatches: {p.microbatches} does not divide the per-device batch "
            f"of {local} sequences (train.batch_size={t.batch_size} over {batch_devices} "
            "batch devices)")
    if m.factory is None and m.num_experts and moe_tensor(config) == "tokens":
        tokens = local // p.microbatches * t.seq_len // config.context_devices
        tensor_axes = axis_names(p.tensor, "parallel.tensor")
        if tokens % _size(shape, tensor_axes):
            raise ConfigError(
                f"parallel.tensor: the MoE splits each device's {tokens} tokens per "
                f"microbatch over the {_size(shape, tensor_axes)} tensor devices, which does "
                "not divide them (parallel.moe_tensor: tokens); change train.batch_size or "
                "train.seq_len, or set parallel.moe_tensor: ffn")
    if p.sequence_parallel:
        _check_sequence_parallel(config)
    if m.factory is None and m.attention == "chunked":
        problem = attention_chunk_problem(m.attention_chunk, t.seq_len, seq_key="train.seq_len")
        c = config.context_devices
        if not problem and c > 1:  # each device's attention runs over its T/c positions
            problem = attention_chunk_problem(
                m.attention_chunk, t.seq_len // c,
                seq_key=f"the positions per context device (train.seq_len/{c})")
        if problem:
            raise ConfigError(f"model.attention_chunk: {problem}")
    if config.data.eos_id is not None and config.data.eos_id >= m.vocab_size:
        raise ConfigError(f"data.eos_id: {config.data.eos_id} is outside the vocabulary: ids "
                          f"are 0..{m.vocab_size - 1} (model.vocab_size={m.vocab_size})")
    if config.data.eos_id is not None:
        _check_packed(config)
    if config.data.kind == "text" and m.vocab_size < TEXT_VOCAB:
        raise ConfigError(
            f"model.vocab_size: {m.vocab_size} is too small for data.kind='text' "
            f"(byte-level text needs at least {TEXT_VOCAB})")


def _check_packed(config: Config) -> None:
    """Packed documents need meshkit's transformer, which keeps them apart, without a
    schedule that would carry each microbatch's document ids beside its activations."""
    p = config.parallel
    if config.model.factory is not None:
        raise ConfigError("data.eos_id: packed documents are kept apart by meshkit's "
                          "transformer; a model.factory model gets the token rows only "
                          "(split them into documents in the model, or set data.eos_id: null)")
    if p.pipeline is not None or p.microbatches > 1:
        raise ConfigError("data.eos_id: packed documents cannot be combined with a pipeline "
                          "(parallel.pipeline) or parallel.microbatches > 1")


def _check_logical_axes(config: Config) -> None:
    """Each ``parallel.logical_axes`` target is a role, a logical name known by then, or
    axes of the mesh."""
    shape = config.mesh.strategy().shape
    known = list(LOGICAL_AXES)
    for name, target in config.parallel.logical_axes.items():
        if isinstance(target, str) and (target in ROLES or target in known):
            known.append(name)
            continue
        for axis in (target,) if isinstance(target, str) else target or ():
            if axis not in shape:
                close = difflib.get_close_matches(axis, [*ROLES, *known, *shape], n=1)
                raise ConfigError(
                    f"parallel.logical_axes.{name}: {axis!r} is not a role "
                    f"({', '.join(ROLES)}), a logical name ({', '.join(known)}) nor "
                    f"an axis of the mesh ({', '.join(shape)})"
                    + (f"; did you mean {close[0]!r}?" if close else ""))
        known.append(name)


def _size(shape: Mapping[str, int], axes: tuple[str, ...]) -> int:
    return math.prod(shape[a] for a in axes)


def _check_transformer(config: Config) -> None:
    """The sizes meshkit's MoE transformer needs the mesh to divide (a factory's model
    brings its own sizes, which the config does not know)."""
    shape = config.mesh.strategy().shape
    m, p = config.model, config.parallel

    def size(axes: tuple[str, ...]) -> int:
        return _size(shape, axes)

    sizes = "×".join(str(shape[a]) for a in config.expert_axes) or "1"
    expert_devices = size(config.expert_axes)
    if m.num_experts == 0 and config.expert_axes:
        raise ConfigError(
            f"exchange.node_axis: a dense model (model.num_experts: 0) has no experts to "
            f"split over the expert axes {list(config.expert_axes)}; set exchange.node_axis: "
            "[] and exchange.device_axis: [] (and give those axes another role)")
    if m.num_experts % expert_devices:
        raise ConfigError(
            f"model.num_experts: {m.num_experts} is not divisible by the {expert_devices} "
            f"expert devices ({'×'.join(config.expert_axes)} = {sizes})")
    if config.exchange.dedup and not (config.node_axes and config.device_axes):
        raise ConfigError(
            "exchange.dedup: needs both exchange.node_axis and exchange.device_axis, got "
            f"{list(config.node_axes)} and {list(config.device_axes)}")
    if config.exchange.dedup and m.dispatch != "sort":
        raise ConfigError(f"exchange.dedup: needs model.dispatch: sort, got {m.dispatch!r}")
    nodes = size(config.node_axes)
    if m.max_nodes is not None and m.max_nodes > nodes:
        raise ConfigError(f"model.max_nodes: {m.max_nodes} is more than the {nodes} nodes "
                          f"(exchange.node_axis: {list(config.node_axes)})")
    if m.max_nodes is not None and m.max_nodes * (m.num_experts // nodes) < m.top_k:
        raise ConfigError(
            f"model.max_nodes: {m.max_nodes} node(s) of {m.num_experts // nodes} experts "
            f"hold fewer than model.top_k={m.top_k} experts")
    tensor_axes = axis_names(p.tensor, "parallel.tensor")
    tensor = size(tensor_axes)
    for key, value, what in (
        ("model.num_heads", m.num_heads, "attention heads"),
        ("model.vocab_size", m.vocab_size, "vocabulary entries (embedding and head)"),
    ):
        if value % tensor:
            raise ConfigError(
                f"{key}: {value} {what} cannot be split over the {tensor} tensor-parallel "
                f"devices (parallel.tensor: {list(tensor_axes)})")
    _check_ffn_split(config, tensor_axes)
    fsdp_axes = axis_names(p.fsdp, "parallel.fsdp")
    if m.d_model % size(fsdp_axes):
        raise ConfigError(
            f"model.d_model: {m.d_model} cannot be sharded over the {size(fsdp_axes)} fsdp "
            f"devices (parallel.fsdp: {list(fsdp_axes)}); parameters are split on the "
            "model width")
    if p.stage_layers is not None:
        stages = 1 if p.pipeline is None else shape[p.pipeline]
        if p.pipeline is None or len(p.stage_layers) != stages:
            raise ConfigError(
                f"parallel.stage_layers: {len(p.stage_layers)} entries for "
                + ("no pipeline (parallel.pipeline is null)" if p.pipeline is None else
                   f"the {stages} stages of axis {p.pipeline!r}"))
        if sum(p.stage_layers) != m.num_layers:
            raise ConfigError(f"parallel.stage_layers: {list(p.stage_layers)} sums to "
                              f"{sum(p.stage_layers)}, not model.num_layers={m.num_layers}")
    elif p.pipeline is not None and m.num_layers % shape[p.pipeline]:
        raise ConfigError(f"parallel.pipeline: {shape[p.pipeline]} stages (axis "
                          f"{p.pipeline!r}) do not divide model.num_layers={m.num_layers}")
    if p.schedule == "interleaved" and p.stage_layers is not None:
        raise ConfigError("parallel.stage_layers: uneven stages cannot be combined with "
                          "parallel.schedule: interleaved (its chunks are even)")
    if p.pipeline is not None and (m.num_layers // shape[p.pipeline]) % p.virtual_stages:
        raise ConfigError(
            f"parallel.virtual_stages: {p.virtual_stages} does not divide the "
            f"{m.num_layers // shape[p.pipeline]} layers per stage (model.num_layers="
            f"{m.num_layers} over {shape[p.pipeline]} stages of axis {p.pipeline!r})")
    if m.dense_layers and p.pipeline is not None:
        raise ConfigError(
            f"model.dense_layers: dense layers ahead of MoE layers are not split into pipeline "
            f"stages yet (parallel.pipeline: {p.pipeline!r}); run them without a pipeline, or "
            "use model.dense_layers: 0")
    if p.pipeline is None and p.microbatches > 1:
        raise ConfigError(f"parallel.microbatches: {p.microbatches} microbatches need a "
                          "pipeline axis (parallel.pipeline is null)")


def _check_ffn_split(config: Config, tensor_axes: tuple[str, ...]) -> None:
    """``parallel.moe_tensor`` names something there is, and the tensor axes divide each
    hidden width they split (a dense MLP's always, the experts' under ``ffn``)."""
    m, p = config.model, config.parallel
    shape = config.mesh.strategy().shape
    if p.moe_tensor != "auto" and not (m.num_experts and tensor_axes):
        missing = "no MoE layers (model.num_experts: 0)" if not m.num_experts else (
            "no tensor axes (parallel.tensor is empty)")
        raise ConfigError(f"parallel.moe_tensor: {p.moe_tensor!r} says what the tensor axes "
                          f"split in an MoE layer, but there are {missing}; leave it `auto`")
    tensor = _size(shape, tensor_axes)
    dense = m.num_experts == 0 or m.dense_layers > 0
    split = [what for what, on in (("a dense layer's MLP", dense),
                                   ("each expert's FFN (parallel.moe_tensor: ffn)",
                                    bool(m.num_experts) and tensor > 1
                                    and moe_tensor(config) == "ffn")) if on]
    if split and m.d_ff % tensor:
        raise ConfigError(
            f"model.d_ff: {m.d_ff} cannot be split over the {tensor} tensor-parallel devices "
            f"(parallel.tensor: {list(tensor_axes)}), which split {' and '.join(split)}")


def _check_sequence_parallel(config: Config) -> None:
    """``parallel.sequence_parallel`` has tensor axes to split the sequence over, they
    divide it, and the model is meshkit's (a factory's model places its own
    activations)."""
    shape = config.mesh.strategy().shape
    tensor_axes = axis_names(config.parallel.tensor, "parallel.tensor")
    if config.model.factory is not None:
        raise ConfigError("parallel.sequence_parallel: splits meshkit's transformer's "
                          "activations; a model.factory model places its own (constrain them "
                          "with meshkit.constrain)")
    if not tensor_axes:
        raise ConfigError("parallel.sequence_parallel: splits the sequence over the tensor "
                          "axes, but parallel.tensor is empty")
    tensor, c = _size(shape, tensor_axes), config.context_devices
    positions = config.train.seq_len // c  # each context device's share of a sequence
    if positions % tensor:
        held = f"train.seq_len={config.train.seq_len}" if c == 1 else (
            f"the {positions} positions per context device (train.seq_len="
            f"{config.train.seq_len} over {c} context devices)")
        raise ConfigError(
            f"parallel.sequence_parallel: the {tensor} tensor devices (parallel.tensor: "
            f"{list(tensor_axes)}) do not divide {held}")


def _check_context(config: Config) -> None:
    """The context axes are listed outer first, the method has them and the heads it
    needs, and ``train.seq_len`` cuts into the ``2c`` load-balanced chunks."""
    p, m = config.parallel, config.model
    shape = config.mesh.strategy().shape
    axes = config.context_axes
    if not axes:
        if p.context_method != "auto":
            raise ConfigError(f"parallel.context_method: {p.context_method!r} says how attention "
                              "crosses the context axes, but parallel.context is empty; name "
                              "them there, or leave it `auto`")
        return
    in_mesh_order = tuple(a for a in shape if a in axes)
    if axes != in_mesh_order:
        raise ConfigError(f"parallel.context: list the axes outer first, as mesh.axes orders "
                          f"them: {list(in_mesh_order)}, got {list(axes)}")
    c = config.context_devices
    named = f"parallel.context: {list(axes)}"
    if config.train.seq_len % (2 * c):
        raise ConfigError(
            f"train.seq_len: {config.train.seq_len} is not divisible by 2c = {2 * c}: the "
            f"{c} context devices ({named}) each hold two of 2c equal chunks of every "
            "sequence (load-balanced causal work)")
    method = p.context_method
    if method == "hierarchical" and len(axes) < 2:
        raise ConfigError(f"parallel.context_method: hierarchical runs Ulysses over the last "
                          f"context axis and a ring over the others, so it needs two or more "
                          f"context axes; got {named}")
    if m.factory is None and method in ("ulysses", "hierarchical"):
        # Ulysses needs each tensor rank's heads to divide among its group.
        group = c if method == "ulysses" else shape[axes[-1]]
        over = (f"the {c} context devices ({named})" if method == "ulysses" else
                f"the {group} devices of the last context axis {axes[-1]!r}, over which "
                "hierarchical runs Ulysses")
        problem = context_heads_problem(config, group)
        if problem:
            raise ConfigError(f"parallel.context_method: {method} splits {problem} over "
                              f"{over}, which does not divide them; use ring or all_gather")


def context_heads_problem(config: Config, group: int) -> str | None:
    """Which heads of one tensor rank a Ulysses group of ``group`` devices cannot split.

    Ulysses trades sequence shards for head shards: each tensor rank's query heads and
    K/V heads must divide among the group. A tensor rank holds ``num_heads / t`` query
    heads, and ``num_kv_heads / t`` K/V heads where ``t`` divides them (all of them
    otherwise: they are replicated).

    Args:
        config: the config (meshkit's transformer: the heads are the model section's).
        group: the devices of the Ulysses all-to-all.

    Returns:
        The heads that do not divide, as a phrase naming their keys; ``None`` when both do.

    Examples:
        >>> from meshkit.config import Config
        >>> cfg = Config().replace(model={"num_heads": 8, "num_kv_heads": 2, "d_model": 64})
        >>> context_heads_problem(cfg, 4)
        'the 2 kv heads of each tensor rank (model.num_kv_heads=2)'
        >>> context_heads_problem(cfg, 2) is None
        True
    """
    m = config.model
    t = _size(config.mesh.strategy().shape, config.axes_with_role("tensor"))
    kv = m.kv_heads // t if m.kv_heads % t == 0 else m.kv_heads
    for what, key, total, held in (("query heads", "model.num_heads", m.num_heads,
                                    m.num_heads // t),
                                   ("kv heads", "model.num_kv_heads", m.kv_heads, kv)):
        if held % group:
            spread = ("" if t == 1 else f" over {t} tensor devices" if held * t == total else
                      f" replicated on each of {t} tensor devices, which do not divide them")
            return f"the {held} {what} of each tensor rank ({key}={total}{spread})"
    return None
