import math
import copy

import torch

from cacheclip_rag.ingest import SHARED, chunk_unit
from cacheclip_rag.select import aux_scores, top_k_candidates
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, max_diff


def test_batched_stored_kv_scores_equal_plain_full_attention_forward(tiny, make_engine):
    """Selection over stored aux KV (all chunks batched) equals, chunk by chunk, the last-layer
    attention of a plain eager forward of prefix + chunk_i + question with output_attentions."""
    engine = make_engine(tiny)
    aux = engine.aux
    prefix, entries = engine.entries(aux, CHUNKS, SHARED)
    question_ids = aux.encode(aux.prompt.question(QUESTION))
    scores = aux_scores(aux, prefix, entries, question_ids)

    reference = copy.deepcopy(aux.model)
    reference.set_attn_implementation("eager")
    for text, got in zip(CHUNKS, scores):
        chunk_ids = aux.encode(chunk_unit(aux, text))
        ids = list(prefix.token_ids) + chunk_ids + question_ids
        with torch.no_grad():
            out = reference(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
        last = out.attentions[-1][0]  # [H, T, T]
        p, n, q = len(prefix.token_ids), len(chunk_ids), len(question_ids)
        expected = last[:, -q:, p : p + n].mean(dim=(0, 1))
        assert got.shape == expected.shape
        # float32, same math in another order: 1e-6 absolute on probabilities of order 1e-2
        assert max_diff(got, expected) < 1e-6


def test_top_k_is_global_over_chunks_with_ceil():
    scores = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.05]), torch.tensor([0.7])]
    chosen = top_k_candidates(scores, 0.4)  # ceil(0.4 * 6) = 3
    assert [c.tolist() for c in chosen] == [[False, True, False], [True, False], [True]]
    assert sum(int(c.sum()) for c in top_k_candidates(scores, 0.0)) == 0
    assert all(c.all() for c in top_k_candidates(scores, 1.0))
    assert sum(int(c.sum()) for c in top_k_candidates(scores, 0.5)) == 3


def test_question_rows_are_the_question_text_not_the_template():
    from cacheclip_rag.select import question_tokens

    lm = tiny_model("llama")
    ids, own = question_tokens(lm, "what colour is the ferry?", "The answer is")
    text = lm.prompt.question("what colour is the ferry?", "The answer is")
    _, spans = lm.encode_with_offsets(text)
    words = "".join(text[a:b] for (a, b), keep in zip(spans, own.tolist()) if keep)
    assert "ferry" in words and "answer" not in words.lower() and 0 < int(own.sum()) < len(ids)


def test_cacheclip_never_recomputes_chunk_zero_and_meets_the_budget(make_engine):
    from cacheclip_rag.config import RequestOptions
    from tests.conftest import CHUNKS, QUESTION

    engine = make_engine(tiny_model("llama"))
    plan = engine.plan(QUESTION, CHUNKS, RequestOptions())
    chunk_tokens = plan.question_start - plan.prefix_len
    eligible = chunk_tokens - len(plan.chunk_ids[0])
    for ratio in (0.1, 0.3, 0.6, 1.0):
        options = RequestOptions(method="cacheclip", ratio=ratio, max_new_tokens=1)
        selected = engine.aux_selection(plan, options)
        assert not selected[0].any()  # exact behind the shared prefix
        chosen = sum(int(m.sum()) for m in selected)
        assert chosen >= min(math.ceil(ratio * chunk_tokens), eligible)  # the budget is met, not nominal
    assert all(m.all() for m in selected[1:])  # ratio 1: every token but chunk 0's, separators included
