import torch

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.decode.decoder import text_deltas
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION


def test_stream_yields_pieces_that_join_to_the_answer(make_engine):
    engine = make_engine(tiny_model("qwen2"))
    stream = engine.stream(QUESTION, CHUNKS, RequestOptions(method="shared_prefix", max_new_tokens=12))
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == stream.answer.text
    assert len(stream.answer.token_ids) == 12


def test_greedy_decode_matches_full_recompute_each_step(make_engine):
    """Token-by-token decode over the cache equals re-running full prefill on the growing prompt."""
    lm = tiny_model("gemma3")
    engine = make_engine(lm)
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=6))
    plan = engine.plan(QUESTION, CHUNKS, RequestOptions(method="full"))
    ids = plan.all_ids()
    for token in answer.token_ids:
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == token
        ids.append(token)


def test_sampling_is_seeded(make_engine):
    engine = make_engine(tiny_model("llama"))
    opts = RequestOptions(method="shared_prefix", temperature=1.0, top_p=0.9, seed=7, max_new_tokens=8)
    a = engine.generate(QUESTION, CHUNKS, opts)
    b = engine.generate(QUESTION, CHUNKS, opts)
    c = engine.generate(QUESTION, CHUNKS, RequestOptions(method="shared_prefix", temperature=1.0, seed=8, max_new_tokens=8))
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_stop_string_ends_the_answer_and_is_not_emitted():
    lm = tiny_model("llama")
    ids = lm.encode("The answer is 42. Question: next")
    generated: list[int] = []
    text = "".join(text_deltas(lm, iter(ids), ["Question:"], generated))
    assert text == "The answer is 42. "
    assert len(generated) < len(ids)


def test_stop_option_and_max_tokens(make_engine):
    engine = make_engine(tiny_model("llama"))
    free = engine.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=10))
    assert len(free.token_ids) == 10
    stop = free.text[3:6]
    cut = engine.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=10, stop=(stop,)))
    assert stop not in cut.text and free.text.startswith(cut.text)


def test_an_answer_opening_with_a_newline_is_not_cut_to_nothing():
    """The completion format stops at a newline; the demo's director question and the LangChain
    quickstart answered '\\n Amara ...' and showed nothing."""
    lm = tiny_model("llama")
    ids = lm.encode("\n\nAmara Lindqvist-Oduya\nQuestion: next")
    generated: list[int] = []
    text = "".join(text_deltas(lm, iter(ids), ["\n"], generated))
    assert text.strip() == "Amara Lindqvist-Oduya"
