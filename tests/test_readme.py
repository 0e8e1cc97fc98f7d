"""The README's Python examples run (all but the training one, which test_train covers)."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_examples_run():
    runnable = [b for b in BLOCKS if "train(" not in b]
    assert len(runnable) >= 2
    for block in runnable:
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)
        if "exchange" in namespace:
            import jax
            import numpy as np

            x = np.arange(8 * 16 * 2, dtype=np.float32).reshape(8 * 16, 2)
            flat = jax.jit(jax.shard_map(
                lambda v: jax.lax.all_to_all(v, ("node", "device"), 0, 0, tiled=True),
                mesh=namespace["mesh"], in_specs=namespace["spec"],
                out_specs=namespace["spec"]))
            np.testing.assert_array_equal(namespace["exchange"](x), flat(x))


def test_readme_config_reference_is_current():
    from meshkit.config import format_reference

    assert format_reference().strip() in README, "paste format_reference() into README.md"
