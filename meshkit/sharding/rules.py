"""One place that says how things are sharded: each axis's role → specs for every kind.

:class:`ShardingRules` holds the mesh axes of each role (data, fsdp, tensor, pipeline,
and the expert role's node and device axes) and maps *logical* dimensions — the kinds
of dimension a parameter or activation has — to those axes:

============  ======================  ==================================================
logical       mesh axes               used for
============  ======================  ==================================================
``layers``    pipeline                the stacked layer dimension: stage s holds its
                                      ``L/S`` consecutive layers
``vocab``     tensor                  embedding rows and head columns (vocab-parallel)
``heads``     tensor                  attention heads (QKV columns, output rows)
``embed``     fsdp                    the model width of every weight matrix (ZeRO-3)
``experts``   node + device           the expert dimension of the expert weights
``batch``     data + fsdp + expert    the batch of tokens
``tokens``    batch + tensor          the MoE's tokens: tensor ranks split them, so no
                                      two ranks route or run the same token
============  ======================  ==================================================

:mod:`meshkit.model.transformer` and :mod:`meshkit.model.moe` declare parameters by logical
names only
(``rules.spec("embed", None, "heads", None)``), and :mod:`meshkit.train.loop` reads the
batch's spec here, so no module hard-codes a mesh axis name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jax.sharding import PartitionSpec as P

from meshkit.choices import ROLES
from meshkit.strategy.axes import AxisNames, axis_names

if TYPE_CHECKING:
    from meshkit.config import Config

__all__ = ["LOGICAL_AXES", "ShardingRules"]

#: The logical dimension names :meth:`ShardingRules.spec` accepts (``None``: replicated).
LOGICAL_AXES = ("layers", "vocab", "heads", "embed", "experts", "batch", "tokens")

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True, init=False)
class ShardingRules:
    """Mesh axes per role, and the partition specs they imply.

    Args:
        data: axes that split the batch; parameters replicated over them.
        fsdp: axes that split the batch and shard parameters on the model width.
        tensor: tensor-parallel axes (heads, vocabulary, MoE tokens).
        pipeline: the pipeline axis, or ``None``.
        node: the expert role's node axes (the exchange's outer stage).
        device: the expert role's device axes (the exchange's inner stage).
        batch: the batch axes in the order the batch is laid out; default
            ``data + fsdp + node + device``.

    Raises:
        ValueError: an axis name that is not a non-empty string, an axis in two roles,
            or ``batch`` not made of exactly the data, fsdp and expert axes.

    Example:
        >>> rules = ShardingRules(data="dp", tensor="tp", pipeline="pp", node="ep")
        >>> rules.spec("layers", "embed", None, "heads", None)
        P('pp', None, None, 'tp', None)
        >>> rules.spec("batch"), rules.spec("tokens"), rules.role("tp")
        (P(('dp', 'ep'),), P(('dp', 'ep', 'tp'),), 'tensor')
    """

    data: Axes
    fsdp: Axes
    tensor: Axes
    pipeline: str | None
    node: Axes
    device: Axes
    batch: Axes

    # An explicit constructor: it takes one axis name or several, the fields always
    # hold tuples, so both the callers and the uses type-check.
    def __init__(
        self,
        *,
        data: AxisNames = (),
        fsdp: AxisNames = (),
        tensor: AxisNames = (),
        pipeline: str | None = None,
        node: AxisNames = (),
        device: AxisNames = (),
        batch: AxisNames | None = None,
    ) -> None:
        for name, value in (("data", data), ("fsdp", fsdp), ("tensor", tensor),
                            ("node", node), ("device", device)):
            object.__setattr__(self, name, axis_names(value, f"ShardingRules: {name}"))
        if pipeline is not None:
            axis_names(pipeline, "ShardingRules: pipeline")
        object.__setattr__(self, "pipeline", pipeline)
        seen: dict[str, str] = {}
        for role, axes in self.by_role().items():
            for axis in axes:
                if axis in seen:
                    raise ValueError(
                        f"ShardingRules: axis {axis!r} is in two roles ({seen[axis]} and {role})"
                    )
                seen[axis] = role
        default = (*self.data, *self.fsdp, *self.expert_axes)
        batch_axes = default if batch is None else axis_names(batch, "ShardingRules: batch")
        if sorted(batch_axes) != sorted(default):
            raise ValueError(
                f"ShardingRules: batch {batch_axes} must hold exactly the data, fsdp and "
                f"expert axes {default}"
            )
        object.__setattr__(self, "batch", batch_axes)

    @classmethod
    def from_config(cls, config: Config) -> ShardingRules:
        """The rules of a config's ``parallel`` and ``exchange`` sections.

        Args:
            config: a validated config (every mesh axis has one role).

        Returns:
            The rules, the batch laid out over its axes in mesh order.

        Example:
            >>> from meshkit.config import Config
            >>> ShardingRules.from_config(Config()).expert_axes
            ('node', 'device')
        """
        return cls(
            data=config.axes_with_role("data"),
            fsdp=config.axes_with_role("fsdp"),
            tensor=config.axes_with_role("tensor"),
            pipeline=config.parallel.pipeline,
            node=config.node_axes,
            device=config.device_axes,
            batch=config.batch_axes,
        )

    # ------------------------------------------------------------------ roles
    def by_role(self) -> dict[str, Axes]:
        """Role (one of :data:`meshkit.choices.ROLES`) → its axes.

        Example:
            >>> ShardingRules(fsdp="f", node="n").by_role()
            {'data': (), 'fsdp': ('f',), 'tensor': (), 'pipeline': (), 'expert': ('n',)}
        """
        pipeline = () if self.pipeline is None else (self.pipeline,)
        roles = (self.data, self.fsdp, self.tensor, pipeline, (*self.node, *self.device))
        return dict(zip(ROLES, roles, strict=True))

    def role(self, axis: str) -> str:
        """The role of one mesh axis; axes named nowhere are data axes.

        Args:
            axis: a mesh axis name.

        Returns:
            One of :data:`meshkit.choices.ROLES`.

        Example:
            >>> ShardingRules(tensor="tp").role("tp"), ShardingRules().role("x")
            ('tensor', 'data')
        """
        for role, axes in self.by_role().items():
            if axis in axes:
                return role
        return "data"

    @property
    def expert_axes(self) -> Axes:
        """The axes the experts are split over: node axes, then device axes."""
        return (*self.node, *self.device)

    @property
    def batch_axes(self) -> Axes:
        """The axes the batch is split over (data, fsdp and expert axes)."""
        return self.batch

    @property
    def token_axes(self) -> Axes:
        """The axes the MoE splits its tokens over: the batch axes, then tensor axes."""
        return (*self.batch_axes, *self.tensor)

    # ------------------------------------------------------------------ specs
    def axes(self, logical: str | None) -> Axes:
        """The mesh axes one logical dimension is split over (``()``: replicated).

        Args:
            logical: a name from :data:`LOGICAL_AXES`, or ``None``.

        Returns:
            The mesh axes.

        Raises:
            ValueError: an unknown logical name.

        Example:
            >>> ShardingRules(fsdp=("a", "b")).axes("embed")
            ('a', 'b')
        """
        if logical is None:
            return ()
        table: dict[str, Axes] = {
            "layers": () if self.pipeline is None else (self.pipeline,),
            "vocab": self.tensor,
            "heads": self.tensor,
            "embed": self.fsdp,
            "experts": self.expert_axes,
            "batch": self.batch_axes,
            "tokens": self.token_axes,
        }
        if logical not in table:
            raise ValueError(
                f"unknown logical axis {logical!r}; valid: {', '.join(LOGICAL_AXES)}"
            )
        return table[logical]

    def spec(self, *logical: str | None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions have these logical names.

        Args:
            *logical: one name from :data:`LOGICAL_AXES` (or ``None``) per dimension.

        Returns:
            The spec: one entry per dimension, ``None`` where replicated.

        Raises:
            ValueError: an unknown logical name.

        Example:
            >>> ShardingRules(tensor="tp", fsdp="f").spec("vocab", "embed")
            P('tp', 'f')
        """
        return P(*(_entry(self.axes(name)) for name in logical))

    def check_mesh(self, axis_names: Sequence[str]) -> None:
        """Check that every axis of every role is a mesh axis.

        Args:
            axis_names: the mesh's axis names.

        Raises:
            ValueError: a role's axis missing from the mesh (named with its role).

        Example:
            >>> ShardingRules(tensor="tp").check_mesh(["dp"])
            Traceback (most recent call last):
            ...
            ValueError: tensor axis 'tp' is not an axis of the mesh ['dp']
        """
        for role, axes in self.by_role().items():
            for axis in axes:
                if axis not in axis_names:
                    raise ValueError(
                        f"{role} axis {axis!r} is not an axis of the mesh {list(axis_names)}"
                    )


def _entry(axes: Axes) -> Any:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
