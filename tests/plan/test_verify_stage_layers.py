"""``--verify`` compiles a candidate whose pipeline stages do not divide the layers with
uneven stages (``parallel.stage_layers``, the first stages one layer more) and
extrapolates its bytes to the slots every stage then holds (``S · ceil(L / S)``)."""

from __future__ import annotations

import dataclasses

from meshkit.exchange.cost import preset
from meshkit.plan import verify as verify_mod
from meshkit.plan.model_desc import ModelDesc
from meshkit.plan.model_plan import Candidate, model_rejection, predict_model
from meshkit.plan.planner import Layout

DESC = ModelDesc(name="tiny", vocab_size=128, d_model=64, num_layers=3, num_heads=4,
                 d_ff=128, num_experts=4, top_k=2, seq_len=32, batch_size=16,
                 compute_dtype="float32", remat="none", grad_accum=1, schedule="1f1b")
TOPOLOGY = preset("h100-8x400g", 1)


def test_stage_split_puts_the_extra_layers_first() -> None:
    assert verify_mod.stage_split(3, 2) == [2, 1]
    assert verify_mod.stage_split(126, 16) == [8] * 14 + [7] * 2
    assert verify_mod.stage_split(8, 4) == [2] * 4


def test_uneven_stages_are_passed_and_extrapolated_to_the_slots(monkeypatch) -> None:
    seen: list[verify_mod.VerifyJob] = []

    def fake(jobs, *, devices, progress=None):  # type: ignore[no-untyped-def]
        seen.extend(jobs)  # 10 bytes a layer
        return [verify_mod.VerifyResult(j.name, 10 * int(j.name.rsplit(" L", 1)[1]), {},
                                        0.0) for j in jobs]

    monkeypatch.setattr(verify_mod, "verify", fake)
    cand = Candidate(Layout(pipeline=4, data=2, microbatches=4), schedule="1f1b")
    desc = dataclasses.replace(DESC, num_layers=18)
    assert model_rejection(desc, cand) is None
    preds = [predict_model(desc, cand, TOPOLOGY)]
    (whole,) = verify_mod.verify_plan(desc, preds, devices=8, count=1, memory_bytes=None)
    assert "parallel.stage_layers=[5, 5, 4, 4]" in seen[0].overrides
    assert whole.verified_bytes == 180
    seen.clear()
    (line,) = verify_mod.verify_plan(desc, preds, devices=8, count=1, memory_bytes=None,
                                     extrapolate=True)
    # 8 and 16 layers split evenly; extended to the 4 · 5 slots, not to 18 layers.
    assert [j.name.rsplit(" ", 1)[1] for j in seen] == ["L8", "L16"]
    assert not any(o.startswith("parallel.stage_layers") for j in seen for o in j.overrides)
    assert line.verified_bytes == 200


def test_an_uneven_candidate_compiles() -> None:
    cand = Candidate(Layout(pipeline=2, data=4, microbatches=2), schedule="1f1b")
    (got,) = verify_mod.verify_plan(DESC, [predict_model(DESC, cand, TOPOLOGY)], devices=8,
                                    count=1, memory_bytes=None)
    assert got.verified_bytes and got.compiled_prediction
