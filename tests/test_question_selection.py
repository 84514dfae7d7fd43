"""The question selection (`RequestOptions(selection="question", aux_share=p)`, once `requery=p`): the question's own attention over the (partly
corrected) cache picks the rest of the budget, and the rows run twice are counted (both exact ends: in
tests/test_boundaries.py, beside the other selection option's)."""

import math

import pytest
import torch

from cacheclip_rag.stages.load import blend
from cacheclip_rag.methods import prefills as methods
from cacheclip_rag.stages.recompute.attention import AttentionProbe, use_cacheclip_attention
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.stages.select.selection import question_scores
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, max_diff, options_of, prefill

@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_aux_share_spends_the_budget_and_counts_stage_ones_rows_twice(make_engine, arch):
    engine = make_engine(tiny_model(arch))
    plan, paper = prefill(engine, ratio=0.3, requery=None)
    _, alone = prefill(engine, ratio=0.3, requery=0.0)
    _, half = prefill(engine, ratio=0.3, requery=0.5)
    _, aux_half = prefill(engine, ratio=0.15, requery=None)  # stage 1 of requery=0.5 is the paper's selection at half the ratio
    budget = math.ceil(0.3 * (plan.question_start - plan.prefix_len) - 1e-9)
    window = engine.config.window
    chunk0 = set(range(plan.chunk_offsets[0], plan.chunk_offsets[1]))
    for p in (alone, half):
        chosen = set(p.recomputed_positions.tolist())
        assert len(chosen) == p.recomputed_positions.numel()  # no row twice in the final pass
        assert budget <= len(chosen) <= budget + 2 * window - 2 and not chosen & chunk0
    assert alone.extra_recomputed == 0
    assert half.extra_recomputed == aux_half.recomputed_positions.numel() > 0
    assert set(aux_half.recomputed_positions.tolist()) <= set(half.recomputed_positions.tolist())
    assert set(alone.recomputed_positions.tolist()) != set(paper.recomputed_positions.tolist())


def test_the_default_selection_is_the_questions_attention_and_the_papers_aux_selection_is_kept(make_engine, monkeypatch):
    """cacheclip's default is the question's attention with no aux stage (it won on the default primary,
    bench/RESULTS.md): the aux is not run; selection="aux" reproduces the paper's aux selection."""
    engine = make_engine(tiny_model("llama"))
    calls = []
    select = methods.aux_attention
    monkeypatch.setattr(methods, "aux_attention", lambda *a: calls.append(1) or select(*a))
    assert (RequestOptions().selection, RequestOptions().aux_share) == ("question", 0.0)
    _, default = prefill(engine, ratio=0.3)
    assert not calls
    _, alone = prefill(engine, ratio=0.3, requery=0.0)
    _, paper = prefill(engine, ratio=0.3, requery=None)
    assert calls == [1]
    assert torch.equal(default.recomputed_positions, alone.recomputed_positions)
    assert max_diff(default.logits, alone.logits) == 0
    assert set(paper.recomputed_positions.tolist()) != set(default.recomputed_positions.tolist())


def test_the_question_selection_recomputes_the_rows_the_question_attends_to_most(make_engine):
    engine = make_engine(tiny_model("qwen2"))
    plan, p = prefill(engine, ratio=0.25, requery=0.0, grouping=False)
    options = RequestOptions(ratio=0.25, max_new_tokens=1, min_recompute_tokens=0)
    cache = blend.blended_cache(engine.parts, plan, options, shared=True)
    scores = question_scores(engine.parts, cache, plan, options)
    assert math.isclose(float(scores.sum()), 1.0, rel_tol=1e-4)  # each layer's share over the chunk rows
    a, b = plan.chunk_rows()[0]
    scores[a:b] = float("-inf")  # chunk 0 behind the prefix is exact already
    for c in range(1, len(plan.chunk_ids)):  # separators rank last
        lo = plan.chunk_rows()[c][0]
        for t, (start, _) in enumerate(plan.char_spans[c]):
            if start >= len(plan.texts[c]):
                scores[lo + t] = -1.0
    k = math.ceil(0.25 * scores.numel() - 1e-9)
    expected = set((plan.prefix_len + torch.topk(scores, k).indices).tolist())
    assert set(p.recomputed_positions.tolist()) == expected


def test_a_probe_on_rows_keeps_their_mean_over_heads_and_rows():
    lm = tiny_model("llama")
    use_cacheclip_attention(lm.model)
    cache = new_cache(lm, 24)
    ids = torch.arange(3, 23)[None]
    forward_at(lm.model, cache, ids[:, :16], torch.arange(16)[None])
    rows = torch.tensor([True, False, True, True])
    whole, reduced = AttentionProbe(), AttentionProbe(rows=rows)
    forward_at(lm.model, cache, ids[:, 16:20], torch.arange(16, 20)[None], probes={0: whole})
    forward_at(lm.model, cache, ids[:, 16:20], torch.arange(16, 20)[None], probes={0: reduced})
    assert reduced.weights.shape == (1, whole.weights.shape[-1])
    assert max_diff(reduced.weights, whole.weights[:, :, rows].mean(dim=(1, 2))) < 1e-6


@pytest.mark.parametrize("kw, match", [({"requery": 1.0}, "aux_share"), ({"requery": -0.1}, "aux_share"),
                                       ({"requery": True}, "aux_share"), ({"requery": "half"}, "aux_share"),
                                       ({"requery": 0.5, "boundary_tokens": 2}, "selection='aux'"),
                                       ({"boundary_tokens": 2}, "selection='aux'")])
def test_bad_requery_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        options_of(**kw)


def test_the_old_requery_spelling_is_gone_from_the_library():
    """`RequestOptions(requery=...)` was deprecated for a release; only the HTTP API still reads the old field
    (tests/test_serve.py)."""
    with pytest.raises(TypeError, match="requery"):
        RequestOptions(requery=0.5)
    assert not hasattr(RequestOptions(), "requery")
    with pytest.raises(ValueError, match="selection"):
        RequestOptions(selection="attention")


def test_the_answer_counts_the_rows_run_twice(make_engine):
    engine = make_engine(tiny_model("llama"))
    options = RequestOptions(ratio=0.3, aux_share=0.5, max_new_tokens=2, min_recompute_tokens=0)
    plan = engine.plan(QUESTION, CHUNKS, options)
    p = engine.prefill(plan, options)
    answer = engine.generate(QUESTION, CHUNKS, options)
    assert answer.recomputed_tokens == p.recomputed_positions.numel() + p.extra_recomputed > p.recomputed_positions.numel()
