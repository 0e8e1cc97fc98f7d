"""Test setup (tests and docstring examples), before JAX initialises its backend.

* 8 simulated CPU devices (tests that launch processes choose their own count).
* A persistent compilation cache shared by every test, both pytest-xdist workers (they
  inherit this process's environment) and every process the tests launch, fresh for
  each session: many tests compile the same small training step, and a cache
  hit skips only XLA's compilation, not any of the code under test.
"""

import os
import shutil
import tempfile

from meshkit.runtime.distributed import set_cpu_device_count

os.environ.setdefault("JAX_PLATFORMS", "cpu")
set_cpu_device_count(8)
_own_cache = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _own_cache:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshkit-jax-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_sessionfinish(session, exitstatus):
    if _own_cache:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
