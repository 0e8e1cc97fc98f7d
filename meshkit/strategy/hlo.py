"""Read the collectives out of a compiled XLA program.

``collectives(compiled)`` lists every all-reduce, all-gather, reduce-scatter, all-to-all
and collective-permute of a compiled (or lowered-to-HLO-text) SPMD program, with the
device groups it runs over and the bytes it produces on each device. Groups are given as
logical device ids, which for a program compiled over a ``Mesh`` are positions in
``mesh.devices.flat``; :func:`groups_as_ranks` maps them through a :class:`Strategy` to
rank ids. This is how the tests prove that meshkit's groups are the compiler's groups
and what crosses a node boundary.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshkit.strategy.ranks import Strategy

__all__ = ["Collective", "collectives", "groups_as_ranks"]

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>" + "|".join(_OPS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[(?P<dims>[\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>(?:\{\d+,\s*\d+\},?\s*)*)\}")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
        op: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``
            or ``"collective-permute"`` (async ``-start`` forms are folded in).
        name: the instruction's name in the HLO text.
        groups: the device groups, each a tuple of logical device ids (mesh positions).
            For a collective-permute, the ``(source, target)`` pairs.
        shapes: the shape of each array the op produces on one device.
        dtypes: the dtype name of each of those arrays.
        bytes: total bytes the op produces on one device.

    Example:
        >>> text = '''HloModule m, num_partitions=4
        ...   %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,2},{1,3}}
        ... '''
        >>> (c,) = collectives(text)
        >>> c.op, c.name, c.groups
        ('all-reduce', 'ar', ((0, 2), (1, 3)))
        >>> c.shape, c.dtype, c.bytes
        ((8,), 'f32', 32)
    """

    op: str
    name: str
    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The first output's shape (the only one for most collectives).

        Returns:
            ``shapes[0]``.
        """
        return self.shapes[0]

    @property
    def dtype(self) -> str:
        """The first output's dtype name.

        Returns:
            ``dtypes[0]``, e.g. ``"f32"`` or ``"bf16"``.
        """
        return self.dtypes[0]


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    return int(dtype[1:])


def _parse_groups(rest: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = _IOTA_GROUPS.search(rest)
    if m:
        # Iota form: reshape(transpose(iota(dims), perm), shape), as XLA prints it.
        dims = [int(d) for d in m["dims"].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m["perm"]:
            ids = ids.transpose([int(p) for p in m["perm"].split(",")])
        shape = [int(d) for d in m["shape"].split(",")]
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    m = _EXPLICIT_GROUPS.search(rest)
    if m:
        groups = tuple(
            tuple(int(i) for i in g.split(",") if i.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", m["body"])
        )
        groups = tuple(g for g in groups if g)
        if groups:
            return groups
    m = _PAIRS.search(rest)
    if m:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),\s*(\d+)\}", m["body"]))
    # No groups printed means one group of every device.
    return (tuple(range(num_devices)),) if num_devices else ()


def _hlo_text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    as_text = getattr(compiled_or_text, "as_text", None)
    if as_text is None:
        raise TypeError(
            "collectives() takes HLO text or a compiled/lowered JAX program "
            f"(jax.jit(f).lower(...).compile()), got {type(compiled_or_text).__name__}"
        )
    text = as_text()
    if not isinstance(text, str):
        raise TypeError(f"{type(compiled_or_text).__name__}.as_text() gave no HLO text")
    return text


def collectives(compiled_or_text: Any) -> list[Collective]:
    """List the collectives of a compiled SPMD program, in program order.

    Args:
        compiled_or_text: ``jax.jit(f).lower(*args).compile()`` (preferred: groups are
            final after SPMD partitioning), or its ``as_text()``.

    Returns:
        One :class:`Collective` per collective instruction; groups as logical device
        ids (positions in the mesh's flattened device array).

    Raises:
        TypeError: if the argument is neither text nor has ``as_text()``, or its
            ``as_text()`` returns something other than a string.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = Strategy.from_axes({"node": 2, "device": 4}).mesh()
        >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "node"), mesh=mesh,
        ...             in_specs=P("node"), out_specs=P()))
        >>> [(c.op, c.groups) for c in collectives(f.lower(jnp.ones((2, 3))).compile())]
        [('all-reduce', ((0, 4), (1, 5), (2, 6), (3, 7)))]
    """
    text = _hlo_text(compiled_or_text)
    m = re.search(r"num_partitions=(\d+)", text)
    num_devices = int(m.group(1)) if m else None
    found = []
    for line in text.splitlines():
        match = _INSTR.match(line)
        if not match:
            continue
        arrays = _ARRAY.findall(match["type"])
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        dtypes = tuple(dtype for dtype, _ in arrays)
        if match["start"] and match["op"] == "collective-permute" and len(arrays) > 1:
            # collective-permute-start returns (operand, output, context scalars...).
            shapes, dtypes = shapes[1:2], dtypes[1:2]
        elif match["start"] and len(arrays) > 1:
            # Other async starts return (operands..., outputs...); keep the outputs.
            half = len(arrays) // 2
            shapes, dtypes = shapes[half:], dtypes[half:]
        nbytes = sum(
            int(np.prod(s, dtype=np.int64)) * _bits(d) // 8
            for s, d in zip(shapes, dtypes, strict=True)
        )
        found.append(
            Collective(
                op=match["op"],
                name=match["name"],
                groups=_parse_groups(match["rest"], num_devices),
                shapes=shapes,
                dtypes=dtypes,
                bytes=nbytes,
            )
        )
    return found


def groups_as_ranks(
    groups: Sequence[Sequence[int]], strategy: Strategy
) -> tuple[tuple[int, ...], ...]:
    """Map device-id groups (mesh positions) to rank ids through ``strategy``.

    Position ``p`` of a mesh built by :meth:`Strategy.mesh` holds rank
    ``strategy.ranks.flat[p]``.

    Args:
        groups: groups of logical device ids, as in :attr:`Collective.groups`.
        strategy: the strategy the mesh was built from.

    Returns:
        The same groups, each id replaced by its rank.

    Raises:
        ValueError: an id outside ``0 .. strategy.size-1``.

    Example:
        >>> s = Strategy([[1, 0], [3, 2]], ("node", "device"))
        >>> groups_as_ranks([(0, 2), (1, 3)], s)
        ((1, 3), (0, 2))
    """
    flat = strategy.ranks.ravel()
    out = []
    for g in groups:
        bad = [p for p in g if not 0 <= p < flat.size]
        if bad:
            raise ValueError(f"device ids {bad} outside the strategy's {flat.size} positions")
        out.append(tuple(int(flat[p]) for p in g))
    return tuple(out)
