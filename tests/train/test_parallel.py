"""Every axis does its job: parity with one device, memory per role, HLO groups per role.

With a capacity that drops nothing (``capacity_factor = E / k``) and no balance loss (a
product of means, which microbatching changes), every strategy trains the same model on
the same batches, so its losses must equal a 1-device run's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _layouts import ONE_DEVICE, STRATEGIES, _config

from meshkit.config import Config
from meshkit.data.sources import make_dataset
from meshkit.model.pipeline import bubble_fraction, gpipe
from meshkit.strategy.hlo import collectives, groups_as_ranks
from meshkit.training import Hook, Programs, compile_step, init_state, train

STEPS = 20


def _losses(config: Config, steps: int = STEPS) -> list[float]:
    """Train ``steps`` steps with the library's own programs; the loss of each."""
    t = config.train
    d = config.data
    data = make_dataset(d.kind, path=d.path, vocab_size=config.model.vocab_size,
                        order=d.order, seed=d.seed, concentration=d.concentration)
    mesh = config.strategy().mesh()
    losses = []
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        state = programs.init()
        for step in range(steps):
            batch = data.batch(step, t.batch_size, t.seq_len, seed=t.seed, split="train")
            state, metrics = programs.train_step(state, programs.put_batch(batch))
            losses.append(float(np.asarray(metrics["loss"])))
            assert int(np.asarray(metrics["dropped"])) == 0
    return losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _losses(_config(ONE_DEVICE))


@pytest.mark.parametrize("name", STRATEGIES)
def test_losses_equal_a_one_device_run(name: str, reference: list[float]) -> None:
    got = _losses(_config(STRATEGIES[name]))
    np.testing.assert_allclose(got[:5], reference[:5], rtol=1e-4)
    np.testing.assert_allclose(got, reference, rtol=1e-3)
    assert reference[-1] < reference[0] - 0.3  # and the model learns


def _host_state(config: Config) -> dict[str, np.ndarray]:
    state = init_state(config)
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def test_same_seed_same_initial_parameters_under_every_strategy() -> None:
    one = _host_state(_config(ONE_DEVICE))
    for name in ("fsdp8", "pp2-tp2-node2"):
        other = _host_state(_config(STRATEGIES[name]))
        assert other.keys() == one.keys()
        for key, value in one.items():
            np.testing.assert_array_equal(other[key], value, err_msg=f"{name}: {key}")


def test_checkpoint_resumes_under_another_strategy(tmp_path, reference) -> None:
    ckpt = ["train.checkpoint_every=10", f"train.workdir={tmp_path}",
            "train.log_every=5", "train.eval_every=1000", "train.eval_batches=1"]
    first = _config(STRATEGIES["fsdp2-node2-device2"], *ckpt)

    def stop(info):
        if info.step == 15:
            raise KeyboardInterrupt("stop after the step-10 checkpoint")

    with pytest.raises(KeyboardInterrupt):
        train(first, verbose=False, hooks=[Hook(stop, every=5)])
    resumed = train(_config(STRATEGIES["pp2-tp2-node2"], *ckpt), verbose=False)
    assert resumed.start_step == 10
    np.testing.assert_allclose([loss for _, loss in resumed.losses], reference[10:], rtol=1e-3)


# ---------------------------------------------------------------------- memory
def _bytes_per_device(config: Config, *, skip_experts: bool = False) -> int:
    """One device's bytes of the initial state (parameters, AdamW moments, counters)."""
    total = 0
    device = jax.devices()[0]
    for path, leaf in jax.tree_util.tree_leaves_with_path(init_state(config)):
        if skip_experts and "'moe'" in jax.tree_util.keystr(path):
            continue
        (shard,) = [s for s in leaf.addressable_shards if s.device == device]
        total += shard.data.nbytes
    return total


def test_fsdp_shards_the_state_eight_ways() -> None:
    replicated = _bytes_per_device(_config(STRATEGIES["dp8"]))
    sharded = _bytes_per_device(_config(STRATEGIES["fsdp8"]))
    assert sharded <= replicated / 8 * 1.15, (sharded, replicated)


def test_pipeline_stages_hold_their_own_layers() -> None:
    pp = _config(STRATEGIES["pp2-node2-device2"])
    as_data = _config(["mesh.axes={pp: 2, node: 2, device: 2}"])  # pp is a data axis here
    assert _bytes_per_device(pp) <= 0.6 * _bytes_per_device(as_data)


def test_tensor_parallelism_splits_attention_embedding_and_head() -> None:
    tp = _config(STRATEGIES["tp2-node2-device2"])
    as_data = _config(["mesh.axes={tp: 2, node: 2, device: 2}"])
    dense_tp = _bytes_per_device(tp, skip_experts=True)
    assert dense_tp <= 0.6 * _bytes_per_device(as_data, skip_experts=True)


# ---------------------------------------------------------------------- HLO
def test_compiled_step_uses_each_roles_groups() -> None:
    config = _config(STRATEGIES["pp2-tp2-node2"])
    strategy = config.strategy()
    ops = collectives(compile_step(config))
    as_ranks = {c: {tuple(sorted(g)) for g in groups_as_ranks(c.groups, strategy)}
                for c in ops if c.op != "collective-permute"}

    def groups(*axes: str) -> set[tuple[int, ...]]:
        return {tuple(sorted(g)) for g in strategy.groups(axes).tolist()}

    # Tensor all-reduces (attention output, vocab-parallel embedding and loss) run over
    # exactly the tensor groups.
    reduces = [c for c in ops if c.op == "all-reduce"]
    assert any(as_ranks[c] == groups("tp") for c in reduces)
    # Every reduction runs over the groups of some set of axes: no stray groupings.
    axis_sets = [(a,) for a in strategy.axis_names] + [
        ("pp", "node"), ("tp", "node"), ("pp", "tp"), ("pp", "tp", "node")]
    for c in reduces:
        assert any(as_ranks[c] == groups(*axes) for axes in axis_sets), c
    # Pipeline: activations (and their gradients) move only between pipeline neighbours.
    permutes = [c for c in ops if c.op == "collective-permute"]
    assert permutes
    neighbours = {(r, n) for r in range(strategy.size) for n in strategy.neighbors(r, "pp")}
    for c in permutes:
        pairs = groups_as_ranks(c.groups, strategy)
        assert pairs and set(pairs) <= neighbours, c
    # The expert exchange stays inside the expert groups (here: over node).
    experts = groups("node")
    exchanges = [c for c in ops if c.op == "all-to-all"]
    assert exchanges
    for c in exchanges:
        assert all(any(set(g) <= set(e) for e in experts) for g in as_ranks[c]), c


# ---------------------------------------------------------------------- the schedule
def test_gpipe_runs_every_microbatch_through_every_stage_once() -> None:
    from jax.sharding import PartitionSpec as P

    stages, m = 4, 3
    mesh = jax.make_mesh((stages, 2), ("pp", "dp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = np.arange(2 * m * 5, dtype=np.float32).reshape(2 * m, 5)

    def body(x):
        s = jax.lax.axis_index("pp").astype(np.float32)

        def stage(h):  # stage s maps h to 10·h + s + 1: the order of stages shows
            return 10 * h + s + 1, {"ran": np.float32(1)}

        out, stats = gpipe(stage, x.reshape(m, 1, 5), "pp")
        last = jax.lax.axis_index("pp") == stages - 1
        out = jax.lax.psum(jax.numpy.where(last, out, 0), "pp")
        return out.reshape(m, 5), jax.lax.psum(stats["ran"], "pp")[None]

    with jax.set_mesh(mesh):
        out, ran = jax.jit(jax.shard_map(body, in_specs=P("dp"),
                                         out_specs=(P("dp"), P("dp"))))(x)
    np.testing.assert_allclose(out, x * 10**stages + 1234)
    assert ran.tolist() == [stages * m] * 2  # no bubble tick counted
    assert bubble_fraction(stages, m) == pytest.approx(3 / 6)


def test_a_mesh_axis_named_like_a_logical_axis_still_places_the_experts() -> None:
    # `experts` is a mesh axis here and also the logical name of both expert axes.
    config = _config(["mesh.axes={node: 2, experts: 4}", "exchange.device_axis=experts"])
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        shardings = Programs(config, mesh).state_sharding
    specs = {jax.tree_util.keystr(path): s.spec
             for path, s in jax.tree_util.tree_leaves_with_path(shardings)}
    w_up = [spec for path, spec in specs.items() if "w_up" in path]
    assert len(w_up) == 3 and all(spec[1] == ("node", "experts") for spec in w_up), w_up
