"""Environment helpers for tests that launch processes."""

from __future__ import annotations

import os

import pytest

from meshkit.runtime.distributed import set_cpu_device_count


def drop_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove this process's simulated-device count from the environment that launched
    processes inherit (they choose their own), keeping the other XLA flags (the tests'
    fast-compile flags among them)."""
    env = dict(os.environ)
    set_cpu_device_count(None, env, replace=True)
    for name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
        if name in env:
            monkeypatch.setenv(name, env[name])
        else:
            monkeypatch.delenv(name, raising=False)
