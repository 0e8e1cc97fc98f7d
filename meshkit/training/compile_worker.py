"""The subprocess of ``meshkit plan --verify``: compile each job's step, report XLA's bytes.

It reads a JSON line ``{"devices": N}`` and then one JSON line per job on stdin
(:func:`meshkit.plan.verify.verify` writes the next when this one reports the last done,
so that several workers share the jobs), and writes one JSON line per job as it starts
and ends, which the parent turns into progress lines; it ends when its stdin closes, and
within a second of its parent's death (``{"parent": PID}`` in the first line): a
compile can take minutes, and a parent killed without its clean-up (SIGKILL) must not
leave it running.
Run as ``python -m meshkit.training.compile_worker`` with as many simulated CPU devices as
the target; it is not a public entry point.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from meshkit.plan.verify import xla_bytes


def _send(message: dict[str, Any]) -> None:
    """One JSON line to the parent (the worker's protocol, not output for a user)."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _exit_with(parent: int, poll_s: float = 0.5) -> None:
    """End this process once ``parent`` is no longer its parent (it died; the orphan was
    handed to init or a subreaper). Its stdin's end comes only after the compile in hand."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def _main() -> None:  # pragma: no cover - runs in the subprocess
    request = json.loads(sys.stdin.readline())
    parent = int(request.get("parent", os.getppid()))
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    import jax

    from meshkit.config import load_config
    from meshkit.model.transformer import skip_slots_by_cond
    from meshkit.training import compile_step

    assert jax.device_count() >= request["devices"], jax.device_count()
    for line in sys.stdin:
        job = json.loads(line)
        i = job["index"]
        _send({"start": i, "name": job["name"]})
        t0 = time.monotonic()
        try:
            config = load_config(job["config_path"], list(job["overrides"]))
            with skip_slots_by_cond():  # compiled to be measured, never run
                total, parts = xla_bytes(compile_step(config).memory_analysis())
            error = None
        except Exception as e:  # reported per job; the others still compile
            total, parts = None, {}
            error = (f"{type(e).__name__}: {e}".strip().splitlines() or ["?"])[0][:300]
        _send({"done": i, "name": job["name"], "bytes": total, "parts": parts,
               "seconds": time.monotonic() - t0, "error": error})


if __name__ == "__main__":  # pragma: no cover
    _main()
