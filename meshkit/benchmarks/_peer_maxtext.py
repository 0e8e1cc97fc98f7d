"""The MaxText side of ``meshkit bench peer``: one run of MaxText's own trainer.

``meshkit bench peer`` runs this file by its path, in an interpreter that has MaxText
(``--maxtext-python``), as::

    PYTHON _peer_maxtext.py OUT.json key=value ...

with the overrides of MaxText's ``configs/base.yml`` for the matched shape, the layout
and the run (:func:`meshkit.benchmarks.bench_peer.maxtext_overrides`). It runs MaxText's
pre-training entry point (``maxtext.trainers.pre_train.train.main``) unchanged, with two
taps that read what it already computes:

* the compiled train step's ``memory_analysis()``, which MaxText prints rounded to
  0.1 GB (``max_utils.print_compiled_memory_stats``), kept in bytes;
* each call of the train step, timed to completion (``jax.block_until_ready`` of its
  outputs): MaxText's own step time is the wall time between two steps' dispatches,
  which on an asynchronous backend swings with the logger's syncs.

and counts the model's parameters from the state the trainer built. It writes one JSON
object to ``OUT.json``: ``step_s`` (every step's seconds, the first ones compiling),
``memory`` (the four byte counts), ``params``, ``devices`` and the MaxText and JAX
versions.

It imports only the standard library at the top, and MaxText when run: MaxText's
interpreter need not have meshkit, and meshkit's need not have MaxText.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

#: MaxText's memory fields, as ``memory_analysis()`` names them (``<name>_size_in_bytes``).
MEMORY_FIELDS = ("argument", "output", "temp", "alias")


class Timed:
    """A jitted train step that records each call's seconds, outputs ready.

    Everything else (``lower``, ``eval_shape``, ...) is the wrapped function's.

    Args:
        fn: the jitted step.
        times: where each call's seconds go.
        ready: blocks until its argument's arrays are computed (``jax.block_until_ready``).

    Example:
        >>> times = []
        >>> step = Timed(lambda x: x + 1, times, ready=lambda out: out)
        >>> step(1), len(times), step.__name__
        (2, 1, '<lambda>')
    """

    def __init__(self, fn: Callable[..., Any], times: list[float], *,
                 ready: Callable[[Any], Any]) -> None:
        self._fn, self._times, self._ready = fn, times, ready

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self._ready(self._fn(*args, **kwargs))
        self._times.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def memory_bytes(stats: Any) -> dict[str, int]:
    """The byte counts of a ``memory_analysis()`` (:data:`MEMORY_FIELDS`).

    Example:
        >>> from types import SimpleNamespace as S
        >>> memory_bytes(S(argument_size_in_bytes=3, output_size_in_bytes=2,
        ...                temp_size_in_bytes=1, alias_size_in_bytes=2))
        {'argument': 3, 'output': 2, 'temp': 1, 'alias': 2}
    """
    return {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0)
            for name in MEMORY_FIELDS}


def main(argv: Sequence[str]) -> int:  # pragma: no cover - needs MaxText
    """Run MaxText's trainer on its ``configs/base.yml`` with the overrides ``argv[1:]``
    and write what it measured to ``argv[0]``.

    Returns:
        0; MaxText's own errors propagate.
    """
    out_path, overrides = argv[0], list(argv[1:])
    import importlib.metadata
    import importlib.resources

    import jax
    from absl import flags
    from flax import nnx
    from maxtext.trainers.pre_train import train
    from maxtext.utils import max_utils, train_utils

    found: dict[str, Any] = {"step_s": [], "memory": None, "params": None}
    wrapped: list[Any] = []
    print_stats = max_utils.print_compiled_memory_stats
    jit_steps = train_utils.jit_train_and_eval_step
    setup = train_utils.setup_train_loop

    def keep_stats(stats: Any, prefix: str = "") -> None:
        if prefix == "train" and found["memory"] is None:
            found["memory"] = memory_bytes(stats)
        print_stats(stats, prefix=prefix)

    def timed_steps(*args: Any, **kwargs: Any) -> Any:
        train_step, eval_step = jit_steps(*args, **kwargs)
        wrapped.append(train_step)
        if len(wrapped) > 1:  # a second program (the dropless retry): not the one timed
            return train_step, eval_step
        return Timed(train_step, found["step_s"], ready=jax.block_until_ready), eval_step

    def count_params(*args: Any, **kwargs: Any) -> Any:
        built = setup(*args, **kwargs)
        params = nnx.state(built[-1].model, nnx.Param)  # built[-1]: the train state
        found["params"] = sum(int(x.size) for x in jax.tree.leaves(params))
        return built

    max_utils.print_compiled_memory_stats = keep_stats
    train_utils.jit_train_and_eval_step = timed_steps
    train_utils.setup_train_loop = count_params
    flags.FLAGS(["maxtext"])  # absl's flags, as app.run would parse them
    base = importlib.resources.files("maxtext") / "configs" / "base.yml"
    train.main(["maxtext", str(base), *overrides])
    found.update(devices=jax.device_count(), jax=jax.__version__,
                 maxtext=importlib.metadata.version("maxtext"))
    with open(out_path, "w") as f:
        json.dump(found, f)
    return 0


if __name__ == "__main__":  # pragma: no cover - run in MaxText's interpreter
    raise SystemExit(main(sys.argv[1:]))
