"""Read the collectives out of a compiled XLA program.

``collectives(compiled)`` lists every all-reduce, all-gather, reduce-scatter, all-to-all,
ragged all-to-all, collective-permute and collective-broadcast of a compiled (or
lowered-to-HLO-text) SPMD program, with the device groups it runs over and the bytes it
produces on each device. Groups are given as logical device ids, which for a program
compiled over a ``Mesh`` are positions in ``mesh.devices.flat``; :func:`groups_as_ranks`
maps them through a :class:`Strategy` to rank ids. This is how the tests prove that
meshkit's groups are the compiler's groups and what crosses a node boundary.

XLA prints a collective's groups in one of these forms, and each is read exactly:

- explicit lists, ``replica_groups={{0,4},{1,5},{2,6},{3,7}}`` (``shard_map``'s
  collectives);
- iota lists, ``replica_groups=[4,2]<=[2,2,2]T(0,2,1)``: ``iota(8)`` shaped ``[2,2,2]``,
  transposed by ``(0,2,1)``, read as 4 groups of 2;
- mesh axes, ``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (what ``jax.jit``
  partitioning prints): the devices of a mesh (``iota`` unless ``device_ids=(...)``
  follows, as an iota ``[2,4]T(1,0)`` or a flat list), grouped over the named axes or
  sub-axes (``'axis_0':(2)4``), the first named varying slowest;
- ``replica_groups={}``: every device of the id space the op's mode names;
- ``source_target_pairs={{0,1},{1,0}}`` for a collective-permute.

Which ids a group holds depends on the op's mode, as in XLA: with a ``channel_id`` and
``use_global_device_ids=true`` they are global ids; with only a ``channel_id``, partition
ids (all-to-all, collective-permute) or replica ids of every partition (all-reduce,
all-gather, reduce-scatter); without a ``channel_id``, replica ids within each partition.
All are reported as global ids ``replica * num_partitions + partition`` (partition ids,
for a ``jax.jit`` program: one replica). Text whose groups cannot be read this way raises
``ValueError`` quoting it: meshkit reports the compiler's groups or nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshkit.strategy.ranks import Strategy

__all__ = ["Collective", "collectives", "groups_as_ranks"]

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# These three hold use_global_device_ids as a plain bool, so with a channel_id its
# absence means cross-replica-and-partition mode, not cross-partition (XLA's
# GetCollectiveOpGroupMode); the other collectives never carry it.
_GLOBAL_ID_OPS = frozenset({"all-reduce", "all-gather", "reduce-scatter"})
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<after>.*)$")
_ARRAY_TYPE = re.compile(r"\w+\[[^\]]*\](?:\{[^}]*\})?")
_OPCODE = re.compile(r"\s+(?P<op>[\w\-]+)\(")
# A collective opcode anywhere outside quotes, for lines too odd to split.
_NAMES_OP = re.compile(r"\s(?:" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8e\w+|c64|c128)\[(?P<dims>[\d,]*)\]")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_INTS = r"\d+(?:,\d+)*"
_END = r"(?=,|$)"
_EXPLICIT_GROUPS = re.compile(
    r"\{(?P<body>\{\s*\d+(?:\s*,\s*\d+)*\s*\}(?:\s*,\s*\{\s*\d+(?:\s*,\s*\d+)*\s*\})*)?\}" + _END
)
_IOTA_GROUPS = re.compile(
    rf"\[(?P<shape>{_INTS})\]<=\[(?P<dims>{_INTS})\](?:T\((?P<perm>{_INTS})\))?" + _END
)
_NAME = r"(?:'[^']*'|[A-Za-z_][\w.]*)"
_MESH_GROUPS = re.compile(
    rf"mesh\[(?P<axes>{_NAME}=\d+(?:,{_NAME}=\d+)*)\]"
    rf"(?:, device_ids=\((?P<ids>\[{_INTS}\](?:T\({_INTS}\))?|{_INTS})\))?"
    rf" \{{(?P<group>(?:{_NAME}(?::\(\d+\)\d+)?(?:,{_NAME}(?::\(\d+\)\d+)?)*)?)\}}" + _END
)
_MESH_AXIS = re.compile(rf"(?P<name>{_NAME})=(?P<size>\d+)")
_AXIS_REF = re.compile(rf"(?P<name>{_NAME})(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_PAIRS = re.compile(
    r"\{(?P<body>\{\s*\d+\s*,\s*\d+\s*\}(?:\s*,\s*\{\s*\d+\s*,\s*\d+\s*\})*)?\}" + _END
)
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class Collective:
    r"""One collective instruction of a compiled program.

    Attributes:
        op: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``,
            ``"ragged-all-to-all"``, ``"collective-permute"`` or
            ``"collective-broadcast"`` (async ``-start`` forms are folded in; ``-done``
            is not a second collective).
        name: the instruction's name in the HLO text.
        groups: the device groups, each a tuple of logical device ids (mesh positions)
            in the order XLA ranks them (the order an all-gather concatenates). For a
            collective-permute, the ``(source, target)`` pairs.
        shapes: the shape of each array the op produces on one device.
        dtypes: the dtype name of each of those arrays.
        bytes: total bytes the op produces on one device.

    Examples:
        >>> header = "HloModule m, num_partitions=4"
        >>> line = ("  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1,"
        ...         " replica_groups={{0,2},{1,3}}, use_global_device_ids=true")
        >>> (c,) = collectives(header + "\n" + line)
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


def _ints(text: str) -> list[int]:
    return [int(i) for i in re.findall(r"\d+", text)]


def _iota_groups(m: re.Match[str]) -> list[tuple[int, ...]]:
    # XLA's IotaReplicaGroupList: reshape(transpose(iota(dims), perm), shape).
    shape, dims = _ints(m["shape"]), _ints(m["dims"])
    perm = _ints(m["perm"]) if m["perm"] else list(range(len(dims)))
    if len(shape) != 2 or math.prod(shape) != math.prod(dims):
        raise ValueError(f"iota groups {m[0]!r}: want [groups,size] of as many ids as dims")
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"iota groups {m[0]!r}: T(...) is not a permutation of the dims")
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape)
    return [tuple(int(i) for i in row) for row in ids]


def _mesh_groups(m: re.Match[str]) -> list[tuple[int, ...]]:
    text = m[0]
    axes = [(a["name"], int(a["size"])) for a in _MESH_AXIS.finditer(m["axes"])]
    names = [name for name, _ in axes]
    sizes = [size for _, size in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"mesh groups {text!r}: an axis name repeats")
    count = math.prod(sizes)
    if count == 0:
        raise ValueError(f"mesh groups {text!r}: an axis of size 0")
    if m["ids"] is None:
        devices = np.arange(count)
    elif m["ids"].startswith("["):
        # An iota device list prints as its reshape dims and transpose, as in the
        # iota group form, laid over the mesh shape.
        iota = re.fullmatch(rf"\[(?P<dims>{_INTS})\](?:T\((?P<perm>{_INTS})\))?", m["ids"])
        assert iota is not None  # _MESH_GROUPS only lets this shape through
        dims = _ints(iota["dims"])
        perm = _ints(iota["perm"]) if iota["perm"] else list(range(len(dims)))
        if math.prod(dims) != count or sorted(perm) != list(range(len(dims))):
            raise ValueError(f"mesh groups {text!r}: device_ids do not fit the mesh")
        devices = np.arange(count).reshape(dims).transpose(perm)
    else:
        devices = np.array(_ints(m["ids"]))
        if devices.size != count:
            raise ValueError(f"mesh groups {text!r}: {devices.size} device_ids, mesh {count}")
    # XLA's MeshAxesReplicaGroupList: split each mesh axis into the sub-axes the group
    # names (a sub-axis "x:(pre)size" is the middle factor of x = [pre, size, rest]),
    # move the named ones to the end in the order named, and read groups off the rows.
    refs: dict[int, list[tuple[int, int, int]]] = {}
    group_sizes = []
    for k, ref in enumerate(_AXIS_REF.finditer(m["group"])):
        if ref["name"] not in names:
            raise ValueError(f"mesh groups {text!r}: no mesh axis {ref['name']}")
        axis = names.index(ref["name"])
        pre, size = (int(ref["pre"]), int(ref["size"])) if ref["pre"] else (1, sizes[axis])
        if pre < 1 or size < 1:
            raise ValueError(f"mesh groups {text!r}: a sub-axis of size 0")
        refs.setdefault(axis, []).append((pre, size, k))
        group_sizes.append(size)
    split: list[int] = []
    position = [0] * len(group_sizes)
    for axis, full in enumerate(sizes):
        done = 1
        for pre, size, k in sorted(refs.get(axis, [])):
            if pre % done:
                raise ValueError(f"mesh groups {text!r}: sub-axes of {names[axis]} overlap")
            if pre > done:
                split.append(pre // done)
            position[k] = len(split)
            split.append(size)
            done = pre * size
        if full % done:
            raise ValueError(f"mesh groups {text!r}: sub-axes do not divide {names[axis]}")
        if full > done:
            split.append(full // done)
    rest = [d for d in range(len(split)) if d not in position]
    rows = devices.reshape(split).transpose(rest + position).reshape(-1, math.prod(group_sizes))
    return [tuple(int(i) for i in row) for row in rows]


def _read_groups(value: str) -> list[tuple[int, ...]] | None:
    """Groups of one printed form, ``None`` for ``{}``; ValueError for anything else."""
    m = _EXPLICIT_GROUPS.match(value)
    if m:
        if m["body"] is None:
            return None
        return [tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", m["body"])]
    m = _IOTA_GROUPS.match(value)
    if m:
        return _iota_groups(m)
    m = _MESH_GROUPS.match(value)
    if m:
        return _mesh_groups(m)
    raise ValueError(f"unrecognised replica_groups form: replica_groups={value[:200]}")


def _attribute(attrs: str, key: str) -> str | None:
    found = [m.end() for m in re.finditer(rf", {key}=", attrs)]
    if len(found) > 1:
        raise ValueError(f"{key}= appears {len(found)} times")
    return attrs[found[0]:] if found else None


class _Module:
    """What the module header says about the devices a program runs on."""

    def __init__(self, text: str) -> None:
        header = re.search(r"^HloModule\b.*$", text, re.MULTILINE)
        line = header[0] if header else ""
        replicas = re.search(r", replica_count=(\d+)", line)
        partitions = re.search(r", num_partitions=(\d+)", line)
        # XLA prints each count only when it is not 1. A header with neither (a lowered,
        # not compiled, module prints the default config) says nothing about the
        # devices, so nothing that needs a count is read from it.
        self.known = bool(replicas or partitions)
        self.replicas = int(replicas[1]) if replicas else 1
        self.partitions = int(partitions[1]) if partitions else 1

    def need_counts(self, why: str) -> None:
        if not self.known:
            raise ValueError(
                f"{why} needs the device count, and the module header states neither "
                "num_partitions nor replica_count (compile the program and pass that)"
            )


def _mode(op: str, attrs: str) -> str:
    # XLA's GetCollectiveOpGroupMode.
    channel = _attribute(attrs, "channel_id") is not None
    global_ids = _attribute(attrs, "use_global_device_ids")
    if op not in _GLOBAL_ID_OPS:
        if global_ids is not None:
            raise ValueError(f"{op} does not take use_global_device_ids")
        return "cross-partition" if channel else "cross-replica"
    value = re.match(r"(true|false)(?=,|$)", global_ids) if global_ids is not None else None
    if global_ids is not None and value is None:
        raise ValueError(f"unrecognised use_global_device_ids={global_ids[:40]}")
    flattened = value is not None and value[1] == "true"
    if not channel:
        if flattened:
            raise ValueError("use_global_device_ids=true without a channel_id")
        return "cross-replica"
    return "flattened" if flattened else "cross-replica-and-partition"


def _global_groups(
    groups: list[tuple[int, ...]] | None, mode: str, module: _Module
) -> tuple[tuple[int, ...], ...]:
    """Groups of printed ids → groups of global device ids ``replica * P + partition``."""
    replicas, partitions = module.replicas, module.partitions
    if mode == "flattened":
        if groups is None:
            raise ValueError("replica_groups={} with use_global_device_ids=true (XLA rejects)")
        space = replicas * partitions
    elif mode == "cross-partition":
        space = partitions
    else:
        module.need_counts(f"a {mode} collective")
        space = replicas
    if groups is None:
        module.need_counts("replica_groups={}")
        groups = [tuple(range(space))]
    bad = sorted({i for g in groups for i in g if i >= space})
    if module.known and bad:
        raise ValueError(f"ids {bad} outside the {space} the module header allows for {mode}")
    if mode == "flattened":
        return tuple(groups)
    if mode == "cross-partition":
        # One copy of each group per replica (usually one: then the ids are as printed).
        return tuple(
            tuple(r * partitions + p for p in g) for r in range(replicas) for g in groups
        )
    if mode == "cross-replica":
        return tuple(
            tuple(r * partitions + p for r in g) for p in range(partitions) for g in groups
        )
    # cross-replica-and-partition: every partition of each listed replica.
    return tuple(
        tuple(r * partitions + p for r in g for p in range(partitions)) for g in groups
    )


def _tuple_elements(text: str) -> list[str] | None:
    if not text.startswith("("):
        return None
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                elements.append(text[start:i])
                return [e.strip() for e in elements if e.strip()]
        elif ch == "," and depth == 1:
            elements.append(text[start:i])
            start = i + 1
    return None


def _closing(text: str, at: int) -> int:
    """Index of the ``)`` that closes the ``(`` at ``text[at]``; -1 if none does."""
    depth = 0
    for i in range(at, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return -1


def _split_instruction(after: str) -> tuple[str, str, str] | None:
    """``type op(operands), attrs`` → (type, op, attrs); None if not that shape."""
    if after.startswith("("):
        type_end = _closing(after, 0) + 1
    else:
        m = _ARRAY_TYPE.match(after)
        type_end = m.end() if m else 0
    op = _OPCODE.match(after, type_end) if type_end else None
    if not op:
        return None
    close = _closing(after, op.end() - 1)
    if close < 0:
        return None
    return after[:type_end], op["op"], after[close + 1 :].rstrip()


def _collective(name: str, type_text: str, opcode: str, attrs: str, module: _Module) -> Collective:
    start = opcode.endswith("-start")
    op = opcode.removesuffix("-start")
    out = type_text
    if start and op != "all-reduce":
        # all-reduce-start returns its results; the other starts return a tuple whose
        # second element is the result: (operands, results) for all-gather-start,
        # (operand, result, contexts...) for collective-permute-start, and
        # ((operands), result, ...) for the async wrappers XLA prints as "<op>-start".
        elements = _tuple_elements(type_text)
        if elements is None or len(elements) < 2:
            raise ValueError(f"{opcode} of type {type_text}: no result element to read")
        out = elements[1]
    arrays = _ARRAY.findall(out)
    shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
    dtypes = tuple(dtype for dtype, _ in arrays)
    nbytes = sum(
        int(np.prod(s, dtype=np.int64)) * _bits(d) // 8 for s, d in zip(shapes, dtypes, strict=True)
    )
    mode = _mode(op, attrs)
    if op == "collective-permute":
        value = _attribute(attrs, "source_target_pairs")
        m = _PAIRS.match(value) if value is not None else None
        if m is None:
            raise ValueError(f"unrecognised source_target_pairs: {(value or '(none)')[:200]}")
        pairs: list[tuple[int, ...]] = [
            (int(a), int(b)) for a, b in re.findall(r"(\d+)\s*,\s*(\d+)", m["body"] or "")
        ]
        groups = _global_groups(pairs, mode, module) if pairs else ()
    else:
        value = _attribute(attrs, "replica_groups")
        if value is None:
            raise ValueError("no replica_groups")
        groups = _global_groups(_read_groups(value), mode, module)
    return Collective(op, name, groups, shapes, dtypes, nbytes)


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
        ValueError: a collective whose groups are in a form this module does not know,
            or do not fit the module (ids beyond its devices, sub-axes that overlap),
            or need a device count the module header does not give (``{}`` in lowered
            rather than compiled text); the message quotes the instruction.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jax.sharding import NamedSharding
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = Strategy.from_axes({"node": 2, "device": 4}).mesh()
        >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "node"), mesh=mesh,
        ...             in_specs=P("node"), out_specs=P()))
        >>> [(c.op, c.groups) for c in collectives(f.lower(jnp.ones((2, 3))).compile())]
        [('all-reduce', ((0, 4), (1, 5), (2, 6), (3, 7)))]

        Programs ``jax.jit`` partitions itself print their groups over mesh axes:

        >>> x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P("node", "device")))
        >>> g = jax.jit(lambda x: x.sum(axis=1), out_shardings=NamedSharding(mesh, P("node")))
        >>> [(c.op, c.groups) for c in collectives(g.lower(x).compile())]
        [('all-reduce', ((0, 1, 2, 3), (4, 5, 6, 7)))]
    """
    text = _hlo_text(compiled_or_text)
    module = _Module(text)
    found = []
    for line in text.splitlines():
        match = _INSTR.match(line)
        if match is None:
            continue
        parts = _split_instruction(match["after"])
        if parts is None:
            if _NAMES_OP.search(_QUOTED.sub('""', line)):
                raise ValueError(f"cannot read this collective instruction: {line.strip()[:300]}")
            continue
        type_text, opcode, attrs = parts
        # Quoted strings (metadata, frontend attributes) may hold anything, even text
        # that looks like an attribute.
        attrs = _QUOTED.sub('""', attrs)
        if opcode.removesuffix("-start") not in _OPS:
            if re.search(r", (?:replica_groups|source_target_pairs)=", attrs):
                raise ValueError(
                    f"{opcode} carries device groups but is no collective meshkit knows: "
                    f"{line.strip()[:300]}"
                )
            continue
        try:
            found.append(_collective(match["name"], type_text, opcode, attrs, module))
        except ValueError as err:
            raise ValueError(f"{err}; in: {line.strip()[:300]}") from None
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

    Examples:
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
