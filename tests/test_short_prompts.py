"""The short-prompt floor (`RequestOptions.min_recompute_tokens`): cacheclip recomputes at least that many chunk
tokens, so a prompt with fewer chunk tokens is recomputed whole and answers exactly as `full` (the README's
two-chunk example answered with the other chunk's year at ratio 0.2); a longer prompt runs at its ratio; ratio 0
stays reuse alone."""

import pytest
import torch

from cacheclip_rag.stages.select import selection
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.methods.budget import short_prompt_budget
from cacheclip_rag.serve.layouts import Defaults, options_for
from cacheclip_rag.serve.requests import APIError, generation
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, has_embedded_models, max_diff, prefill

TOL = 1e-4


def test_a_prompt_under_the_floor_is_recomputed_whole_and_answers_as_full(make_engine):
    engine = make_engine(tiny_model("qwen2"))
    plan, full = prefill(engine, "full")
    total = plan.question_start - plan.prefix_len
    assert total < RequestOptions().min_recompute_tokens  # the tiny prompt is short
    _, floored = prefill(engine, min_recompute_tokens=RequestOptions().min_recompute_tokens)
    assert floored.ratio == 1.0
    assert torch.equal(floored.logits, full.logits)  # run as full: nothing loaded
    assert floored.recomputed_rows == total and floored.cache.from_store is None  # no blended cache
    _, partly = prefill(engine, min_recompute_tokens=total // 2)  # a floor between: a ratio, over the stored caches
    assert partly.ratio == pytest.approx((total // 2) / total)
    assert partly.cache.from_store is not None  # a blended cache
    _, plain = prefill(engine)  # the floor off (the tests' helper): the ratio alone
    assert plain.ratio == 0.2 and plain.recomputed_rows < floored.recomputed_rows
    assert max_diff(plain.logits, full.logits) > TOL


def test_the_default_options_use_the_floor_through_generate(make_engine):
    engine = make_engine(tiny_model("llama"))
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(max_new_tokens=2))
    full = engine.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=2))
    assert answer.ratio == 1.0 and answer.token_ids == full.token_ids
    assert max_diff(answer.first_logits, full.first_logits) < TOL


def test_the_floor_sets_the_ratio_from_the_chunk_tokens(make_engine):
    engine = make_engine(tiny_model("llama"))
    plan = engine.plan(QUESTION, CHUNKS, RequestOptions())
    total = sum(len(ids) for ids in plan.chunk_ids)
    at = lambda floor, ratio=0.2: short_prompt_budget(plan, RequestOptions(ratio=ratio, min_recompute_tokens=floor)).ratio  # noqa: E731
    assert at(0) == 0.2  # off
    assert at(total // 10) == 0.2  # under the ratio's own budget: unchanged
    assert at(total // 2) == pytest.approx((total // 2) / total)
    assert at(total) == 1.0 and at(10 * total) == 1.0
    method = lambda floor: short_prompt_budget(plan, RequestOptions(min_recompute_tokens=floor)).method  # noqa: E731
    assert method(total) == method(10 * total) == "full" and method(total - 1) == method(0) == "cacheclip"
    assert at(10 * total, ratio=0.0) == 0.0  # reuse alone, as asked
    assert at(10 * total, ratio=0.7) == 1.0


def test_ratio_one_recomputes_every_row_without_the_question_pass(make_engine, monkeypatch):
    engine = make_engine(tiny_model("llama"))
    _, full = prefill(engine, "full")

    def no_pass(*args, **kwargs):
        raise AssertionError("ratio 1 has nothing to rank")

    monkeypatch.setattr(selection, "question_scores", no_pass)
    _, whole = prefill(engine, ratio=1.0)
    assert max_diff(whole.logits, full.logits) < TOL


@pytest.mark.parametrize("bad", [-1, 1.5, True, "256", None])
def test_a_bad_floor_is_refused_by_name(bad):
    with pytest.raises((TypeError, ValueError), match="min_recompute_tokens"):
        RequestOptions(min_recompute_tokens=bad)


def test_the_server_takes_the_floor_and_refuses_a_bad_one():
    body = {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}]}
    unnamed = generation(body, ("cacheclip",), ("cacheclip",))
    assert options_for(unnamed, Defaults()).min_recompute_tokens == RequestOptions().min_recompute_tokens
    assert options_for(unnamed, Defaults(min_recompute_tokens=64)).min_recompute_tokens == 64  # the server's
    given = generation(body | {"cacheclip": {"min_recompute_tokens": 0}}, ("cacheclip",), ("cacheclip",))
    assert options_for(given, Defaults(min_recompute_tokens=64)).min_recompute_tokens == 0  # the request's
    for bad in (-5, 2.5, "many", True):
        with pytest.raises(APIError, match="min_recompute_tokens"):
            generation(body | {"cacheclip": {"min_recompute_tokens": bad}}, ("cacheclip",), ("cacheclip",))


def test_selection_masks_at_ratio_one_cover_every_chunk_but_the_first(make_engine):
    engine = make_engine(tiny_model("llama"))
    plan, p = prefill(engine, ratio=1.0)
    rows = set(p.recomputed_positions.tolist())
    expected = set(range(plan.chunk_offsets[1], plan.question_start))
    assert rows == expected and not rows & set(range(plan.prefix_len, plan.chunk_offsets[1]))
    assert torch.is_tensor(p.recomputed_positions)


README_CHUNKS = ["The ferry to Marrow Island leaves at 7:40 every morning from the north pier.",
                 "The lighthouse on Gull Point was built in 1871 and electrified in 1921."]


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
def test_the_readme_example_answers_right_with_the_defaults_in_either_order(tmp_path):
    """The README's first example on the default model: each question, each chunk order, the default options
    answer as `full` does, and right (at ratio 0.2 alone the ferry question was answered '1871')."""
    from cacheclip_rag import Engine, EngineConfig

    engine = Engine.from_config(EngineConfig(aux=None, store_path=tmp_path / "store"))
    for chunks in (README_CHUNKS, README_CHUNKS[::-1]):
        engine.ingest(chunks, progress=False)
        for question, right in (("When does the ferry to Marrow Island leave?", "7:40"),
                                ("When was the lighthouse on Gull Point built?", "1871")):
            answer = engine.generate(question, chunks, RequestOptions(max_new_tokens=12))
            full = engine.generate(question, chunks, RequestOptions(method="full", max_new_tokens=12))
            assert right in answer.text and answer.token_ids == full.token_ids, (question, chunks[0], answer.text)
            assert answer.ratio == 1.0 and answer.method == "cacheclip"  # asked for cacheclip; ran as full
