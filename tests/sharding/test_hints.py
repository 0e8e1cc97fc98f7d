"""A model's own mesh-axis annotations and a model built outside a mesh: JAX's and Flax's
errors become one line naming the axis, the call site and the fix, at meshkit's
boundaries (the trainer's calls into user code, ``meshkit.FSDP``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshkit
from meshkit.config import load_config
from meshkit.errors import UserCodeError
from meshkit.training import train
from meshkit.training.user_code import blame

SITE = r"\S+test_hints\.py:\d+ \(__call__\)"


class BonsaiStyle(nnx.Module):
    """Names mesh axes on its activations, as bonsai's models do."""

    def __init__(self, rngs: nnx.Rngs, *, annotate: str = "constraint") -> None:
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.annotate = annotate

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.annotate == "constraint":
            x = jax.lax.with_sharding_constraint(x, P("fsdp", None, None))
        else:
            x = x + jnp.zeros(x.shape, out_sharding=P("dp", None, None))
        return x @ self.embed.embedding[...].T


def _run(layout: list[str], tmp_path, factory) -> None:
    config = load_config(None, ["train.batch_size=8", "train.seq_len=4", "train.steps=1",
                                "model.vocab_size=16", "exchange.node_axis=[]",
                                "exchange.device_axis=[]", *layout,
                                f"train.workdir={tmp_path}"])
    train(config, model=factory, verbose=False, progress=False)


def test_the_trainer_names_a_mesh_axis_the_mesh_lacks(tmp_path):
    with pytest.raises(UserCodeError) as info:
        _run(["mesh.axes={dp: 2, tp: 4}", "parallel.tensor=tp"], tmp_path, BonsaiStyle)
    message = str(info.value)
    assert "\n" not in message
    assert "names mesh axis 'fsdp' in P('fsdp', None, None), which the mesh ('dp', 'tp') " \
           "lacks" in message
    assert "meshkit.constrain(x, 'batch', ...)" in message
    assert __file__ in message, message


def test_out_sharding_on_an_auto_axis_names_the_call_site_and_the_fix():
    mesh = meshkit.Strategy.from_axes({"dp": 2, "tp": 4}).mesh()
    model = BonsaiStyle(nnx.Rngs(0), annotate="zeros")
    with pytest.raises(UserCodeError, match=r"^model=m: jnp\.zeros\(out_sharding=P\('dp', "
                       r"None, None\)\) at \S+test_hints\.py:\d+ \(__call__\) names mesh axis "
                       r"dp, which is Auto on this mesh .*meshkit\.constrain"), \
            jax.set_mesh(mesh), blame("model=m"):
        jax.jit(lambda t: model(t))(np.zeros((8, 4), np.int32))


def test_fsdp_names_the_wrapped_layer_and_the_axis():
    mesh = meshkit.Strategy.from_axes({"fsdp": 8}).mesh()
    rules = meshkit.ShardingRules(fsdp="fsdp")

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(8, 8, kernel_metadata={"out_sharding": ("embed", None)},
                                rngs=rngs)

        def __call__(self, x):
            return jax.lax.with_sharding_constraint(self.w(x), P(None, "tp"))

    with nnx.use_eager_sharding(False):
        layer = meshkit.FSDP(Layer(nnx.Rngs(0)))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.flax_rules()), pytest.raises(
            ValueError, match=r"^meshkit.FSDP\(Layer\): the model names mesh axis 'tp' .*, at "
                              + SITE):
        jax.jit(lambda x: layer(x))(np.ones((8, 8), np.float32))


def test_a_model_built_outside_a_mesh_names_use_eager_sharding():
    with pytest.raises(UserCodeError, match=r"^model\.factory: f: a parameter with sharding "
                       r"names was created outside a mesh at \S+test_hints\.py:\d+ "
                       r"\(<lambda>\): build the model under `with "
                       r"nnx\.use_eager_sharding\(False\):`"), blame("model.factory: f"):
        (lambda: nnx.Linear(2, 4, kernel_metadata={"out_sharding": ("embed", "mlp")},
                            rngs=nnx.Rngs(0)))()
