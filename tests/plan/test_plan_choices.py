"""The planner's choices are the ones ``--verify`` compiles: ``interleaved`` candidates
carry their virtual stages (the step model charges their bubble), and an open attention
chunk is the config's."""

from __future__ import annotations

import dataclasses

import pytest

from meshkit.config.sections import ModelConfig
from meshkit.exchange.cost import preset
from meshkit.plan import verify as verify_mod
from meshkit.plan.memory_fit import default_attention_chunk, features, layout_memory
from meshkit.plan.model_desc import ModelDesc
from meshkit.plan.model_plan import (
    Candidate,
    candidates,
    model_rejection,
    plan_model,
    predict_model,
    runnable_choices,
    uncompiled,
)
from meshkit.plan.planner import Layout

# 8 layers: 4 a stage at pp2, so v = 2 and 4 split them.
DESC = ModelDesc(name="tiny", vocab_size=128, d_model=128, num_layers=8, num_heads=4,
                 d_ff=256, num_experts=4, top_k=2, seq_len=32, batch_size=16,
                 compute_dtype="float32", remat="none", grad_accum=1, schedule="interleaved")
TOPOLOGY = preset("h100-8x400g", 1)


def test_interleaved_candidates_carry_virtual_stages_and_its_bubble() -> None:
    piped = [c for c in candidates(DESC, 8, 8) if c.layout.pipeline == 2]
    assert {c.virtual_stages for c in piped} == {2, 4}
    assert all(c.schedule == "interleaved" for c in piped)
    lay = Layout(pipeline=2, data=4, microbatches=2)
    for v in (2, 4):
        cand = Candidate(lay, schedule="interleaved", virtual_stages=v)
        assert model_rejection(DESC, cand) is None
        assert cand.name() == f"pp2 dp4 mb2 interleaved v{v}"
        t = predict_model(DESC, cand, TOPOLOGY).terms
        work = sum(t[k] for k in ("compute", "weights", "tensor", "exchange", "pipeline"))
        # The bubble's share of the step's ticks: (S − 1)/(v·M + S − 1).
        assert t["bubble"] / (work + t["bubble"]) == pytest.approx(1 / (v * 2 + 1))
    assert predict_model(DESC, Candidate(lay, schedule="interleaved", virtual_stages=2),
                         TOPOLOGY).to_json()["virtual_stages"] == 2


def test_interleaved_that_cannot_split_its_stages_is_rejected_naming_schedule() -> None:
    # Fewer microbatches than stages, and chunks that do not split a stage's layers.
    assert model_rejection(DESC, Candidate(Layout(pipeline=4, data=2, microbatches=2),
                                           schedule="interleaved", virtual_stages=2)) \
        == "schedule"
    assert model_rejection(DESC, Candidate(Layout(pipeline=2, data=4, microbatches=2),
                                           schedule="interleaved", virtual_stages=8)) \
        == "schedule"


def test_runnable_and_verify_keep_interleaved() -> None:
    assert "interleaved" in runnable_choices()[1]
    assert uncompiled(Candidate(Layout(pipeline=2, data=4, microbatches=2),
                                schedule="interleaved", virtual_stages=2)) == []


def test_verify_passes_the_candidates_virtual_stages(monkeypatch) -> None:
    seen: list[verify_mod.VerifyJob] = []

    def fake(jobs, *, devices, progress=None):  # type: ignore[no-untyped-def]
        seen.extend(jobs)
        return [verify_mod.VerifyResult(j.name, 1, {}, 0.0) for j in jobs]

    monkeypatch.setattr(verify_mod, "verify", fake)
    lay = Layout(pipeline=2, data=4, microbatches=2)
    preds = [predict_model(DESC, Candidate(lay, schedule="interleaved", virtual_stages=4),
                           TOPOLOGY)]
    desc = dataclasses.replace(DESC, num_layers=16)
    verify_mod.verify_plan(desc, preds, devices=8, count=1, memory_bytes=None,
                           extrapolate=True)
    # Two layer counts whose stages hold whole chunks: 2·4 and 4·4 layers.
    assert [j.name.rsplit(" ", 1)[1] for j in seen] == ["L8", "L16"]
    for job in seen:
        assert "parallel.schedule=interleaved" in job.overrides
        assert "parallel.virtual_stages=4" in job.overrides


def test_verified_interleaved_candidate_agrees_with_its_prediction() -> None:
    ranked = plan_model(dataclasses.replace(DESC, num_layers=4), devices=8,
                        topology=TOPOLOGY)
    pick = [p for p in ranked if p.candidate.layout.pipeline == 2
            and p.candidate.layout.fsdp > 1][:1]
    (got,) = verify_mod.verify_plan(dataclasses.replace(DESC, num_layers=4), pick,
                                    devices=8, count=1, memory_bytes=None)
    assert got.candidate.virtual_stages == 2
    assert got.verified_bytes and got.compiled_prediction
    # Held out (the memory terms were not fitted on interleaved steps).
    assert 0.8 < got.compiled_prediction / got.verified_bytes < 1.25


def test_an_open_attention_chunk_is_the_configs_default() -> None:
    chunk = ModelConfig.model_fields["attention_chunk"].default
    assert default_attention_chunk() == chunk
    desc = dataclasses.replace(DESC, seq_len=1024, attention="chunked")
    lay = Layout(data=8)
    open_chunk = layout_memory(desc, lay, attention="chunked")
    assert open_chunk.terms == layout_memory(
        dataclasses.replace(desc, attention_chunk=chunk), lay, attention="chunked").terms
    # No scores are kept across layers; the chunk sizes the scores of the layer in flight.
    _, _, small = features(desc, lay, attention="chunked", remat="full")
    _, _, big = features(dataclasses.replace(desc, attention_chunk=4 * chunk), lay,
                         attention="chunked", remat="full")
    assert small["softmax"] == big["softmax"] == 0
    assert 0 < small["in_flight_softmax"] < big["in_flight_softmax"]
