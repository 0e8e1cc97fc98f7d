"""The strategy's groups are exactly the replica groups XLA compiles for a collective."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import Strategy
from meshkit.strategy.hlo import Collective, collectives, groups_as_ranks

_rng = np.random.default_rng(7)
STRATEGIES = [
    Strategy(_rng.permutation(8).reshape(2, 4), ("node", "device")),
    Strategy(_rng.permutation(8).reshape(4, 2), ("node", "device")),
    Strategy(_rng.permutation(8).reshape(2, 2, 2), ("dp", "ep", "tp")),
    Strategy(_rng.permutation(8), ("world",)),
    Strategy.from_axes({"node": 2, "device": 4}),
]


def _psum_groups(strategy: Strategy, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    mesh = strategy.mesh()
    spec = P(strategy.axis_names)
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axes), mesh=mesh,
                              in_specs=spec, out_specs=spec))
    x = jax.device_put(np.arange(2.0 * strategy.size, dtype=np.float32),
                       NamedSharding(mesh, spec))
    found = [c for c in collectives(f.lower(x).compile()) if c.op == "all-reduce"]
    assert len(found) == 1, found
    return groups_as_ranks(found[0].groups, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"{s!r}{s.ranks.ravel().tolist()}")
def test_groups_equal_compiled_replica_groups(strategy):
    names = strategy.axis_names
    for k in range(1, len(names) + 1):
        for axes in itertools.permutations(names, k):
            want = sorted(tuple(g) for g in strategy.groups(axes).tolist())
            assert sorted(_psum_groups(strategy, axes)) == want, axes


def test_collective_fields():
    strategy = Strategy.from_axes({"node": 2, "device": 4})
    mesh = strategy.mesh()
    spec = P(("node", "device"))
    f = jax.jit(jax.shard_map(
        lambda x: jax.lax.all_to_all(x, "node", 0, 0, tiled=True),
        mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(np.zeros(8 * 6, np.int32), NamedSharding(mesh, spec))
    (a2a,) = [c for c in collectives(f.lower(x).compile()) if c.op == "all-to-all"]
    assert sorted(a2a.groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert a2a.bytes == 6 * 4 and a2a.dtype == "s32"


def test_parses_iota_and_permute_forms():
    # Each line has the channel_id (and use_global_device_ids) an SPMD program's
    # collectives carry: without them XLA reads the ids as replica ids.
    text = "\n".join([
        "HloModule m, num_partitions=8",
        "  %a = f32[4]{0} all-reduce(f32[4]{0} %p), channel_id=1,"
        " replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true",
        "  %b = bf16[2,3]{1,0} collective-permute(bf16[2,3]{1,0} %q), channel_id=2,"
        " source_target_pairs={{0,1},{1,0}}",
        "  %c = (f32[2]{0}, f32[2]{0}) all-gather-start(f32[2]{0} %r), channel_id=3,"
        " replica_groups={}",
        "  %d = (f32[8], f32[8], u32[], u32[]) collective-permute-start(%s), channel_id=4,"
        " source_target_pairs={{0,1}}",
    ])
    a, b, c, d = collectives(text)
    assert d.op == "collective-permute" and d.shapes == ((8,),) and d.bytes == 32
    assert a.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and a.bytes == 16
    assert b == Collective("collective-permute", "b", ((0, 1), (1, 0)), ((2, 3),), ("bf16",), 12)
    assert c.op == "all-gather" and c.groups == (tuple(range(8)),) and c.bytes == 8


class _NoText:
    def as_text(self) -> None:
        return None


def test_errors():
    with pytest.raises(
        TypeError, match=r"takes HLO text or a compiled/lowered JAX program .* got int$"
    ):
        collectives(42)
    with pytest.raises(TypeError, match=r"^_NoText\.as_text\(\) gave no HLO text$"):
        collectives(_NoText())
    with pytest.raises(ValueError, match=r"device ids \[9\]"):
        groups_as_ranks([(0, 9)], Strategy.from_axes({"a": 8}))
