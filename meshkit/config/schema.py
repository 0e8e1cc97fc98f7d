"""The run configuration: typed, frozen dataclasses loaded from YAML plus ``key=value`` overrides.

A :class:`Config` has six sections — ``mesh``, ``parallel``, ``exchange``, ``model``,
``data``, ``train`` — each a frozen dataclass whose fields carry their meaning in
``metadata["help"]`` (see :func:`format_reference`). Every section checks its own fields
in ``__post_init__`` and :class:`Config` checks the combinations (:func:`validate`), so
any ``Config`` that exists is valid, however it was built. Containers are immutable too
(``mesh.axes`` is a read-only mapping, lists become tuples), so a config is hashable and
read-only once built.

This module never imports JAX: the CLI loads and validates the config first, then sets the
simulated device count from :meth:`Config.strategy` before JAX starts.

Example:
    >>> cfg = load_config(None, ["train.steps=50", "exchange.method=flat"])
    >>> cfg.train.steps, cfg.exchange.method, cfg.expert_axes
    (50, 'flat', ('node', 'device'))
    >>> with_overrides(cfg, ["mesh.axes={node: 4, device: 2}"]).strategy()
    Strategy(node=4, device=2)
    >>> cfg.replace(train={"steps": 40}).train.steps  # ``dataclasses.replace`` validates too
    40
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import numbers
import os
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import yaml

from meshkit.choices import (
    BATCH_ROLES,
    DATA_KINDS,
    DISPATCH_MODES,
    DTYPES,
    EXCHANGE_METHODS,
    EXCHANGE_ORDERS,
    ROLES,
)
from meshkit.errors import UsageError
from meshkit.exchange.cost import PRESETS, is_topology_file, load_topology
from meshkit.strategy.axes import axis_names
from meshkit.strategy.ranks import Strategy

__all__ = [
    "ROLES",
    "Config",
    "ConfigError",
    "DataConfig",
    "ExchangeConfig",
    "MeshConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_devices",
    "format_reference",
    "load_config",
    "read_config_file",
    "validate",
    "with_overrides",
]

AxisNames = str | tuple[str, ...]
"""One mesh axis name, or several (a fused axis); ``()`` for none."""
RankArray = tuple[Any, ...]
"""A nested tuple of rank ids (the ``mesh.ranks`` array)."""

TEXT_VOCAB = 256  # byte-level text needs one id per byte value


class ConfigError(UsageError):
    """A bad config: the message names the dotted key (``model.num_experts``) at fault.

    A :class:`~meshkit.errors.UsageError`, hence a ``ValueError``, so callers that catch
    ``ValueError`` catch it too; the CLI prints the message and exits with status 2.

    Example:
        >>> try:
        ...     load_config(None, ["train.steps=0"])
        ... except ConfigError as e:
        ...     print(e)
        train.steps: must be >= 1, got 0
    """


# ---------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``3e-3`` is a float, not a str) that rejects
    duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_problem(e: Exception) -> str:
    """One line for a YAML error: PyYAML's own messages span several lines."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        what = " ".join(str(e.problem or e.context or "error").split())
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(e, yaml.reader.ReaderError):
        return f"unacceptable character {e.character!r} at position {e.position}"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return " ".join(str(e).split())


def _yaml_load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    # Besides YAMLError, PyYAML lets through ValueError (an impossible date such as
    # 2024-13-01, an int over Python's digit limit) and RecursionError (deep nesting).
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: invalid YAML: {_yaml_problem(e)}") from None


# ------------------------------------------------------------------- immutable values


class _FrozenAxes(dict[str, int]):
    """A read-only, hashable, order-sensitive ``name -> size`` mapping (``mesh.axes``)."""

    def _readonly(self, *args: Any, **kwargs: Any) -> typing.NoReturn:
        raise TypeError("mesh.axes is read-only; build a new config with with_overrides()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return list(self.items()) == list(other.items())

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    # dict declares itself unhashable; these frozen axes are hashable on purpose.
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self.items()),))

    def __repr__(self) -> str:
        return repr(dict(self))


_MAX_DIGITS_SHOWN = 24
INT32_MAX = 2**31 - 1
"""Upper bound of sizes and step counts: JAX indexes and counts them in int32."""
UINT32_MAX = 2**32 - 1
"""Upper bound of seeds (PRNG keys are built from 32-bit words)."""


def _show(value: Any) -> str:
    """``repr(value)``, with huge integers shortened (``1.000e+300``, not 301 digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(abs(value))
        if len(digits) > _MAX_DIGITS_SHOWN:
            sign = "-" if value < 0 else ""
            return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def _type_name(value: Any) -> str:
    return f"{_show(value)} ({type(value).__name__})"


def _as_int(value: Any, key: str) -> int:
    """An int (numpy ints too); an integral float such as ``1e3`` counts, a bool does not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{key}: expected an integer, got {_type_name(value)}")
    return int(value)


def _as_float(value: Any, key: str) -> float:
    """A finite float; ints are accepted (``capacity_factor=2``), bools and strings not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{key}: expected a number, got {_type_name(value)}")
    try:
        out = float(value)  # an int past 1.8e308 does not fit (found by the fuzz test)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{key}: expected a finite number, got {_show(value)}")
    return out


def _as_str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {_type_name(value)}")
    if not value:
        raise ConfigError(f"{key}: must not be empty")
    return value


def _as_optional_str(value: Any, key: str) -> str | None:
    return None if value is None else _as_str(value, key)


def _as_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_type_name(value)}")
    return value


def _as_optional_int(value: Any, key: str) -> int | None:
    return None if value is None else _as_int(value, key)


StepRange = tuple[int, int]
"""``[start, stop]``: the steps ``start, ..., stop - 1``, as Python's ``range``."""


def _as_optional_step_range(value: Any, key: str) -> StepRange | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(
            f"{key}: expected [start, stop] (two step numbers) or null, got {_type_name(value)}"
        )
    start, stop = _as_int(value[0], f"{key}[0]"), _as_int(value[1], f"{key}[1]")
    if start < 1:
        raise ConfigError(f"{key}: start must be >= 1 (steps count from 1), got {start}")
    if stop <= start:
        raise ConfigError(f"{key}: start must be below stop, got [{start}, {stop}]")
    return start, stop


def _as_axis_names(value: Any, key: str) -> AxisNames:
    """One axis name, or a list of them; ``[]`` or ``null`` for none."""
    if value is None:
        return ()
    if isinstance(value, str):
        return _as_str(value, key)
    if not isinstance(value, list | tuple):
        raise ConfigError(
            f"{key}: expected a mesh axis name or a list of them, got {_type_name(value)}"
        )
    names = tuple(_as_str(v, key) for v in value)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{key}: axes named twice: {twice}")
    return names


def _as_axes(value: Any, key: str) -> _FrozenAxes:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"{key}: expected a non-empty mapping of axis name to size, e.g. "
            f"{{node: 2, device: 4}}, got {_type_name(value)}"
        )
    out = []
    for name, size in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: axis names must be non-empty strings, got {_show(name)}")
        out.append((name, _as_int(size, f"{key}.{name}")))
    return _FrozenAxes(out)


_MAX_RANK_DIMS = 64  # numpy's limit on array dimensions


def _as_ranks(value: Any, key: str) -> RankArray | None:
    def freeze(v: Any, depth: int = 1) -> Any:
        if isinstance(v, list | tuple):
            if depth > _MAX_RANK_DIMS:
                raise ConfigError(f"{key}: nested more than {_MAX_RANK_DIMS} levels deep")
            return tuple(freeze(x, depth + 1) for x in v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key}: rank ids must be integers, got {_type_name(v)}")
        return v

    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: expected a nested list of rank ids, got {_type_name(value)}")
    return freeze(value)


_COERCE: dict[Any, Any] = {
    int: _as_int,
    float: _as_float,
    str: _as_str,
    str | None: _as_optional_str,
    int | None: _as_optional_int,
    bool: _as_bool,
    AxisNames: _as_axis_names,
    dict[str, int]: _as_axes,
    RankArray | None: _as_ranks,
    StepRange | None: _as_optional_step_range,
}


def _thaw(value: Any) -> Any:
    """Plain YAML-safe containers: mappings -> dict, tuples -> list."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(v) for v in value]
    return value


# ---------------------------------------------------------------------------- sections


def _field(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with its meaning (``help``) and the checks ``_Section`` runs.

    Defaults must be immutable (they are shared by every instance). ``le`` defaults to
    :data:`INT32_MAX` for integer fields (see ``_Section``).
    """
    metadata = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # Cached: resolving string annotations is the slow part of building a section.
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


class _Section:
    """Coerces and bounds-checks every field from its type and metadata, then ``_check``."""

    section: ClassVar[str]
    # Declared so the type checker sees every section as a dataclass (each subclass is).
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{self.section}.{f.name}"
            value = _COERCE[hints[f.name]](getattr(self, f.name), key)
            md = f.metadata
            # Every integer is bounded: a value past int32 would only fail later, inside
            # JAX, with an OverflowError instead of a message naming the key.
            integer = hints[f.name] in (int, int | None)
            le = md["le"] if md["le"] is not None or not integer else INT32_MAX
            if value is not None:  # an optional key left unset has nothing to bound
                if md["ge"] is not None and value < md["ge"]:
                    raise ConfigError(f"{key}: must be >= {md['ge']}, got {_show(value)}")
                if md["gt"] is not None and value <= md["gt"]:
                    raise ConfigError(f"{key}: must be > {md['gt']}, got {_show(value)}")
                if le is not None and value > le:
                    raise ConfigError(f"{key}: must be <= {le}, got {_show(value)}")
            if md["choices"] is not None and value is not None and value not in md["choices"]:
                raise ConfigError(
                    f"{key}: must be one of {', '.join(md['choices'])}; got {_show(value)}"
                )
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Checks between fields of one section."""


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
    """The parallel strategy: named mesh axes and optionally an explicit rank array.

    Raises:
        ConfigError: ``axes`` not a non-empty mapping of names to integer sizes,
            ``ranks`` not a nested list of integers, or a strategy the two do not form
            (non-positive sizes, ``-1`` without ``ranks``, ``ranks`` not a permutation
            or not shaped like ``axes``); the message starts with ``mesh``.

    Example:
        >>> MeshConfig(axes={"node": 1, "device": 8}).strategy()
        Strategy(node=1, device=8)
        >>> MeshConfig(axes={"node": -1, "device": 2}, ranks=[[3, 2], [1, 0]]).strategy().shape
        {'node': 2, 'device': 2}
        >>> MeshConfig(axes={"node": 0, "device": 4})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: mesh: axis 'node': size must be positive, got 0 ...
    """

    section: ClassVar[str] = "mesh"

    axes: dict[str, int] = _field(  # noqa: RUF009 (an immutable default)
        _FrozenAxes([("node", 2), ("device", 4)]),
        "mesh axes, outer → inner (slowest links first): name → size; their product is "
        "the number of devices",
    )
    ranks: RankArray | None = _field(  # noqa: RUF009 (an immutable default)
        None,
        "optional nested list of rank ids, shaped like `axes` (a permutation of 0..size-1; "
        "one axis size may then be -1); null = row-major",
    )

    def _check(self) -> None:
        try:
            self.strategy()
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None

    def strategy(self) -> Strategy:
        """The :class:`~meshkit.strategy.ranks.Strategy` this section describes.

        Returns:
            A strategy with ``axes`` as its axis names and sizes (a ``-1`` filled from
            ``ranks``), holding ``ranks`` or, when it is ``None``, row-major rank ids.

        Example:
            >>> mesh = MeshConfig(axes={"dp": 2, "tp": 2}, ranks=[[0, 2], [1, 3]])
            >>> mesh.strategy().group(0, "dp")
            (0, 1)
        """
        return Strategy.from_config({"axes": dict(self.axes), "ranks": _thaw(self.ranks)})


@dataclasses.dataclass(frozen=True)
class ParallelConfig(_Section):
    """What each mesh axis does: the data, fsdp, tensor and pipeline roles.

    The expert role is the exchange section's ``node_axis`` + ``device_axis``. A mesh axis
    named nowhere is a data axis, so a config without this section splits the batch over
    every axis, as before. Whether the axes exist and fit the model is checked by
    :func:`validate`.

    Raises:
        ConfigError: axis names that are not strings or are named twice in one role, or
            ``microbatches`` below 1.

    Example:
        >>> ParallelConfig(tensor="tp", pipeline="pp", microbatches=4).tensor
        'tp'
        >>> ParallelConfig(fsdp=["a", "a"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: parallel.fsdp: axes named twice: ['a']
    """

    section: ClassVar[str] = "parallel"

    data: AxisNames = _field(  # noqa: RUF009 (an immutable default)
        (),
        "mesh axes that split the batch, parameters replicated, gradients all-reduced "
        "over them; every axis with no role is a data axis too",
    )
    fsdp: AxisNames = _field(  # noqa: RUF009 (an immutable default)
        (),
        "mesh axes that split the batch and shard parameters and AdamW moments on the "
        "model width (ZeRO-3); weights are all-gathered for compute",
    )
    tensor: AxisNames = _field(  # noqa: RUF009 (an immutable default)
        (),
        "mesh axes for Megatron tensor parallelism: attention heads and the vocabulary "
        "(embedding, head) split, one all-reduce after attention; the MoE splits its "
        "tokens over them",
    )
    pipeline: str | None = _field(
        None, "one mesh axis (or null) splitting the layers into consecutive stages (GPipe)"
    )
    microbatches: int = _field(
        1, "pipeline microbatches per step; divides the per-device batch", ge=1
    )


@dataclasses.dataclass(frozen=True)
class ExchangeConfig(_Section):
    """How the MoE layer's all-to-all runs and which mesh axes it spans.

    Raises:
        ConfigError: an unknown ``method``, ``order`` or ``topology``; axis names that
            are not non-empty strings or are named twice; or axes in both ``node_axis``
            and ``device_axis``. Whether the axes exist in the mesh is checked by
            :func:`validate`.

    Example:
        >>> ExchangeConfig(method="hierarchical", node_axis=["pod", "node"]).node_axis
        ('pod', 'node')
        >>> ExchangeConfig(node_axis="a", device_axis=["b", "a"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: exchange.device_axis: axes ['a'] are also in ...
    """

    section: ClassVar[str] = "exchange"

    method: str = _field(
        "auto",
        "all_to_all method: `auto` (the cost model picks per call), `flat` or "
        "`hierarchical` (two-stage)",
        choices=EXCHANGE_METHODS,
    )
    node_axis: AxisNames = _field(  # noqa: RUF009 (an immutable default)
        "node", "mesh axis, or list of axes, spanning nodes: the outer exchange stage"
    )
    device_axis: AxisNames = _field(  # noqa: RUF009 (an immutable default)
        "device",
        "mesh axis, or list of axes, spanning a node's devices: the inner stage; experts "
        "are sharded over node_axis + device_axis",
    )
    order: str = _field(
        "node_first",
        "stage order of the two-stage exchange: `node_first` or `device_first`",
        choices=EXCHANGE_ORDERS,
    )
    dedup: bool = _field(
        False,
        "node-deduplicated exchange: a token crosses to each node once and its outputs "
        "there are summed before crossing back (needs node and device axes, dispatch: sort)",
    )
    topology: str | None = _field(
        None,
        f"cost-model preset for `method: auto` ({', '.join(f'`{p}`' for p in PRESETS)}) "
        "or a topology file (`*.yaml`, as `meshkit calibrate` writes); null = "
        "meshkit.exchange.cost.default_topology",
    )

    def _check(self) -> None:
        if self.topology is not None:
            if is_topology_file(self.topology):
                object.__setattr__(self, "topology", os.path.expanduser(self.topology))
                try:
                    load_topology(self.topology, nodes=1)
                except ValueError as e:
                    raise ConfigError(f"exchange.topology: {e}") from None
            elif self.topology not in PRESETS:
                raise ConfigError(
                    f"exchange.topology: must be one of {', '.join(PRESETS)} or a topology "
                    f"file (*.yaml); got {_show(self.topology)}"
                )
        node = axis_names(self.node_axis, "exchange.node_axis")
        both = [*node, *axis_names(self.device_axis, "exchange.device_axis")]
        twice = sorted({a for a in both if both.count(a) > 1})
        if twice:
            raise ConfigError(
                f"exchange.device_axis: axes {twice} are also in exchange.node_axis; "
                "the node and device axes must be disjoint"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """The decoder-only MoE transformer.

    Raises:
        ConfigError: a value of the wrong type or out of range; an unknown ``dispatch``
            or ``dtype``; ``top_k`` above ``num_experts``; ``d_model`` not
            split into ``num_heads`` heads of even size.

    Example:
        >>> ModelConfig(d_model=32, num_heads=4).head_dim
        8
        >>> ModelConfig(num_heads=3)
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: model.d_model: 64 is not divisible by model.num_heads=3
    """

    section: ClassVar[str] = "model"

    vocab_size: int = _field(16, "number of token ids (>= 256 for `data.kind: text`)", ge=2)
    d_model: int = _field(
        64, "model width; divisible by num_heads, with an even head size (rotary)", ge=1
    )
    num_layers: int = _field(2, "transformer blocks, each with an MoE feed-forward", ge=1)
    num_heads: int = _field(4, "attention heads", ge=1)
    d_ff: int = _field(128, "hidden size of each expert's gated FFN", ge=1)
    num_experts: int = _field(
        8,
        "experts per MoE layer; divisible by the number of expert devices (product of the "
        "sizes of exchange.node_axis and exchange.device_axis)",
        ge=1,
    )
    top_k: int = _field(
        2, "experts per token, 1 to num_experts; gates renormalised to sum to 1 when >= 2", ge=1
    )
    capacity_factor: float = _field(
        1.25,
        "expert capacity = ceil(capacity_factor × tokens × top_k / num_experts); tokens "
        "beyond it are dropped; 0 = dropless (worst-case buffers: tokens slots per expert)",
        ge=0,
    )
    num_shared_experts: int = _field(
        0, "shared experts (DeepSeekMoE): one dense SwiGLU of width num_shared_experts × "
        "d_ff on every token, added to the routed output", ge=0,
    )
    max_nodes: int | None = _field(
        None, "node-limited routing (DeepSeek-V3): a token's experts lie on at most this "
        "many nodes (product of exchange.node_axis); null = no limit", ge=1,
    )
    aux_loss_weight: float = _field(0.01, "weight of the Switch load-balancing loss", ge=0)
    z_loss_weight: float = _field(0.001, "weight of the router z-loss", ge=0)
    dispatch: str = _field(
        "sort",
        "`sort` (scatter by sorted token indices) or `einsum` (the GShard one-hot baseline, "
        "for benchmarks)",
        choices=DISPATCH_MODES,
    )
    dtype: str = _field("float32", "compute dtype: `float32` or `bfloat16`", choices=DTYPES)

    def _check(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model.top_k: {self.top_k} is more than model.num_experts={self.num_experts}"
            )
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"model.d_model: {self.d_model} is not divisible by "
                f"model.num_heads={self.num_heads}"
            )
        head_dim = self.d_model // self.num_heads
        if head_dim % 2:
            raise ConfigError(
                f"model.d_model: head size d_model / num_heads = {head_dim} must be even "
                "(rotary positions rotate pairs of features)"
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head, ``d_model // num_heads``."""
        return self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
    """The training data source.

    Raises:
        ConfigError: a value of the wrong type or out of range, an unknown ``kind``, or
            no ``path`` for the file kinds ``text`` and ``tokens``.

    Example:
        >>> DataConfig(kind="tokens", path="corpus.bin").path
        'corpus.bin'
        >>> DataConfig(kind="text")
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: data.path: required for data.kind='text'
    """

    section: ClassVar[str] = "data"

    kind: str = _field(
        "markov",
        "`markov` (synthetic, with an exact entropy rate), `text` (bytes of data.path) or "
        "`tokens` (uint16 ids in data.path)",
        choices=DATA_KINDS,
    )
    path: str | None = _field(None, "data file; required for `text` and `tokens`")
    order: int = _field(2, "Markov context length (tokens the next one depends on)", ge=1)
    concentration: float = _field(
        0.1, "Dirichlet concentration of the Markov transitions (smaller = lower entropy)", gt=0
    )
    seed: int = _field(0, "seed of the Markov transition table", ge=0, le=UINT32_MAX)

    def _check(self) -> None:
        if self.kind != "markov" and self.path is None:
            raise ConfigError(f"data.path: required for data.kind={self.kind!r}")
        if self.path is not None:  # as a shell would: no literal "~" directory
            object.__setattr__(self, "path", os.path.expanduser(self.path))


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
    """The optimisation loop, evaluation, logging and checkpoints.

    Raises:
        ConfigError: a value of the wrong type or out of range (the message names the
            key and the bound). Divisibility of ``batch_size`` by the mesh is checked by
            :func:`validate`.

    Example:
        >>> TrainConfig(steps=50, lr=3e-4).lr
        0.0003
        >>> TrainConfig(steps=0)
        Traceback (most recent call last):
        ...
        meshkit.config.schema.ConfigError: train.steps: must be >= 1, got 0
    """

    section: ClassVar[str] = "train"

    steps: int = _field(300, "optimizer steps", ge=1)
    batch_size: int = _field(
        32,
        "global batch in sequences; divisible by the batch devices (the batch is split over "
        "the data, fsdp and expert axes) times parallel.microbatches",
        ge=1,
    )
    seq_len: int = _field(64, "tokens per sequence", ge=1)
    lr: float = _field(1e-2, "peak learning rate of AdamW", gt=0)
    warmup_steps: int = _field(
        30, "linear warmup steps before the cosine decay (longer than steps: all warmup)", ge=0
    )
    weight_decay: float = _field(0.01, "AdamW weight decay", ge=0)
    grad_clip: float = _field(1.0, "clip gradients to this global norm", gt=0)
    seed: int = _field(
        0,
        "seed of the parameters and the data order (a batch depends on seed and step only, "
        "so a resumed run matches an uninterrupted one)",
        ge=0,
        le=UINT32_MAX,
    )
    log_every: int = _field(10, "steps between lines of `<workdir>/metrics.jsonl`", ge=1)
    eval_every: int = _field(100, "steps between evaluations", ge=1)
    eval_batches: int = _field(4, "batches per evaluation", ge=1)
    checkpoint_every: int = _field(
        100, "steps between checkpoints (one is also written at the end)", ge=1
    )
    keep_checkpoints: int = _field(2, "newest checkpoints kept", ge=1)
    workdir: str = _field(
        "runs/default",
        "directory for `config.yaml`, metrics and checkpoints; a rerun resumes from it",
    )
    profile_steps: StepRange | None = _field(  # noqa: RUF009 (an immutable default)
        None,
        "`[start, stop]`: write a `jax.profiler` trace of steps start..stop-1 to "
        "`<workdir>/profile` (null: no trace)",
    )

    def _check(self) -> None:
        # As a shell would: `train.workdir=~/run` means the home directory's run, not a
        # directory named "~" (the CLI gets the "~" unexpanded after the "=").
        object.__setattr__(self, "workdir", os.path.expanduser(self.workdir))
        if self.profile_steps is not None and self.profile_steps[1] > self.steps + 1:
            raise ConfigError(
                f"train.profile_steps: stop {self.profile_steps[1]} is past the run's last "
                f"step (train.steps={self.steps}; the steps start..stop-1 are traced, so "
                f"stop may be at most {self.steps + 1})"
            )


_SECTIONS: dict[str, type[_Section]] = {
    "mesh": MeshConfig,
    "parallel": ParallelConfig,
    "exchange": ExchangeConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
}


def _all_keys() -> list[str]:
    return [
        f"{name}.{f.name}"
        for name, cls in _SECTIONS.items()
        for f in dataclasses.fields(cls)
    ]


def _unknown(key: str, candidates: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {_show(key)}{hint}")


# ------------------------------------------------------------------------------ Config


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run: ``mesh``, ``parallel``, ``exchange``, ``model``, ``data``, ``train``.

    Validated on construction (each section, then :func:`validate`), so
    ``dataclasses.replace`` and :meth:`replace` check the result too.

    Raises:
        ConfigError: a section of the wrong type, or any check of :func:`validate`.

    Example:
        >>> Config().num_expert_devices, Config().strategy().size
        (8, 8)
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    exchange: ExchangeConfig = dataclasses.field(default_factory=ExchangeConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}, got {_type_name(value)}")
        validate(self)

    # -------------------------------------------------------------- conversions
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build and validate a config from nested mappings (e.g. parsed YAML).

        Args:
            d: ``{section: {key: value}}``; missing sections and keys take their
                defaults, a section may also be ``None`` (all defaults).

        Returns:
            The validated config.

        Raises:
            ConfigError: unknown keys at any level (with the closest valid key), values of
                the wrong type, or any failed check; the message names the dotted key.

        Example:
            >>> Config.from_dict({"train": {"steps": 5, "warmup_steps": 0}}).train.steps
            5
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"config: expected a mapping of sections {list(_SECTIONS)}, got {_type_name(d)}"
            )
        keys = _all_keys()
        for name in d:
            if name not in _SECTIONS:
                raise _unknown(str(name), [*_SECTIONS, *keys])
        sections: dict[str, Any] = {}
        for name, section_cls in _SECTIONS.items():
            raw = d.get(name)
            if isinstance(raw, section_cls):
                sections[name] = raw
                continue
            raw = {} if raw is None else raw
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{name}: expected a mapping of keys, got {_type_name(raw)}")
            fields = {f.name for f in dataclasses.fields(section_cls)}
            for k in raw:
                if k not in fields:
                    raise _unknown(f"{name}.{k}", keys)
            sections[name] = section_cls(**raw)
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dicts and lists, YAML/JSON-safe; :meth:`from_dict` inverts it.

        Returns:
            ``{section: {key: value}}`` with every key present.

        Example:
            >>> Config().to_dict()["mesh"]["axes"]
            {'node': 2, 'device': 4}
        """
        return {
            name: {k: _thaw(getattr(getattr(self, name), k)) for k in _section_fields(name)}
            for name in _SECTIONS
        }

    def to_yaml(self) -> str:
        """The config as YAML text (what training saves as ``<workdir>/config.yaml``).

        Returns:
            YAML that :func:`load_config` reads back to an equal config.

        Example:
            >>> load_config(None).to_yaml().startswith("mesh:")
            True
        """
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def replace(self, **sections: Any) -> Config:
        """A copy with some sections replaced or partly overridden, validated again.

        Args:
            **sections: per section name, either a section object or a mapping of that
                section's fields to new values.

        Returns:
            The new config.

        Raises:
            ConfigError: an unknown section or field, or any failed check.

        Example:
            >>> Config().replace(model={"num_experts": 16}, train={"steps": 40}).model.top_k
            2
        """
        keys = _all_keys()
        new: dict[str, Any] = {}
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise _unknown(name, [*_SECTIONS, *keys])
            if isinstance(value, Mapping):
                current = {k: getattr(getattr(self, name), k) for k in _section_fields(name)}
                for k in value:
                    if k not in current:
                        raise _unknown(f"{name}.{k}", keys)
                value = _SECTIONS[name](**{**current, **value})
            new[name] = value
        return dataclasses.replace(self, **new)

    # -------------------------------------------------------------- derived
    def strategy(self) -> Strategy:
        """The mesh section's :class:`~meshkit.strategy.ranks.Strategy` (numpy only, no JAX).

        Returns:
            ``self.mesh.strategy()``: the strategy whose ``size`` is the device count.

        Example:
            >>> Config().strategy().shape
            {'node': 2, 'device': 4}
        """
        return self.mesh.strategy()

    @property
    def node_axes(self) -> tuple[str, ...]:
        """``exchange.node_axis`` as a tuple of mesh axis names."""
        return axis_names(self.exchange.node_axis, "exchange.node_axis")

    @property
    def device_axes(self) -> tuple[str, ...]:
        """``exchange.device_axis`` as a tuple of mesh axis names."""
        return axis_names(self.exchange.device_axis, "exchange.device_axis")

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The axes experts are sharded over: node axes, then device axes."""
        return (*self.node_axes, *self.device_axes)

    @property
    def num_expert_devices(self) -> int:
        """Devices one MoE layer's experts are spread over (product of the expert axes)."""
        shape = self.strategy().shape
        return math.prod(shape[a] for a in self.expert_axes)

    @property
    def num_devices(self) -> int:
        """Devices the mesh needs (the strategy's size)."""
        return self.strategy().size

    @property
    def roles(self) -> dict[str, str]:
        """Each mesh axis's role (one of :data:`meshkit.choices.ROLES`), in mesh order.

        Example:
            >>> cfg = load_config(None, ["mesh.axes={pp: 2, tp: 2, node: 2}",
            ...     "parallel.tensor=tp", "parallel.pipeline=pp", "exchange.device_axis=[]"])
            >>> cfg.roles
            {'pp': 'pipeline', 'tp': 'tensor', 'node': 'expert'}
        """
        claims = _role_claims(self)
        return {a: claims[a][0][0] if a in claims else "data" for a in self.strategy().shape}

    def axes_with_role(self, *roles: str) -> tuple[str, ...]:
        """The mesh axes that have any of ``roles``, in mesh order.

        Args:
            *roles: names from :data:`ROLES`.

        Returns:
            The axes, outer → inner.

        Raises:
            ValueError: an unknown role.

        Example:
            >>> Config().axes_with_role("expert")
            ('node', 'device')
        """
        unknown = [r for r in roles if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown roles {unknown}; valid: {', '.join(ROLES)}")
        return tuple(a for a, r in self.roles.items() if r in roles)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: data, fsdp and expert axes, in mesh order."""
        return self.axes_with_role(*BATCH_ROLES)

    @property
    def batch_devices(self) -> int:
        """How many ways the batch is split: the product of the :attr:`batch_axes` sizes."""
        shape = self.strategy().shape
        return math.prod(shape[a] for a in self.batch_axes)


def _role_claims(config: Config) -> dict[str, list[tuple[str, str]]]:
    """Axis -> ``(role, config key)`` for each key that names it (expert: the exchange)."""
    p = config.parallel
    claims: dict[str, list[tuple[str, str]]] = {}
    for role, key, axes in (
        ("data", "parallel.data", axis_names(p.data, "parallel.data")),
        ("fsdp", "parallel.fsdp", axis_names(p.fsdp, "parallel.fsdp")),
        ("tensor", "parallel.tensor", axis_names(p.tensor, "parallel.tensor")),
        ("pipeline", "parallel.pipeline", () if p.pipeline is None else (p.pipeline,)),
        ("expert", "exchange.node_axis", config.node_axes),
        ("expert", "exchange.device_axis", config.device_axes),
    ):
        for axis in axes:
            claims.setdefault(axis, []).append((role, key))
    return claims


def _section_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTIONS[name])]


def validate(config: Config) -> None:
    """Check the combinations of sections (each section has checked itself already).

    ``Config`` runs this on construction; call it directly only on a config you built
    around the dataclass machinery.

    Args:
        config: the config.

    Raises:
        ConfigError: a role's axis (``parallel.*``, ``exchange.node_axis``,
            ``exchange.device_axis``) that is not a mesh axis or already has another role;
            experts not divisible by the expert devices (``model.num_experts``);
            ``exchange.dedup`` without node and device axes or with einsum dispatch;
            ``model.max_nodes`` above the node count or its nodes holding fewer than
            ``top_k`` experts; heads or
            vocabulary not divisible by the tensor size; ``d_model`` not divisible by the
            fsdp size; pipeline stages not dividing ``num_layers``; microbatches without
            a pipeline or not dividing the per-device batch; a batch not divisible by the
            batch devices (``train.batch_size``); a vocabulary under 256 for text.

    Example:
        >>> validate(Config())
    """
    shape = config.mesh.strategy().shape
    m, t, p = config.model, config.train, config.parallel
    claims = _role_claims(config)
    for axis, named in claims.items():
        if axis not in shape:
            raise ConfigError(
                f"{named[0][1]}: {axis!r} is not an axis of the mesh "
                f"(mesh.axes: {', '.join(shape)})"
            )
        if len(named) > 1:
            raise ConfigError(
                f"{named[1][1]}: axis {axis!r} already has a role ({named[0][0]}, from "
                f"{named[0][1]}); each mesh axis has at most one role"
            )

    def size(axes: tuple[str, ...]) -> int:
        return math.prod(shape[a] for a in axes)

    sizes = "×".join(str(shape[a]) for a in config.expert_axes) or "1"
    expert_devices = size(config.expert_axes)
    if m.num_experts % expert_devices:
        raise ConfigError(
            f"model.num_experts: {m.num_experts} is not divisible by the "
            f"{expert_devices} expert devices ({'×'.join(config.expert_axes)} = {sizes})"
        )
    if config.exchange.dedup and not (config.node_axes and config.device_axes):
        raise ConfigError(
            "exchange.dedup: needs both exchange.node_axis and exchange.device_axis, got "
            f"{list(config.node_axes)} and {list(config.device_axes)}"
        )
    if config.exchange.dedup and m.dispatch != "sort":
        raise ConfigError(
            f"exchange.dedup: needs model.dispatch: sort, got {m.dispatch!r}"
        )
    nodes = size(config.node_axes)
    if m.max_nodes is not None and m.max_nodes > nodes:
        raise ConfigError(
            f"model.max_nodes: {m.max_nodes} is more than the {nodes} nodes "
            f"(exchange.node_axis: {list(config.node_axes)})"
        )
    if m.max_nodes is not None and m.max_nodes * (m.num_experts // nodes) < m.top_k:
        raise ConfigError(
            f"model.max_nodes: {m.max_nodes} node(s) of {m.num_experts // nodes} experts "
            f"hold fewer than model.top_k={m.top_k} experts"
        )
    tensor = size(axis_names(p.tensor, "parallel.tensor"))
    for key, value, what in (
        ("model.num_heads", m.num_heads, "attention heads"),
        ("model.vocab_size", m.vocab_size, "vocabulary entries (embedding and head)"),
    ):
        if value % tensor:
            raise ConfigError(
                f"{key}: {value} {what} cannot be split over the {tensor} tensor-parallel "
                f"devices (parallel.tensor: {list(axis_names(p.tensor, 'parallel.tensor'))})"
            )
    fsdp = size(axis_names(p.fsdp, "parallel.fsdp"))
    if m.d_model % fsdp:
        raise ConfigError(
            f"model.d_model: {m.d_model} cannot be sharded over the {fsdp} fsdp devices "
            f"(parallel.fsdp: {list(axis_names(p.fsdp, 'parallel.fsdp'))}); parameters are "
            "split on the model width"
        )
    if p.pipeline is not None and m.num_layers % shape[p.pipeline]:
        raise ConfigError(
            f"parallel.pipeline: {shape[p.pipeline]} stages (axis {p.pipeline!r}) do not "
            f"divide model.num_layers={m.num_layers}"
        )
    if p.pipeline is None and p.microbatches > 1:
        raise ConfigError(
            f"parallel.microbatches: {p.microbatches} microbatches need a pipeline axis "
            "(parallel.pipeline is null)"
        )
    batch_devices = config.batch_devices
    batch_desc = "×".join(f"{a}={shape[a]}" for a in config.batch_axes) or "none"
    if t.batch_size % batch_devices:
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is not divisible by the {batch_devices} "
            f"batch devices (the batch is split over the data, fsdp and expert axes: "
            f"{batch_desc})"
        )
    local = t.batch_size // batch_devices
    if local % p.microbatches:
        raise ConfigError(
            f"parallel.microbatches: {p.microbatches} does not divide the per-device batch "
            f"of {local} sequences (train.batch_size={t.batch_size} over {batch_devices} "
            "batch devices)"
        )
    tokens = local // p.microbatches * t.seq_len
    if tokens % tensor:
        raise ConfigError(
            f"parallel.tensor: the MoE splits each device's {tokens} tokens per microbatch "
            f"over the {tensor} tensor devices, which does not divide them; change "
            "train.batch_size or train.seq_len"
        )
    if config.data.kind == "text" and config.model.vocab_size < TEXT_VOCAB:
        raise ConfigError(
            f"model.vocab_size: {config.model.vocab_size} is too small for data.kind='text' "
            f"(byte-level text needs at least {TEXT_VOCAB})"
        )


# ------------------------------------------------------------------ loading, overrides


def _parse_override(item: str) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {_show(item)} is not key=value (e.g. train.steps=50)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {_show(item)} has an empty key (e.g. train.steps=50)")
    return key, _yaml_load(text, key)


def _apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the raw nested dict; ``mesh.axes.NAME`` sets one axis."""
    keys = _all_keys()
    parts = key.split(".")
    if len(parts) < 2 or parts[0] not in _SECTIONS or parts[1] not in _section_fields(parts[0]):
        raise _unknown(key, keys)
    section = raw.get(parts[0])
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"{parts[0]}: expected a mapping of keys, got {_type_name(section)}")
    section = dict(section or {})
    raw[parts[0]] = section
    if len(parts) == 2:
        section[parts[1]] = value
        return
    if parts[:2] != ["mesh", "axes"] or len(parts) != 3:
        raise _unknown(key, keys)
    axes = dict(_as_axes(section.get("axes", MeshConfig().axes), "mesh.axes"))
    if parts[2] not in axes:
        raise _unknown(key, [f"mesh.axes.{a}" for a in axes])
    axes[parts[2]] = value
    section["axes"] = axes


def _apply_overrides(raw: Any, overrides: Sequence[str]) -> Config:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got {overrides!r}")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config: expected a mapping of sections {list(_SECTIONS)}, got {_type_name(raw)}"
        )
    raw = dict(raw)
    for item in overrides:
        _apply_override(raw, *_parse_override(item))
    return Config.from_dict(raw)


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> Config:
    """Load a YAML config, apply ``key=value`` overrides and validate the result once.

    Keys missing from the file take their defaults. Override values are parsed as YAML
    (``50``, ``2.5``, ``3e-3``, ``null``, ``[ep, tp]``, ``{node: 1, device: 8}``); an int
    is accepted where a float is expected, a string where a number is expected is not.
    ``mesh.axes.NAME=SIZE`` changes the size of one existing axis.

    Args:
        path: a YAML file, or ``None`` for the embedded default (``meshkit/config/default.yaml``,
            2 nodes × 4 devices).
        overrides: ``"section.key=value"`` strings, applied in order.

    Returns:
        The validated, read-only config.

    Raises:
        ConfigError: a missing file, invalid YAML or a duplicate key, a malformed
            override, an unknown key (the message names the closest valid one), a value
            of the wrong type or failing a check (the message names the dotted key).

    Example:
        >>> load_config(None, ["model.capacity_factor=2"]).model.capacity_factor
        2.0
    """
    if path is None:
        where = "meshkit/config/default.yaml"
        text = importlib.resources.files("meshkit.config").joinpath("default.yaml").read_text()
    else:
        where = os.fspath(path)
        text = _read_config_file(where)
    return _apply_overrides(_yaml_load(text, where), overrides)


def _read_config_file(path: str) -> str:
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is harmless
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"cannot decode config file {path} as UTF-8: byte 0x{data[e.start]:02x} "
            f"at line {line} (offset {e.start})"
        ) from None


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML config file as plain data: no defaults filled in, nothing validated.

    For files meshkit wrote itself (a workdir's ``config.yaml``), to tell a damaged file
    from a valid one before :meth:`Config.from_dict` fills in defaults.

    Args:
        path: the YAML file.

    Returns:
        Whatever the YAML holds (a mapping, for a config).

    Raises:
        ConfigError: a missing file or a directory, bytes that are not UTF-8, invalid
            YAML or a duplicate key; the message names the file and the line.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp(), "config.yaml")
        >>> _ = path.write_text("{train: {steps: 5}, model: null}")
        >>> read_config_file(path)
        {'train': {'steps': 5}, 'model': None}
    """
    where = os.fspath(path)
    return _yaml_load(_read_config_file(where), where)


def with_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """A copy of ``config`` with ``key=value`` overrides applied, validated again.

    Args:
        config: the starting config.
        overrides: ``"section.key=value"`` strings, as for :func:`load_config`.

    Returns:
        The new config (``config`` itself is unchanged; configs are read-only).

    Raises:
        ConfigError: as :func:`load_config`.

    Example:
        >>> with_overrides(Config(), ["train.steps=10", "train.warmup_steps=0"]).train.steps
        10
    """
    return _apply_overrides(config.to_dict(), overrides)


def check_devices(config: Config, num_devices: int) -> None:
    """Check that the mesh fits on the available devices (call once JAX has started).

    Args:
        config: the config.
        num_devices: devices available, e.g. ``len(jax.devices())``.

    Raises:
        ConfigError: the strategy needs more devices than there are (names ``mesh``).

    Example:
        >>> check_devices(Config(), 8)
    """
    needed = config.num_devices
    if needed > num_devices:
        raise ConfigError(
            f"mesh: mesh needs {needed} devices but only {num_devices} are available "
            f"(mesh.axes: {dict(config.strategy().shape)})"
        )


# ---------------------------------------------------------------------- reference


def _format_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_format_default(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_format_default(v) for v in value) + "]"
    return str(value)


def _iter_reference() -> Iterator[tuple[str, str, str]]:
    for name, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield f"{name}.{f.name}", _format_default(f.default), f.metadata["help"]


def format_reference() -> str:
    """A markdown table of every config key, its default and its meaning.

    Returns:
        The table, one row per key, for the README's configuration reference.

    Example:
        >>> format_reference().splitlines()[0]
        '| key | default | meaning |'
    """
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, meaning in _iter_reference():
        rows.append(f"| `{key}` | `{default}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
