"""Parallel strategies: an N-d array of rank ids with named axes.

A :class:`Strategy` answers host-side questions about a hybrid parallel layout without
touching JAX: where a rank sits (its coordinates), which ranks it talks to over some
axes (its communication group), and who its pipeline neighbours are.

The rule behind every group: a rank's group over axes ``A`` is every rank whose
coordinates agree with it outside ``A``, ordered row-major over ``A`` in the order
given. All groups over ``A`` at once are the rank array with ``A`` moved to the end and
reshaped to ``[-1, prod(sizes of A)]``, which is vectorised and costs milliseconds for a
million ranks. These are exactly the replica groups XLA emits for a collective over the
corresponding mesh axes (``tests/test_hlo_groups.py`` proves it).

Axis order is outer → inner: slowest links first (nodes), fastest last (devices).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import jax
    from jax.sharding import AxisType

__all__ = ["MAX_RANKS", "Strategy"]

Axes = str | Sequence[str]

MAX_RANKS = 2**24
"""The most ranks a strategy may have (16,777,216): its rank array and position index
then take 256 MiB. Larger axis sizes are a typo, not a cluster, and would exhaust memory
before any message could name them."""


def _check_size(name: str, size: Any, *, allow_fill: bool = False) -> int:
    """Return ``size`` as an int, or raise naming the axis."""
    if isinstance(size, bool) or not isinstance(size, int | np.integer):
        if isinstance(size, float) and size.is_integer():
            size = int(size)
        else:
            raise ValueError(f"axis {name!r}: size must be an integer, got {size!r}")
    size = int(size)
    if size == -1 and allow_fill:
        return size
    if size <= 0:
        hint = " (use -1 to fill from the world size)" if allow_fill else ""
        raise ValueError(f"axis {name!r}: size must be positive, got {size}{hint}")
    return size


def _rank_array(ranks: npt.ArrayLike) -> np.ndarray:
    """``np.asarray(ranks)``, with ragged nesting and huge or odd ids reported plainly."""
    try:
        arr = np.asarray(ranks)
    except (ValueError, TypeError, OverflowError):
        arr = None
    if arr is not None and arr.dtype.kind in "fO":
        # Python ints past int64 come out as floats (rounded) or objects: keep them exact.
        exact = np.asarray(ranks, dtype=object)
        if exact.shape == arr.shape and all(
            isinstance(r, int | np.integer) and not isinstance(r, bool) for r in exact.flat
        ):
            arr = exact
        elif arr.dtype == object:
            arr = None
    if arr is None:
        raise ValueError(
            "rank ids must form a rectangular array of integers (nested lists of one "
            "length per level)"
        )
    return arr


def _check_names(names: Iterable[Any]) -> tuple[str, ...]:
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"axis names must be non-empty strings, got {name!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate axis names: {dupes}")
    return names


class Strategy:
    """A parallel strategy: an array of rank ids whose dimensions are named axes.

    Args:
        ranks: integer array-like of any shape whose entries are a permutation of
            ``0 .. size-1``; ``ranks[i0, i1, ...]`` is the rank at those coordinates.
        axis_names: one name per dimension, outer → inner.

    Raises:
        ValueError: if names and dimensions disagree, names repeat or are empty, or the
            entries are not integers forming a permutation (the message lists the
            duplicate, missing or out-of-range ids).

    Examples:
        >>> s = Strategy([[0, 1, 2, 3], [4, 5, 6, 7]], ("node", "device"))
        >>> s.coords(5)
        {'node': 1, 'device': 1}
        >>> s.group(5, "node")
        (1, 5)
    """

    __slots__ = ("_names", "_position", "_ranks")

    def __init__(self, ranks: npt.ArrayLike, axis_names: Sequence[str]) -> None:
        names = (axis_names,) if isinstance(axis_names, str) else axis_names
        names = _check_names(names)
        arr = _rank_array(ranks)
        if arr.ndim != len(names):
            raise ValueError(
                f"{len(names)} axis names {list(names)} for a rank array with "
                f"{arr.ndim} dimensions of shape {arr.shape}"
            )
        if arr.size == 0:
            raise ValueError(f"rank array is empty (shape {arr.shape})")
        if arr.dtype == bool or not (
            np.issubdtype(arr.dtype, np.integer)
            or arr.dtype == object  # Python ints beyond 64 bits, range-checked next
            or (np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0))
        ):
            raise ValueError(f"rank ids must be integers, got dtype {arr.dtype}")
        size = arr.size
        # Range-check before converting: 2**64 - 1 as int64 would read as -1.
        flat = arr.ravel()
        if arr.dtype == object:
            bad = [r for r in flat.tolist() if not 0 <= r < size]
        else:
            bad = flat[(flat < 0) | (flat >= size)].tolist()
        if bad:
            shown = sorted({int(b) for b in bad})[:10]
            raise ValueError(f"rank ids out of range 0..{size - 1}: {shown}")
        arr = arr.astype(np.int64)
        flat = arr.ravel()
        counts = np.bincount(flat, minlength=size)
        if np.any(counts != 1):
            dupes = np.flatnonzero(counts > 1).tolist()
            missing = np.flatnonzero(counts == 0).tolist()
            raise ValueError(
                f"rank ids must be a permutation of 0..{size - 1}: "
                f"duplicates {dupes[:10]}, missing {missing[:10]}"
            )
        arr.setflags(write=False)
        position = np.empty(size, dtype=np.int64)
        position[flat] = np.arange(size)
        position.setflags(write=False)
        self._ranks = arr
        self._names = names
        self._position = position

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_axes(cls, axes: Mapping[str, int], world_size: int | None = None) -> Strategy:
        """Row-major strategy: rank ``r`` at the ``r``-th position of the array.

        Args:
            axes: ordered ``name -> size``, outer → inner. At most one size may be
                ``-1``; it is filled so the product equals ``world_size``.
            world_size: total number of ranks; checked against the product if given.

        Returns:
            The strategy ``arange(world_size).reshape(sizes)``.

        Raises:
            ValueError: non-integral or non-positive sizes, more than one ``-1``, a
                ``-1`` without ``world_size`` or not dividing it, product ≠ world size.

        Examples:
            >>> Strategy.from_axes({"node": -1, "device": 4}, world_size=8).axis_sizes
            (2, 4)
        """
        names = _check_names(axes.keys())
        if not names:
            raise ValueError("a strategy needs at least one axis")
        sizes = [_check_size(n, axes[n], allow_fill=True) for n in names]
        fills = [n for n, s in zip(names, sizes, strict=True) if s == -1]
        if world_size is not None:
            world_size = _check_size("world_size", world_size)
        if len(fills) > 1:
            raise ValueError(f"at most one axis size may be -1, got -1 for {fills}")
        known = math.prod(s for s in sizes if s != -1)
        if known > MAX_RANKS or (world_size or 0) > MAX_RANKS:
            raise ValueError(
                f"axis sizes {dict(zip(names, sizes, strict=True))} give "
                f"{max(known, world_size or 0):,} ranks, more than the {MAX_RANKS:,} a "
                "strategy may have"
            )
        if fills:
            if world_size is None:
                raise ValueError(f"axis {fills[0]!r} is -1 but no world_size was given")
            if world_size % known:
                raise ValueError(
                    f"axis {fills[0]!r} is -1 but the other axes (product {known}) "
                    f"do not divide world_size {world_size}"
                )
            sizes[names.index(fills[0])] = world_size // known
        elif world_size is not None and known != world_size:
            raise ValueError(
                f"axis sizes {dict(zip(names, sizes, strict=True))} multiply to {known}, "
                f"not world_size {world_size}"
            )
        return cls(np.arange(math.prod(sizes)).reshape(sizes), names)

    @classmethod
    def from_order(cls, order: str, **sizes: int) -> Strategy:
        """Megatron-style strategy from an order string listed innermost first.

        ``"tp-cp-ep-dp-pp"`` means tp varies fastest between consecutive ranks and pp
        slowest, as in Megatron-LM's ``RankGenerator``; the result's axes are the order
        reversed (outer → inner), so its groups equal Megatron's. It gives no axis a
        role: the config does (``cp`` is a context axis only where ``parallel.context``
        names it; an axis no key names is a data axis).

        Args:
            order: ``-``-separated axis names, innermost first.
            **sizes: the size of each axis; names not in ``order`` must have size 1
                (they are dropped); names in ``order`` without a size get size 1.

        Returns:
            A row-major strategy over the reversed order.

        Raises:
            ValueError: a repeated or empty token, or a size > 1 for an axis missing
                from the order.

        Examples:
            >>> s = Strategy.from_order("tp-dp", tp=2, dp=2)
            >>> s.axis_names, s.group(0, "dp")
            (('dp', 'tp'), (0, 2))
        """
        tokens = order.split("-")
        if any(not t for t in tokens):
            raise ValueError(f"order {order!r} has an empty token")
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        if repeated:
            raise ValueError(f"order {order!r} repeats {repeated}")
        missing = sorted(n for n, s in sizes.items() if s != 1 and n not in tokens)
        if missing:
            raise ValueError(f"axes {missing} have sizes > 1 but are missing from order {order!r}")
        return cls.from_axes({t: sizes.get(t, 1) for t in reversed(tokens)})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Strategy:
        """Strategy from a config's ``mesh:`` section (already parsed).

        To read a YAML file, use ``meshkit.config.load_config(path).strategy()``: the one
        loader, which ``meshkit train`` and ``meshkit mesh`` share.

        Args:
            config: a whole config mapping with a ``mesh`` key, or the ``mesh`` mapping
                itself: ``axes: {name: size}`` (ordered outer → inner, one ``-1`` allowed
                when ``ranks`` is given) and optionally ``ranks:`` as a nested list whose
                shape matches ``axes``.

        Returns:
            The strategy.

        Raises:
            TypeError: a path instead of a mapping.
            ValueError: ``config`` not a mapping, a missing ``mesh.axes``, ``mesh.axes``
                not a non-empty mapping, unknown keys, or a ``ranks`` array whose shape
                disagrees with ``axes``; and any error of :meth:`from_axes` or of the
                constructor.

        Examples:
            >>> Strategy.from_config({"axes": {"node": 2, "device": 4}}).size
            8
        """
        if isinstance(config, str | os.PathLike):
            raise TypeError(
                f"Strategy.from_config takes a parsed mesh mapping, not the path {config!r}; "
                "use meshkit.load_config(path).strategy()"
            )
        if not isinstance(config, Mapping):
            raise ValueError(f"mesh config must be a mapping, got {type(config).__name__}")
        mesh = config.get("mesh", config)
        if not isinstance(mesh, Mapping) or "axes" not in mesh:
            raise ValueError("config has no mesh.axes mapping")
        unknown = sorted(set(mesh) - {"axes", "ranks"})
        if unknown:
            raise ValueError(f"unknown keys in mesh config: {unknown} (valid: axes, ranks)")
        axes = mesh["axes"]
        if not isinstance(axes, Mapping) or not axes:
            raise ValueError(f"mesh.axes must be a non-empty mapping, got {axes!r}")
        ranks = mesh.get("ranks")
        if ranks is None:
            return cls.from_axes(axes)
        arr = _rank_array(ranks)
        layout = cls.from_axes(axes, world_size=arr.size)
        if arr.shape != layout.axis_sizes:
            raise ValueError(
                f"mesh.ranks has shape {arr.shape} but mesh.axes gives {layout.axis_sizes}"
            )
        return cls(arr, layout.axis_names)

    # ------------------------------------------------------------------ properties
    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outer → inner."""
        return self._names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """Axis sizes, in the order of :attr:`axis_names`."""
        return tuple(int(s) for s in self._ranks.shape)

    @property
    def shape(self) -> dict[str, int]:
        """Ordered ``name -> size`` mapping."""
        return dict(zip(self._names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        """Number of ranks."""
        return int(self._ranks.size)

    @property
    def ranks(self) -> np.ndarray:
        """The rank array (read-only)."""
        return self._ranks

    # ------------------------------------------------------------------ queries
    def _axes(self, axes: Axes, what: str) -> tuple[str, ...]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if not names:
            raise ValueError(f"{what}: no axes given")
        unknown = [a for a in names if a not in self._names]
        if unknown:
            raise ValueError(f"{what}: unknown axes {unknown}; axes are {list(self._names)}")
        twice = sorted({a for a in names if names.count(a) > 1})
        if twice:
            raise ValueError(f"{what}: axes named twice: {twice}")
        return names

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range 0..{self.size - 1}")
        return int(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank``, one per axis.

        Args:
            rank: a rank id in ``0 .. size-1``.

        Returns:
            Ordered ``axis -> coordinate`` mapping; :meth:`rank` inverts it.

        Raises:
            ValueError: if ``rank`` is not an integer in range.

        Examples:
            >>> Strategy.from_axes({"node": 2, "device": 4}).coords(6)
            {'node': 1, 'device': 2}
        """
        pos = np.unravel_index(self._position[self._check_rank(rank)], self._ranks.shape)
        return {n: int(c) for n, c in zip(self._names, pos, strict=True)}

    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (one keyword per axis).

        Args:
            **coords: a coordinate for every axis.

        Returns:
            The rank id there.

        Raises:
            ValueError: missing, extra (unknown) or out-of-range coordinates.

        Examples:
            >>> Strategy.from_axes({"node": 2, "device": 4}).rank(node=1, device=2)
            6
        """
        extra = sorted(set(coords) - set(self._names))
        missing = [n for n in self._names if n not in coords]
        if extra or missing:
            raise ValueError(
                f"rank(): coordinates must name every axis {list(self._names)}; "
                f"missing {missing}, unknown {extra}"
            )
        index = []
        for name, size in zip(self._names, self.axis_sizes, strict=True):
            c = coords[name]
            if isinstance(c, bool) or not isinstance(c, int | np.integer) or not 0 <= c < size:
                raise ValueError(f"rank(): coordinate {name}={c!r} out of range 0..{size - 1}")
            index.append(int(c))
        return int(self._ranks[tuple(index)])

    def groups(self, axes: Axes) -> np.ndarray:
        """Every communication group over ``axes``, vectorised.

        Args:
            axes: one axis name or a sequence of names (a fused group).

        Returns:
            int array ``[num_groups, group_size]``. Row ``g`` holds one group, ordered
            row-major over ``axes`` in the order given (first name slowest); rows are
            ordered by the remaining coordinates, outer → inner.

        Raises:
            ValueError: unknown axes, an axis named twice, or no axes.

        Examples:
            >>> Strategy.from_axes({"node": 2, "device": 4}).groups("node").tolist()
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        names = self._axes(axes, "groups")
        idx = [self._names.index(a) for a in names]
        rest = [i for i in range(len(self._names)) if i not in idx]
        group_size = math.prod(self.axis_sizes[i] for i in idx)
        return self._ranks.transpose(rest + idx).reshape(-1, group_size)

    def group(self, rank: int, axes: Axes) -> tuple[int, ...]:
        """The communication group of ``rank`` over ``axes``.

        Args:
            rank: a rank id.
            axes: one axis name or a sequence of names.

        Returns:
            The ranks sharing every coordinate of ``rank`` outside ``axes``, ordered
            row-major over ``axes`` in the order given.

        Raises:
            ValueError: a bad rank, unknown axes or an axis named twice.

        Examples:
            >>> Strategy.from_axes({"node": 2, "device": 4}).group(5, "device")
            (4, 5, 6, 7)
        """
        names = self._axes(axes, "group")
        pos = np.unravel_index(self._position[self._check_rank(rank)], self._ranks.shape)
        index: list[Any] = list(pos)
        for a in names:
            index[self._names.index(a)] = slice(None)
        sub = self._ranks[tuple(index)]
        # The slice keeps the selected axes in array order; reorder to the order given.
        kept = sorted(names, key=self._names.index)
        sub = sub.transpose([kept.index(a) for a in names])
        return tuple(int(r) for r in sub.ravel())

    def neighbors(self, rank: int, axis: str) -> tuple[int, int]:
        """Previous and next rank along ``axis``, cyclic (pipeline send/receive pairs).

        Args:
            rank: a rank id.
            axis: one axis name.

        Returns:
            ``(prev, next)``; on an axis of size 1 both are ``rank`` itself.

        Raises:
            ValueError: a bad rank, or ``axis`` unknown or not a single name.

        Examples:
            >>> Strategy.from_axes({"pp": 4, "tp": 2}).neighbors(0, "pp")
            (6, 2)
        """
        if not isinstance(axis, str):
            raise ValueError(f"neighbors: axis must be one axis name, got {axis!r}")
        group = self.group(rank, axis)
        i = group.index(rank)
        return group[i - 1], group[(i + 1) % len(group)]

    def view(self, axes: Mapping[str, int]) -> Strategy:
        """Another factorisation of the same ranks in the same flattened order.

        Useful for the dense view ``dp × tp`` and the expert view ``edp × ep`` of one
        set of devices.

        Args:
            axes: ordered ``name -> size``; one ``-1`` allowed.

        Returns:
            A strategy whose rank array is this one's, reshaped.

        Raises:
            ValueError: sizes that don't multiply to :attr:`size`, or bad names.

        Examples:
            >>> s = Strategy.from_axes({"dp": 4, "tp": 2})
            >>> s.view({"edp": 2, "ep": 4}).group(0, "ep")
            (0, 1, 2, 3)
        """
        layout = Strategy.from_axes(axes, world_size=self.size)
        return Strategy(self._ranks.reshape(layout.axis_sizes), layout.axis_names)

    def mesh(
        self,
        devices: Sequence[jax.Device] | None = None,
        axis_types: AxisType | Sequence[AxisType] | None = None,
        *,
        inner_axes: Sequence[str] | None = None,
    ) -> jax.sharding.Mesh:
        """This strategy as a ``jax.sharding.Mesh``: rank ``r`` is ``devices[r]``.

        Delegates to :func:`meshkit.strategy.mesh.make_mesh` (JAX is imported only here, so
        building and querying a strategy never starts JAX). A collective over mesh axes
        ``A`` then runs over exactly :meth:`groups` ``(A)``.

        Args:
            devices: devices indexed by rank (default ``jax.devices()``); only the first
                :attr:`size` are used.
            axis_types: ``None`` for ``AxisType.Auto`` on every axis, one
                ``jax.sharding.AxisType`` for all axes, or one per axis.
            inner_axes: axes whose groups must stay inside one process when the devices
                span several processes. Default: the longest suffix of axes whose sizes
                divide the devices per process.

        Returns:
            A mesh with this strategy's axis names and shape.

        Raises:
            ValueError: fewer devices than ranks, repeated devices, bad ``axis_types``,
                ``inner_axes`` that are not axes of the strategy, or a group over
                ``inner_axes`` that straddles processes.

        Examples:
            >>> mesh = Strategy.from_axes({"node": 1, "device": 1}).mesh()
            >>> mesh.axis_names, mesh.devices.shape
            (('node', 'device'), (1, 1))
        """
        from meshkit.strategy.mesh import make_mesh

        return make_mesh(self, devices, axis_types, inner_axes=inner_axes)

    # ------------------------------------------------------------------ dunder
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._ranks, other._ranks)

    def __hash__(self) -> int:
        return hash((self._names, self._ranks.shape, self._ranks.tobytes()))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        return f"Strategy({axes})"

    def __str__(self) -> str:
        body = np.array2string(self._ranks, threshold=256, max_line_width=100)
        return f"{self!r}\n{body}"
