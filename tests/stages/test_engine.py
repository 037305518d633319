"""The engine on its own: spans chain exactly, rollback is a pointer, sessions are independent."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.errors import ContextOverflow, SpanError, UnknownSession
from tessera.stages.decoding.generate import plan_length
from tessera.stages.decoding.sampling import Sampler, SamplingParams, top_p_filter
from tessera.stages.assembly.stage import load_stage

CUTS = [(0, 7), (7, 8), (8, 21), (21, 30)]
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]


def run_chain(stages, session, hidden, pos):
    for stage in stages:
        hidden = stage.forward(session, hidden, pos)
    return hidden


def test_spans_chained_equal_whole_model_bit_for_bit(smol_dir, smol_stage):
    parts = [load_stage(smol_dir, start=a, end=b) for a, b in CUTS]
    for p in parts:
        p.open("c", capacity=64)
    smol_stage.open("w", capacity=64)
    whole = smol_stage.forward("w", smol_stage.embed(PROMPT), 0)
    chained = run_chain(parts, "c", smol_stage.embed(PROMPT), 0)
    assert torch.equal(whole, chained)
    token, pos = int(smol_stage.logits(whole[-1:]).argmax()), len(PROMPT)
    for _ in range(8):
        x = smol_stage.embed([token])
        whole, chained = smol_stage.forward("w", x, pos), run_chain(parts, "c", x, pos)
        assert torch.equal(smol_stage.logits(whole), smol_stage.logits(chained))
        token, pos = int(smol_stage.logits(whole).argmax()), pos + 1
    smol_stage.close("w")


def test_sub_span_sessions_on_one_stage(smol_dir, smol_stage):
    """A session may use part of a stage's span (how failover re-cuts a route)."""
    stage = load_stage(smol_dir, start=5, end=20)
    stage.open("a", capacity=32, start=5, end=12)
    stage.open("b", capacity=32, start=12, end=20)
    ref = load_stage(smol_dir, start=5, end=20)
    ref.open("r", capacity=32)
    x = smol_stage.embed(PROMPT)
    assert torch.equal(ref.forward("r", x, 0), stage.forward("b", stage.forward("a", x, 0), 0))
    with pytest.raises(SpanError):
        stage.open("c", capacity=32, start=2, end=12)


def greedy(stage, session, ids, n, start_pos=0):
    hidden = stage.forward(session, stage.embed(ids), start_pos)
    out, pos = [], start_pos + len(ids)
    for _ in range(n):
        token = int(stage.logits(hidden[-1:]).argmax())
        out.append(token)
        hidden = stage.forward(session, stage.embed([token]), pos)
        pos += 1
    return out


def test_rollback_then_redecode_equals_fresh(smol_stage):
    smol_stage.open("fresh", capacity=64)
    fresh = greedy(smol_stage, "fresh", PROMPT, 12)
    smol_stage.open("rb", capacity=64)
    greedy(smol_stage, "rb", PROMPT + [42, 43, 44, 45], 6)  # wander off
    smol_stage.rollback("rb", len(PROMPT))  # pointer move only
    assert smol_stage.position("rb") == len(PROMPT)
    # continue from the rolled-back cache: feed the last prompt token again at its position
    smol_stage.rollback("rb", len(PROMPT) - 1)
    again = greedy(smol_stage, "rb", PROMPT[-1:], 12, start_pos=len(PROMPT) - 1)
    assert again == fresh
    for s in ("fresh", "rb"):
        smol_stage.close(s)


def test_interleaved_sessions_equal_separate_runs(smol_stage):
    a_ids, b_ids = PROMPT, PROMPT[::-1]
    smol_stage.open("a", capacity=64)
    a_alone = greedy(smol_stage, "a", a_ids, 10)
    smol_stage.open("b", capacity=64)
    b_alone = greedy(smol_stage, "b", b_ids, 10)
    smol_stage.open("a2", capacity=64)
    smol_stage.open("b2", capacity=64)
    ha = smol_stage.forward("a2", smol_stage.embed(a_ids), 0)
    hb = smol_stage.forward("b2", smol_stage.embed(b_ids), 0)
    a_out, b_out = [], []
    for i in range(10):
        ta, tb = int(smol_stage.logits(ha[-1:]).argmax()), int(smol_stage.logits(hb[-1:]).argmax())
        a_out.append(ta)
        b_out.append(tb)
        hb = smol_stage.forward("b2", smol_stage.embed([tb]), len(b_ids) + i)
        ha = smol_stage.forward("a2", smol_stage.embed([ta]), len(a_ids) + i)
    assert (a_out, b_out) == (a_alone, b_alone)
    for s in ("a", "b", "a2", "b2"):
        smol_stage.close(s)


def test_cache_limits_are_typed_errors(smol_stage):
    smol_stage.open("small", capacity=4)
    with pytest.raises(ContextOverflow):
        smol_stage.forward("small", smol_stage.embed(PROMPT), 0)
    with pytest.raises(ContextOverflow):
        smol_stage.rollback("small", 3)  # beyond what the cache holds
    with pytest.raises(UnknownSession):
        smol_stage.forward("nope", smol_stage.embed([1]), 0)
    with pytest.raises(ContextOverflow):
        smol_stage.open("huge", capacity=10**9)
    with pytest.raises(ContextOverflow):
        plan_length(9000, 10, 8192)
    assert plan_length(8190, 10, 8192) == 2
    smol_stage.close("small")


def test_sampling_is_seeded_and_reproducible(local_engine):
    ids = local_engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    first = local_engine.generate_ids(ids, max_new_tokens=12, sampling=params)
    second = local_engine.generate_ids(ids, max_new_tokens=12, sampling=params)
    other = local_engine.generate_ids(ids, max_new_tokens=12, sampling=SamplingParams(temperature=0.9, seed=99))
    assert first == second
    assert first != other


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.01)).sum() == 1
    counts = torch.zeros(4)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    for _ in range(400):
        counts[sampler.sample(logits)] += 1
    assert counts[2] == counts[3] == 0 and counts[0] > counts[1] > 0
