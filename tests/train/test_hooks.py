"""Hooks: the every=N cadence, what a user's hook sees, and that its exceptions end the run."""

import pytest
from _configs import SMALL

from meshkit.config import load_config
from meshkit.training import Hook, StepInfo, train
from meshkit.training.metrics import read_metrics


def small(tmp_path, *extra: str):
    return load_config(None, [*SMALL, f"train.workdir={tmp_path}", *extra])


@pytest.mark.parametrize("every", [0, -3, 2.5, True, "10"])
def test_every_must_be_a_positive_integer_or_none(every):
    with pytest.raises(ValueError, match=r"every must be a positive integer or None, got "):
        Hook(every=every)


def test_a_hook_is_due_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 13) if Hook(every=4).due(s, 12)] == [4, 8, 12]
    assert [s for s in range(3, 11) if Hook(every=4).due(s, 10)] == [4, 8, 10]
    assert not any(Hook(every=None).due(s, 5) for s in range(1, 6))


def test_every_none_runs_at_every_stop_and_every_n_only_when_due():
    calls: dict[str, list[int]] = {"every": [], "none": []}
    hooks = {"every": Hook(lambda i: calls["every"].append(i.step), every=3),
             "none": Hook(lambda i: calls["none"].append(i.step), every=None)}
    for step in (3, 5, 6, 7):  # the stops another hook might make in 7 steps
        info = StepInfo(step=step, last_step=7, state=None, metrics=[], seconds=0.0)
        for hook in hooks.values():
            hook(info)
    assert calls == {"every": [3, 6, 7], "none": [3, 5, 6, 7]}


def test_user_hooks_run_every_n_steps_see_every_step_and_may_add_to_the_row(tmp_path):
    seen: list[tuple[int, list[int], float]] = []
    every_step: list[int] = []

    def mine(info: StepInfo) -> None:
        seen.append((info.step, [s for s, _ in info.metrics], info.loss))
        info.logs["mine"] = info.step * 10

    # log_every=5 (SMALL), steps=7: the loop stops at 3 and 6 (mine), 5 and 7 (the row).
    result = train(small(tmp_path, "train.steps=7"), verbose=False, hooks=[
        Hook(mine, every=3),
        Hook(lambda info: every_step.extend(s for s, _ in info.metrics), every=None)])
    losses = dict(result.losses)
    assert [(step, fetched) for step, fetched, _ in seen] == [(3, [1, 2, 3]), (6, [6]),
                                                               (7, [7])]
    assert all(loss == pytest.approx(losses[step]) for step, _, loss in seen)
    assert every_step == list(range(1, 8))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [3, 5, 6, 7]
    assert [r.get("mine") for r in rows] == [30, None, 60, 70]
    # The evaluation runs before users' hooks: they see its values, theirs come after.
    assert list(rows[-1])[-3:] == ["eval_loss", "entropy_rate", "mine"]


class _Boom(Hook):
    def __init__(self) -> None:
        super().__init__(every=2)
        self.closed = False

    def __call__(self, info: StepInfo) -> None:
        if self.due(info.step, info.last_step):
            raise RuntimeError(f"hook failed at step {info.step}")

    def close(self) -> None:
        self.closed = True


def test_a_hooks_exception_ends_the_run_unchanged_and_the_hooks_are_closed(tmp_path):
    boom = _Boom()
    with pytest.raises(RuntimeError, match=r"^hook failed at step 2$"):
        train(small(tmp_path, "train.steps=4"), verbose=False, hooks=[boom])
    assert boom.closed
    assert not (tmp_path / "metrics.jsonl").exists()  # no row was due before it
