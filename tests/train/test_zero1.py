"""ZeRO-1 (``parallel.zero1``): the AdamW moments split over the data axes, parameters
replicated; the same losses as one device, the state ÷ the data size, the data groups'
collectives, and a one-line error without a data axis.

One asymmetric layout (data 4 × tensor 2, no experts), compiled once for all its checks.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _layouts import MODEL, NO_EXPERTS, ONE_DEVICE
from jax.sharding import PartitionSpec as P

from meshkit.cli import main
from meshkit.config import ConfigError, load_config
from meshkit.data.sources import make_dataset
from meshkit.sharding.zero import zero1_spec
from meshkit.strategy.hlo import collectives, groups_as_ranks
from meshkit.training import Programs
from meshkit.training.programs import state_bytes

STEPS = 3
LAYOUT = ["mesh.axes={tp: 2, dp: 4}", "parallel.tensor=tp", "model.num_layers=1", *NO_EXPERTS]


Run = tuple[list[float], jax.stages.Compiled, Programs]


def _run(overrides: list[str]) -> Run:
    """``STEPS`` steps of the ahead-of-time compiled step: each loss, and the program."""
    config = load_config(None, [*MODEL, *overrides])
    t, d = config.train, config.data
    data = make_dataset(d.kind, path=d.path, vocab_size=config.model.vocab_size,
                        order=d.order, seed=d.seed, concentration=d.concentration)
    mesh = config.strategy().mesh()
    with jax.set_mesh(mesh):
        programs = Programs(config, mesh)
        compiled = programs.train_step.lower(programs.abstract_state,
                                             programs.abstract_batch).compile()
        state, losses = programs.init(), []
        for step in range(STEPS):
            batch = data.batch(step, t.batch_size, t.seq_len, seed=t.seed, split="train")
            state, metrics = compiled(state, programs.put_batch(batch))
            losses.append(float(np.asarray(metrics["loss"])))
    return losses, compiled, programs


@pytest.fixture(scope="module")
def zero1() -> Run:
    return _run([*LAYOUT, "parallel.zero1=true"])


def test_losses_equal_a_one_device_run(zero1: Run) -> None:
    reference, _, _ = _run([*ONE_DEVICE, "model.num_layers=1"])
    np.testing.assert_allclose(zero1[0], reference, rtol=1e-5)


def _opt_bytes(overrides: list[str]) -> int:
    config = load_config(None, [*MODEL, *overrides])
    return state_bytes(config, config.strategy().mesh()).optimizer


def test_the_optimizer_state_is_the_replicated_one_over_the_data_size(zero1: Run) -> None:
    replicated = _opt_bytes(LAYOUT)
    sharded = _opt_bytes([*LAYOUT, "parallel.zero1=true"])
    # Everything but the int32 step counters is split four ways.
    assert sharded == pytest.approx(replicated / 4, rel=0.01), (sharded, replicated)
    # ... and the train step's state is laid out so: moments over dp, parameters not.
    programs = zero1[2]
    moments = [s for path, s in jax.tree_util.tree_leaves_with_path(programs.state_sharding)
               if "'mu'" in jax.tree_util.keystr(path) or "'nu'" in jax.tree_util.keystr(path)]
    assert moments and all("dp" in str(s.spec) for s in moments)
    params = jax.tree.leaves(programs.state_sharding[0])
    assert params and not any("dp" in str(s.spec) for s in params)


def test_the_step_gathers_parameters_over_the_data_groups_only(zero1: Run) -> None:
    compiled = zero1[1]
    strategy = load_config(None, [*MODEL, *LAYOUT]).strategy()

    def groups(*axes: str) -> set[tuple[int, ...]]:
        return {tuple(sorted(g)) for g in strategy.groups(axes).tolist()}

    ops = collectives(compiled)
    as_ranks = {c: {tuple(sorted(g)) for g in groups_as_ranks(c.groups, strategy)}
                for c in ops}
    gathers = [c for c in ops if c.op == "all-gather"]
    # The updated parameter slices, gathered back over dp; the model's own over tp.
    assert any(as_ranks[c] == groups("dp") for c in gathers)
    assert all(as_ranks[c] in (groups("dp"), groups("tp")) for c in gathers), gathers
    # Gradients are reduce-scattered over dp: each device receives only its slice.
    scatters = [c for c in ops if c.op == "reduce-scatter"]
    assert scatters and all(as_ranks[c] == groups("dp") for c in scatters), scatters
    # What else is all-reduced over dp is scalars (the loss, the gradient norm,
    # statistics), no gradient; tensor activations over tp.
    for c in ops:
        if c.op == "all-reduce" and as_ranks[c] != groups("tp"):
            assert as_ranks[c] in (groups("dp"), groups("tp", "dp")) and c.bytes <= 1024, c


def test_zero1_spec_takes_the_largest_dimension_the_data_size_divides() -> None:
    sizes = {"dp": 4, "tp": 2}
    # Local sizes 6, 8, 8: the first 8.
    assert zero1_spec((6, 8, 16), P(None, None, "tp"), sizes=sizes,
                      data_axes=("dp",)) == P(None, "dp", "tp")
    # Local sizes 8, 16: the tensor-split dimension, split further.
    assert zero1_spec((8, 32), P(None, "tp"), sizes=sizes,
                      data_axes=("dp",)) == P(None, ("tp", "dp"))
    assert zero1_spec((3, 5), P(), sizes=sizes, data_axes=("dp",)) == P(None, None)
    with pytest.raises(ValueError, match=r"data axes \['dp'\] already shard"):
        zero1_spec((8,), P("dp"), sizes=sizes, data_axes=("dp",))


def test_zero1_without_a_data_axis_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.zero1: .*has none \(fsdp=fsdp\)"):
        load_config(None, [*MODEL, "mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *NO_EXPERTS,
                           "parallel.zero1=true"])
    assert main(["mesh", "parallel.zero1=true"]) == 2  # the default mesh: experts only
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.zero1: " in err[0], err
