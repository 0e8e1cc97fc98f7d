"""Test setup (tests and docstring examples), before JAX initialises its backend.

* 8 simulated CPU devices (tests that launch processes choose their own count).
* XLA:CPU compiling without LLVM's optimisations (:data:`FAST_COMPILE_FLAGS`): the
  tests' programs are tiny, so compiling is most of their time, and the flags halve it
  while every program computes the same values (the tests compare runs under the same
  flags). Benchmarks and ``meshkit`` itself keep XLA's defaults.
* The heaviest test files first (see :data:`_HEAVIEST_FIRST`).
* A persistent compilation cache shared by every test, both pytest-xdist workers (they
  inherit this process's environment) and every process the tests launch, fresh for
  each session: many tests compile the same small training step, and a cache
  hit skips only XLA's compilation, not any of the code under test.
"""

import os
import shutil
import tempfile

from meshkit.distributed import simulate_cpu_devices

#: XLA flags for the tests' processes, inherited by every process a test launches.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true",
                      # XLA:CPU aborts the process (exit 134) when one of a collective's
                      # device threads is 40 s late; on 2 cores shared by two workers, a
                      # compile in the other one starved a test's 8 threads that long.
                      "--xla_cpu_collective_call_terminate_timeout_seconds=600")

_flags = os.environ.get("XLA_FLAGS", "").split()
_names = {f.split("=")[0] for f in _flags}
os.environ["XLA_FLAGS"] = " ".join(
    [*_flags, *(f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in _names)])
simulate_cpu_devices(8)  # JAX_PLATFORMS=cpu unless set, as in the notebooks
_own_cache = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _own_cache:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshkit-jax-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


# pytest-xdist hands out whole files (``--dist loadfile``), in collection order with
# ``--no-loadscope-reorder`` (pyproject's addopts): a file that takes minutes but holds
# few tests, collected late, would leave one worker running it alone at the end. So the
# files that take longest go first (longest-processing-time-first scheduling); measured
# with ``pytest --durations=0``, summed per file. The rest keep their order.
_HEAVIEST_FIRST = (
    "tests/test_notebooks.py",
    "tests/runtime/test_multiprocess.py",
    "tests/model/test_schedules.py",
    "tests/train/test_parallel.py",
    "tests/train/test_checkpoint.py",
    "tests/test_docs.py",
    "tests/train/test_user_pipeline.py",
    "tests/exchange/test_dedup.py",
    "tests/model/test_ffn_split.py",
    "tests/train/test_reliability.py",
    "tests/sharding/test_fsdp.py",
    "tests/test_your_model.py",
    "tests/cli/test_errors.py",
    "tests/train/test_train.py",
    "tests/runtime/test_link.py",
    "tests/model/test_block_options.py",
    "tests/train/test_layout.py",
    "tests/config/test_fuzz.py",
    "tests/runtime/test_launch.py",
    "tests/plan/test_measured.py",
    "tests/model/test_user_schedules.py",
    "tests/train/test_user_model_train.py",
    "tests/plan/test_plan_config_verify.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_sessionfinish(session, exitstatus):
    if _own_cache:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
