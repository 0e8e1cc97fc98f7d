"""Ctrl-C that lands in a garbage-collector callback is not lost (issue 23).

JAX registers ``_xla_gc_callback`` in ``gc.callbacks``; a ``KeyboardInterrupt`` raised
there is printed as "Exception ignored in: ..." and dropped, and the run went on to the
end with exit 0. meshkit's SIGINT handler sends the signal again a moment later instead,
so it lands outside.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import pytest

from meshkit.runtime.interrupt import raise_interrupt


def _ctrl_c_inside_a_gc_callback(handler) -> str:
    fired: list[int] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # the handler runs here, inside the callback
                pass

    previous = signal.signal(signal.SIGINT, handler)
    gc.callbacks.append(callback)
    try:
        gc.collect()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the work that goes on after the collection
            time.sleep(0.001)
        return "went on"
    except KeyboardInterrupt:
        return "interrupted"
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, previous)


# The dropped KeyboardInterrupt is what this test shows; pytest reports it as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_python_s_own_handler_loses_it():
    assert _ctrl_c_inside_a_gc_callback(signal.default_int_handler) == "went on"


def test_meshkit_s_handler_delivers_it_after_the_callback(capsys):
    assert _ctrl_c_inside_a_gc_callback(raise_interrupt) == "interrupted"
    assert "Exception ignored" not in capsys.readouterr().err


def test_commands_that_clean_up_use_it():
    import meshkit.cli  # noqa: F401  (the module; the package's `main` is a function)

    cli = sys.modules["meshkit.cli.main"]
    with cli._StopSignals("meshkit train") as stop:
        stop.interruptible()  # what `meshkit train` does once its imports are done
        assert signal.getsignal(signal.SIGINT) is raise_interrupt


def test_a_checkpoints_second_ctrl_c_inside_a_gc_callback_is_not_lost():
    """While a save holds Ctrl-C back, a second one acts at once, even from a gc callback."""
    from meshkit.training.checkpoint import _ctrl_c_after

    with pytest.raises(KeyboardInterrupt), _ctrl_c_after():
        os.kill(os.getpid(), signal.SIGINT)  # the first: held back
        for _ in range(1000):
            pass
        hold = signal.getsignal(signal.SIGINT)
        fired: list[int] = []

        def callback(phase: str, info: dict) -> None:
            if phase == "start" and not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10_000):  # the held-back handler runs here
                    pass

        gc.callbacks.append(callback)
        try:
            gc.collect()
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                time.sleep(0.001)
        finally:
            gc.callbacks.remove(callback)
        raise AssertionError(f"the second Ctrl-C was lost in the gc callback ({hold})")
