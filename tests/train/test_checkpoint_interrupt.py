"""Ctrl-C in the middle of a checkpoint save (issue 23).

Before, the interrupt cut orbax's save short while its threads wrote on: a
``*.orbax-checkpoint-tmp`` folder was left, and at exit those threads printed "cannot
schedule new futures after shutdown". Now the save finishes first, then Ctrl-C acts.
"""

from __future__ import annotations

import os
import signal
import threading

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from meshkit.runtime.interrupt import raise_interrupt
from meshkit.training.checkpoint import Checkpointer, _ctrl_c_after


def _ctrl_c_during_saves(monkeypatch, delays: list[float]) -> None:
    """Send SIGINT ``delays[i]`` s after the i-th orbax save starts (from a thread)."""
    save = ocp.CheckpointManager.save
    queue = list(delays)

    def interrupted_save(self, step, *args, **kwargs):
        if queue:
            threading.Timer(queue.pop(0), os.kill, (os.getpid(), signal.SIGINT)).start()
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", interrupted_save)


@pytest.fixture
def cli_sigint():
    """SIGINT handled as under the CLI (``meshkit train``): a Ctrl-C that lands in a JAX
    gc callback is sent again rather than lost (:func:`raise_interrupt`)."""
    previous = signal.signal(signal.SIGINT, raise_interrupt)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1])
def test_ctrl_c_mid_save_acts_once_the_checkpoint_is_whole(tmp_path, monkeypatch, delay,
                                                           cli_sigint):
    ckpt = Checkpointer(tmp_path)
    state = {"w": jnp.arange(4096.0), "step": jnp.int32(1)}
    ckpt.save(1, state)
    _ctrl_c_during_saves(monkeypatch, [delay])
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, state)
        threading.Event().wait(2.0)  # a late timer's signal lands here, after the save
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # no *.orbax-checkpoint-tmp
    assert ckpt.saved_fingerprints(2) is not None  # whole: its hashes are there


def test_a_second_ctrl_c_does_not_wait():
    with pytest.raises(KeyboardInterrupt), _ctrl_c_after():
        os.kill(os.getpid(), signal.SIGINT)  # held back
        for _ in range(1000):
            pass
        os.kill(os.getpid(), signal.SIGINT)  # acts now
        for _ in range(10**6):
            pass
        raise AssertionError("the second Ctrl-C did not stop the block")


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _ctrl_c_after():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
