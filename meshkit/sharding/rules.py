"""One place that says how things are sharded: each axis's role → specs for every kind.

:class:`ShardingRules` holds the mesh axes of each role (data, fsdp, tensor, pipeline,
the expert role's node and device axes, and context) and maps *logical* dimensions — the
kinds of dimension a parameter or activation has — to those axes:

============  ======================  ==================================================
logical       mesh axes               used for
============  ======================  ==================================================
``layers``    pipeline                the stacked layer dimension: stage s holds its
                                      ``L/S`` consecutive layers
``vocab``     tensor                  embedding rows and head columns (vocab-parallel)
``heads``     tensor                  attention heads (QKV columns, output rows)
``kv_heads``  tensor                  grouped-query attention's K/V heads; the model
                                      replicates them where the tensor axes do not
                                      divide them
``embed``     fsdp                    the model width of every weight matrix (ZeRO-3)
``mlp``       tensor                  a dense MLP's hidden width (column, then row
                                      parallel)
``experts``   node + device           the expert dimension of the expert weights
``expert_mlp`` tensor, under ``ffn``  each expert's hidden width (``moe_tensor="ffn"``:
                                      expert tensor parallelism); else whole
``batch``     data + fsdp + expert    the batch's rows (sequences); not the context axes
``sequence``  context                 each sequence's positions, outer context axis
                                      first (the model lays the sequence out in
                                      load-balanced chunks before it is split)
``tokens``    batch + context         the MoE's tokens; under ``moe_tensor="tokens"``
              (+ tensor)              tensor ranks split them too, so no two ranks route
                                      or run the same token
============  ======================  ==================================================

A context axis has no other role: the batch's rows are not split over it, each
sequence is (:attr:`ShardingRules.batch_context_axes` are all the axes over which
devices hold different tokens of the batch).

An expert axis may be an fsdp axis too (ZeRO-3 over the expert group, as MaxText shards
its non-expert weights over its expert axis): it then shards the expert dimension of the
expert weights and the model width of every other weight. A parameter's dimensions are
read left to right, and such an axis goes to the first that claims it.

A user's model brings its own names: :meth:`ShardingRules.extend` maps each to a role, to
another logical name, to mesh axes or to ``None`` (``rules.extend(mlp="tensor",
kv_heads="tensor", seq=None)``), and :meth:`ShardingRules.mesh_spec` turns a parameter's
names into mesh axes (:mod:`meshkit.sharding.place` shards whole models with it).
:meth:`ShardingRules.flax_rules` gives the same table to ``flax.nnx.logical_axis_rules``.

:mod:`meshkit.model.transformer` and :mod:`meshkit.model.moe` declare parameters by logical
names only
(``rules.spec("embed", None, "heads", None)``), and :mod:`meshkit.training.loop` reads the
batch's spec here, so no module hard-codes a mesh axis name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jax.sharding import PartitionSpec as P

from meshkit.choices import LOGICAL_AXES, MOE_TENSOR_MODES, ROLES
from meshkit.config.moe_tensor import resolve as resolve_moe_tensor
from meshkit.errors import UsageError
from meshkit.strategy.axes import AxisNames, axis_names

if TYPE_CHECKING:
    from meshkit.config import Config

__all__ = ["LOGICAL_AXES", "ShardingRules", "axes_entry", "entry_axes"]


Axes = tuple[str, ...]
#: What a logical name may map to: a role, another logical name, mesh axes, or ``None``.
Target = str | Sequence[str] | None


@dataclasses.dataclass(frozen=True, init=False)
class ShardingRules:
    """Mesh axes per role, and the partition specs they imply.

    Args:
        data: axes that split the batch; parameters replicated over them.
        fsdp: axes that split the batch and shard parameters on the model width.
        tensor: tensor-parallel axes (heads, vocabulary, a dense MLP's hidden width,
            and the MoE's tokens or its experts' hidden width, per ``moe_tensor``).
        pipeline: the pipeline axis, or ``None``.
        node: the expert role's node axes (the exchange's outer stage); may also be
            fsdp axes.
        device: the expert role's device axes (the exchange's inner stage); may also
            be fsdp axes.
        context: the axes that split each sequence (logical ``sequence``), outer axes
            first; attention exchanges K/V over them. No other role may name them, and
            they are not batch axes.
        batch: the batch axes in the order the batch is laid out; default
            ``data + fsdp + node + device`` (each axis once).
        sequence_parallel: the tokens between blocks split over the tensor axes
            (Megatron sequence parallelism, :mod:`meshkit.sharding.sequence`).
        moe_tensor: what the tensor axes split in an MoE layer: ``"tokens"`` or
            ``"ffn"`` (:data:`meshkit.choices.MOE_TENSOR_MODES`; ``auto`` is resolved
            before the rules are made, :func:`meshkit.config.moe_tensor.resolve`).
        logical: more logical names (a user model's own), each mapped as in
            :meth:`extend`.

    Raises:
        ValueError: an axis name that is not a non-empty string, an axis in two roles
            (but fsdp and expert; a context axis in no other), an unknown
            ``moe_tensor``, ``batch`` not made of exactly the data, fsdp and expert
            axes, or a bad ``logical`` entry (:meth:`extend`).

    Examples:
        >>> rules = ShardingRules(data="dp", tensor="tp", pipeline="pp", node="ep")
        >>> rules.spec("layers", "embed", None, "heads", None)
        P('pp', None, None, 'tp', None)
        >>> rules.spec("batch"), rules.spec("tokens"), rules.role("tp")
        (P(('dp', 'ep'),), P(('dp', 'ep', 'tp'),), 'tensor')
        >>> cp = ShardingRules(data="dp", context=("cpn", "cpd"))
        >>> cp.spec("batch", "sequence", None), cp.batch_context_axes
        (P('dp', ('cpn', 'cpd'), None), ('dp', 'cpn', 'cpd'))
    """

    data: Axes
    fsdp: Axes
    tensor: Axes
    pipeline: str | None
    node: Axes
    device: Axes
    #: The context axes, outer first: each sequence is split over them.
    context: Axes
    batch: Axes
    moe_tensor: str
    sequence_parallel: bool
    #: The user's logical names and the mesh axes each resolved to, in the order given.
    names: tuple[tuple[str, Axes], ...]
    #: ``(logical name, target)`` for each target taken as a mesh axis that no role
    #: names: the rules do not know the mesh, so :meth:`check_logical` checks these
    #: once it is known (a misspelt role would otherwise pass as an axis name).
    unchecked: tuple[tuple[str, str], ...] = dataclasses.field(compare=False, repr=False)

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
        context: AxisNames = (),
        batch: AxisNames | None = None,
        moe_tensor: str = "tokens",
        sequence_parallel: bool = False,
        logical: Mapping[str, Target] | None = None,
    ) -> None:
        for name, value in (("data", data), ("fsdp", fsdp), ("tensor", tensor),
                            ("node", node), ("device", device), ("context", context)):
            object.__setattr__(self, name, axis_names(value, f"ShardingRules: {name}"))
        if pipeline is not None:
            axis_names(pipeline, "ShardingRules: pipeline")
        object.__setattr__(self, "pipeline", pipeline)
        seen: dict[str, str] = {}
        for role, axes in self.by_role().items():
            for axis in axes:
                if axis in seen and (seen[axis], role) != ("fsdp", "expert"):
                    raise ValueError(
                        f"ShardingRules: axis {axis!r} is in two roles ({seen[axis]} and {role})"
                    )
                seen[axis] = role
        if moe_tensor not in MOE_TENSOR_MODES[1:]:
            raise ValueError(f"ShardingRules: moe_tensor must be one of "
                             f"{', '.join(MOE_TENSOR_MODES[1:])}, got {moe_tensor!r}")
        object.__setattr__(self, "moe_tensor", moe_tensor)
        object.__setattr__(self, "sequence_parallel", bool(sequence_parallel))
        default = tuple(dict.fromkeys((*self.data, *self.fsdp, *self.expert_axes)))
        batch_axes = default if batch is None else axis_names(batch, "ShardingRules: batch")
        if sorted(batch_axes) != sorted(default):
            raise ValueError(
                f"ShardingRules: batch {batch_axes} must hold exactly the data, fsdp and "
                f"expert axes {default}"
            )
        object.__setattr__(self, "batch", batch_axes)
        object.__setattr__(self, "names", ())
        object.__setattr__(self, "unchecked", ())
        resolved, unchecked = self._resolve(dict(logical or {}))
        object.__setattr__(self, "names", tuple(resolved.items()))
        object.__setattr__(self, "unchecked", unchecked)

    def extend(self, **logical: Target) -> ShardingRules:
        """New rules that also know a model's own logical names.

        Each name maps to one of:

        * a role (:data:`meshkit.choices.ROLES`): that role's axes, whatever they are
          named on this mesh (``mlp="tensor"``);
        * another logical name, built in or added before: its axes (``act="batch"``);
        * mesh axis names, one or a list (``seq="sp"``, ``seq=["a", "b"]``);
        * ``None``: replicated.

        A name may replace a built-in one (``embed=None`` turns FSDP off for the width),
        and may name another one of the same call, in any order. The rules do not know
        the mesh: an axis name that no role holds is checked against the mesh's axes
        where the mesh is known (:meth:`check_logical`, run by
        :func:`meshkit.sharding.place.partition_specs` and :func:`~meshkit.shard_model`).

        Args:
            **logical: name → target.

        Returns:
            The new rules; ``self`` is unchanged.

        Raises:
            ValueError: a name that is not an identifier, or a target that is none of
                the above (named with its logical name).
            UsageError: names that map to themselves or to each other in a cycle
                (``w="w"``, ``a="b", b="a"``); the message names the chain.

        Examples:
            >>> rules = ShardingRules(data="dp", tensor="tp").extend(
            ...     mlp="tensor", kv_heads="heads", seq=None)
            >>> rules.spec("batch", "seq", "mlp"), rules.axes("kv_heads")
            (P('dp', None, 'tp'), ('tp',))
        """
        resolved, unchecked = self._resolve(logical)
        merged = {name: axes for name, axes in self.names}
        merged.update(resolved)
        kept = tuple((name, axis) for name, axis in self.unchecked if name not in resolved)
        extended = copy.copy(self)
        object.__setattr__(extended, "names", tuple(merged.items()))
        object.__setattr__(extended, "unchecked", kept + unchecked)
        return extended

    def _resolve(
        self, logical: Mapping[str, Target]
    ) -> tuple[dict[str, Axes], tuple[tuple[str, str], ...]]:
        """The mesh axes of one :meth:`extend` call's entries, and its unchecked targets."""
        resolved: dict[str, Axes] = {}
        unchecked: list[tuple[str, str]] = []
        role_axes = {axis for axes in self.by_role().values() for axis in axes}

        def resolve(name: str, chain: tuple[str, ...]) -> Axes:
            if name in resolved:
                return resolved[name]
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"ShardingRules: logical name {name!r} must be an identifier")
            target = logical[name]
            if isinstance(target, str) and target not in ROLES and target not in role_axes:
                if target in chain:
                    loop = (*chain[chain.index(target):], target)
                    what = (f"logical name {name!r} maps to itself" if len(loop) == 2
                            else "logical names map to each other in a cycle")
                    raise UsageError(
                        f"ShardingRules: {what} ({' → '.join(loop)}); map each to a role, "
                        "another logical name, mesh axes or None")
                if target in logical:  # another name of this call, in any order
                    resolved[name] = resolve(target, (*chain, target))
                    return resolved[name]
            resolved[name] = self._target(name, target)
            if (isinstance(target, str) and target not in ROLES
                    and target not in self.logical_names() and target not in role_axes):
                unchecked.append((name, target))
            elif not isinstance(target, str) and target is not None:
                unchecked.extend((name, axis) for axis in resolved[name]
                                 if axis not in role_axes)
            return resolved[name]

        for name in logical:
            resolve(name, (name,))
        # In the order given, whatever order the names referred to each other in.
        return {name: resolved[name] for name in logical}, tuple(unchecked)

    def _target(self, name: str, target: Target) -> Axes:
        """The mesh axes of one :meth:`extend` entry that names no other entry."""
        if target is None:
            return ()
        if isinstance(target, str) and target in ROLES:
            return self.by_role()[target]
        if isinstance(target, str) and target in self.logical_names():
            return self.axes(target)
        try:
            return axis_names(target, "", required=True)
        except ValueError:
            raise ValueError(
                f"ShardingRules: logical name {name!r} maps to {target!r}; give a role "
                f"({', '.join(ROLES)}), a logical name, mesh axis names or None"
            ) from None

    def check_logical(self, mesh_axes: Sequence[str]) -> None:
        """Check that each logical name's mesh axes are axes of the mesh.

        :meth:`extend` takes a target that is no role and no logical name for a mesh
        axis name; this is where a misspelt role (``ffn="tensors"``) shows.

        Args:
            mesh_axes: the mesh's axis names.

        Raises:
            UsageError: a target that is none of a role, a logical name or a mesh axis,
                in one line naming the logical name and the target, with the closest
                valid target.

        Examples:
            >>> rules = ShardingRules(tensor="tp").extend(ffn="tensors")
            >>> try:
            ...     rules.check_logical(["tp"])
            ... except UsageError as e:
            ...     print(str(e)[:56], "...", str(e)[-23:])
            ShardingRules: logical name 'ffn' maps to 'tensors', whi ... did you mean 'tensor'?
        """
        for name, target in self.unchecked:
            if target in mesh_axes:
                continue
            valid = [*ROLES, *self.logical_names(), *mesh_axes]
            close = difflib.get_close_matches(target, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(
                f"ShardingRules: logical name {name!r} maps to {target!r}, which is not a "
                f"role ({', '.join(ROLES)}), a logical name ({', '.join(self.logical_names())})"
                f" nor a mesh axis ({', '.join(mesh_axes)}){hint}")
        for name, axes in self.names:  # e.g. a name that refers to one replaced since
            for axis in axes:
                if axis not in mesh_axes:
                    raise UsageError(f"ShardingRules: logical name {name!r} maps to mesh "
                                     f"axis {axis!r}, not an axis of the mesh "
                                     f"({', '.join(mesh_axes)})")

    @classmethod
    def from_config(cls, config: Config) -> ShardingRules:
        """The rules of a config's ``parallel`` and ``exchange`` sections.

        Args:
            config: a validated config (every mesh axis has one role).

        Returns:
            The rules, the batch laid out over its axes in mesh order, ``moe_tensor:
            auto`` resolved by the cost model.

        Examples:
            >>> from meshkit.config import Config
            >>> ShardingRules.from_config(Config()).expert_axes
            ('node', 'device')
        """
        return cls(
            data=config.axes_with_role("data"),
            fsdp=config.fsdp_axes,
            tensor=config.axes_with_role("tensor"),
            pipeline=config.parallel.pipeline,
            node=config.node_axes,
            device=config.device_axes,
            batch=config.batch_axes,
            moe_tensor=resolve_moe_tensor(config),
            sequence_parallel=config.parallel.sequence_parallel,
            context=config.context_axes,
        )

    # ------------------------------------------------------------------ roles
    def by_role(self) -> dict[str, Axes]:
        """Role (one of :data:`meshkit.choices.ROLES`) → its axes.

        Examples:
            >>> ShardingRules(fsdp="f", node="n").by_role()
            {'data': (), 'fsdp': ('f',), 'tensor': (), 'pipeline': (), 'expert': ('n',), \
'context': ()}
        """
        pipeline = () if self.pipeline is None else (self.pipeline,)
        roles = (self.data, self.fsdp, self.tensor, pipeline, (*self.node, *self.device),
                 self.context)
        return dict(zip(ROLES, roles, strict=True))

    def role(self, axis: str) -> str:
        """The role of one mesh axis; axes named nowhere are data axes.

        Args:
            axis: a mesh axis name.

        Returns:
            One of :data:`meshkit.choices.ROLES`.

        Examples:
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
        """The axes the batch's rows are split over (data, fsdp and expert axes; not the
        context axes, which split each row's positions)."""
        return self.batch

    @property
    def batch_context_axes(self) -> Axes:
        """Every axis over which devices hold different tokens of the batch: the batch
        axes, then the context axes (outer first).

        A token mean (the loss) sums its tokens and their count over these axes; the
        tensor and pipeline axes hold the same tokens (but under sequence parallelism,
        between blocks).

        Examples:
            >>> ShardingRules(data="dp", tensor="tp", context="cp").batch_context_axes
            ('dp', 'cp')
        """
        return (*self.batch_axes, *self.context)

    @property
    def token_axes(self) -> Axes:
        """The axes the MoE splits its tokens over: the batch axes, the context axes,
        then, under ``moe_tensor="tokens"``, the tensor axes.

        Examples:
            >>> ShardingRules(data="dp", tensor="tp", context="cp").token_axes
            ('dp', 'cp', 'tp')
        """
        return (*self.batch_context_axes,
                *(self.tensor if self.moe_tensor == "tokens" else ()))

    @property
    def expert_fsdp(self) -> Axes:
        """The fsdp axes that may shard an expert weight: those that are not expert axes
        (an axis of both shards the expert dimension)."""
        return tuple(a for a in self.fsdp if a not in self.expert_axes)

    # ------------------------------------------------------------------ specs
    def axes(self, logical: str | None) -> Axes:
        """The mesh axes one logical dimension is split over (``()``: replicated).

        Args:
            logical: a name from :meth:`logical_names`, or ``None``.

        Returns:
            The mesh axes.

        Raises:
            ValueError: an unknown logical name.

        Examples:
            >>> ShardingRules(fsdp=("a", "b")).axes("embed")
            ('a', 'b')
        """
        if logical is None:
            return ()
        table = self._table()
        if logical not in table:
            raise ValueError(
                f"unknown logical axis {logical!r}; valid: {', '.join(table)}"
            )
        return table[logical]

    def logical_names(self) -> tuple[str, ...]:
        """Every logical name these rules know: the built-in ones, then the added ones.

        Examples:
            >>> ShardingRules().extend(seq="sequence").logical_names()[-2:]
            ('kv_heads', 'seq')
        """
        return tuple(self._table())

    def _table(self) -> dict[str, Axes]:
        table: dict[str, Axes] = {
            "layers": () if self.pipeline is None else (self.pipeline,),
            "vocab": self.tensor,
            "heads": self.tensor,
            "embed": self.fsdp,
            "mlp": self.tensor,
            "experts": self.expert_axes,
            "expert_mlp": self.tensor if self.moe_tensor == "ffn" else (),
            "batch": self.batch_axes,
            "tokens": self.token_axes,
            "sequence": self.context,
            "kv_heads": self.tensor,
        }
        table.update(self.names)
        return table

    def spec(self, *logical: str | None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions have these logical names.

        Args:
            *logical: one name from :meth:`logical_names` (or ``None``) per dimension.

        Returns:
            The spec: one entry per dimension, ``None`` where replicated.

        Raises:
            ValueError: an unknown logical name.

        Examples:
            >>> ShardingRules(tensor="tp", fsdp="f").spec("vocab", "embed")
            P('tp', 'f')
            >>> ShardingRules(fsdp="ep", device="ep").spec("experts", "embed", None)
            P('ep', None, None)
        """
        return P(*(axes_entry(axes) for axes in self._claim([self.axes(n) for n in logical])))

    def _claim(self, dims: Sequence[Axes]) -> list[Axes]:
        """Each dimension's axes, an axis that is both fsdp and expert left to the first
        dimension that names it (a mesh axis shards at most one dimension)."""
        shared = set(self.fsdp) & set(self.expert_axes)
        taken: set[str] = set()
        out = []
        for axes in dims:
            kept = tuple(a for a in axes if a not in shared or a not in taken)
            taken.update(kept)
            out.append(kept)
        return out

    def mesh_spec(self, names: Sequence[Any], mesh_axes: Sequence[str]) -> P:
        """The ``PartitionSpec`` of a parameter's sharding metadata on a mesh.

        Each entry is ``None``, a name, or a tuple of names; a name is a logical name of
        these rules or, failing that, a mesh axis (as Flax's logical rules treat it), so
        metadata written with logical names and metadata written with mesh axes both
        work. A tuple of mesh axes alone is those axes, fused, even where one is also a
        logical name (Flax leaves tuples as they are too): meshkit's models write their
        expert dimension as ``("node", "experts")`` on a mesh whose axis ``experts``
        would otherwise stand for both.

        Args:
            names: one entry per dimension (e.g. ``nnx.Param``'s ``out_sharding``).
            mesh_axes: the mesh's axis names.

        Returns:
            The spec over mesh axes.

        Raises:
            ValueError: a name that is neither a logical name nor a mesh axis, or a mesh
                axis used by two dimensions; both named.

        Examples:
            >>> rules = ShardingRules(tensor="tp").extend(mlp="tensor")
            >>> rules.mesh_spec(("embed", "mlp"), ["dp", "tp"]), rules.mesh_spec(("dp",), ["dp"])
            (P(None, 'tp'), P('dp',))
            >>> ShardingRules(node="node", device="experts").mesh_spec(
            ...     (("node", "experts"), None), ["node", "experts"])
            P(('node', 'experts'), None)
        """
        table = self._table()
        entries: list[Any] = []
        used: dict[str, Any] = {}
        for entry in names:
            single = entry is None or isinstance(entry, str)
            group = (entry,) if single else tuple(entry)
            fused = not single and all(name in mesh_axes for name in group)
            axes: list[str] = []
            for name in group:
                if name is None:
                    continue
                if name in table and not fused:
                    axes.extend(table[name])
                elif name in mesh_axes:
                    axes.append(name)
                else:
                    raise ValueError(
                        f"unknown logical axis {name!r}: not one of the rules' logical "
                        f"names ({', '.join(table)}) nor a mesh axis {list(mesh_axes)}; "
                        f"add it with ShardingRules.extend({name}=...)"
                    )
            shared = set(self.fsdp) & set(self.expert_axes)
            axes = [a for a in axes if a not in shared or a not in used]
            for axis in axes:
                if axis in used:
                    raise ValueError(
                        f"mesh axis {axis!r} shards two dimensions ({used[axis]!r} and "
                        f"{entry!r}) of {tuple(names)}"
                    )
                used[axis] = entry
            entries.append(axes_entry(tuple(axes)))
        return P(*entries)

    def flax_rules(self) -> tuple[tuple[str, Any], ...]:
        """The rules as ``(logical name, mesh axes)`` pairs for Flax.

        For ``flax.nnx.logical_axis_rules``, so ``nnx.get_partition_spec`` and
        ``nnx.get_named_sharding`` read the same table meshkit does.

        Returns:
            One pair per logical name; the mesh axes are ``None``, one name or a tuple.

        Examples:
            >>> ShardingRules(tensor="tp").extend(kv_heads="tensor").flax_rules()[-1]
            ('kv_heads', 'tp')
        """
        return tuple((name, axes_entry(axes)) for name, axes in self._table().items())

    def check_mesh(self, axis_names: Sequence[str]) -> None:
        """Check that every axis of every role is a mesh axis.

        Args:
            axis_names: the mesh's axis names.

        Raises:
            ValueError: a role's axis missing from the mesh (named with its role).

        Examples:
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


def entry_axes(entry: Any) -> Axes:
    """The mesh axes of one ``PartitionSpec`` entry: ``None``, a name or names.

    Examples:
        >>> entry_axes(None), entry_axes("tp"), entry_axes(("dp", "tp"))
        ((), ('tp',), ('dp', 'tp'))
    """
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def axes_entry(axes: Sequence[str]) -> Any:
    """The ``PartitionSpec`` entry of some mesh axes: the inverse of :func:`entry_axes`.

    Examples:
        >>> axes_entry(()), axes_entry(("tp",)), axes_entry(("dp", "tp"))
        (None, 'tp', ('dp', 'tp'))
    """
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
