import math

import pytest

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


@pytest.mark.parametrize("chunks,match", [
    ([], "no chunks"),
    (["ok", ""], "chunk 1 is empty"),
    (["   \n\t "], "chunk 0 is empty"),
    ("a single string", "list of strings"),
    ([None], "chunk 0 is NoneType"),
])
def test_bad_chunks(lm, make_engine, chunks, match):
    engine = make_engine(lm)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.generate(QUESTION, chunks)
    with pytest.raises((ValueError, TypeError), match=match):
        engine.ingest(chunks, progress=False)


def test_question_longer_than_context(lm, make_engine):
    engine = make_engine(lm)
    with pytest.raises(ValueError, match="question of .* tokens does not fit the model's context of 2048"):
        engine.generate("why? " * 3000, CHUNKS)


def test_blended_prompt_beyond_context(lm, make_engine):
    engine = make_engine(lm)
    with pytest.raises(ValueError, match="blended prompt of .* exceeds the model's context of 2048"):
        engine.generate(QUESTION, CHUNKS * 30)
    with pytest.raises(ValueError, match="max_new_tokens=2000"):
        engine.generate(QUESTION, CHUNKS, RequestOptions(max_new_tokens=2000))


def test_empty_question(lm, make_engine):
    with pytest.raises(ValueError, match="question is empty"):
        make_engine(lm).generate("  ", CHUNKS)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan, math.inf, "0.2"])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match="recompute ratio must be a number in \\[0, 1\\]"):
        RequestOptions(ratio=ratio)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'fastest'"):
        RequestOptions(method="fastest")


def test_bad_config():
    with pytest.raises(ValueError, match="threshold"):
        EngineConfig(window=4, threshold=5)
    with pytest.raises(ValueError, match="system_prompt"):
        EngineConfig(system_prompt=" ")


def test_the_papers_selection_without_aux_is_a_clear_error_and_the_default_needs_none(lm, tmp_path):
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.store import LMDBStore

    engine = Engine(primary=lm, store=LMDBStore(tmp_path), config=EngineConfig(store_path=tmp_path), aux=None)
    for selection in (dict(selection="aux"), dict(aux_share=0.5)):  # both run the aux's selection
        with pytest.raises(ValueError, match="needs an aux model"):
            engine.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", **selection))
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=2,
                                                              min_recompute_tokens=0))
    assert answer.recomputed_tokens > 0  # the default selection (the question's attention) needs no aux


def test_an_ingest_that_cannot_fit_is_refused_before_any_model_work(make_engine, monkeypatch):
    """A system prompt that fills the context, or a chunk that cannot fit behind it, is refused from the token
    counts alone: no forward runs and nothing is stored (the server once computed the prefix first, 3.4 s for a
    system text at its size limit, before refusing)."""
    lm = tiny_model("llama")  # context 2048
    engine = make_engine(lm)
    calls = []
    forward = type(lm.model).forward
    monkeypatch.setattr(type(lm.model), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    with pytest.raises(ValueError, match="shared prefix .* tokens: .* context of 2048 tokens leaves no room"):
        engine.ingest(CHUNKS, progress=False, system_prompt="why? " * 3000)
    with pytest.raises(ValueError, match="chunk 1 of .* tokens behind a prefix of .* exceeds"):
        engine.ingest([CHUNKS[0], "why? " * 3000], progress=False)
    assert not calls and not list(engine.store.keys())
    engine.ingest(CHUNKS[:1], progress=False)  # what fits still goes in
    assert calls and list(engine.store.keys())
