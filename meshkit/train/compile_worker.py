"""The subprocess of ``meshkit plan --verify``: compile each job's step, report XLA's bytes.

It reads the jobs as JSON on stdin (:func:`meshkit.plan.verify.verify` writes them) and
writes one JSON line per job as it starts and ends, which the parent turns into progress
lines. Run as ``python -m meshkit.train.compile_worker`` with as many simulated CPU
devices as the target; it is not a public entry point.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from meshkit.plan.verify import xla_bytes


def _send(message: dict[str, Any]) -> None:
    """One JSON line to the parent (the worker's protocol, not output for a user)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _main() -> None:  # pragma: no cover - runs in the subprocess
    request = json.loads(sys.stdin.read())
    import jax

    from meshkit.config import load_config
    from meshkit.train import compile_step

    assert jax.device_count() >= request["devices"], jax.device_count()
    for i, job in enumerate(request["jobs"]):
        _send({"start": i, "name": job["name"]})
        t0 = time.monotonic()
        try:
            config = load_config(job["config_path"], list(job["overrides"]))
            total, parts = xla_bytes(compile_step(config).memory_analysis())
            error = None
        except Exception as e:  # reported per job; the others still compile
            total, parts = None, {}
            error = (f"{type(e).__name__}: {e}".strip().splitlines() or ["?"])[0][:300]
        _send({"start": None, "name": job["name"], "bytes": total, "parts": parts,
               "seconds": time.monotonic() - t0, "error": error})


if __name__ == "__main__":  # pragma: no cover
    _main()
