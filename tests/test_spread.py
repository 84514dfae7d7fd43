"""The spread signal (`spread.answer_spread`) and the budget it sets (`RequestOptions.spread_ratio`): a question
whose subject two chunks or more hold is recomputed at spread_ratio; any other request runs exactly as
before, and ratio 0 stays shared-prefix reuse."""

import pytest
import torch

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.evaluation import ruler
from cacheclip_rag.methods.budget import spread_budget
from cacheclip_rag.methods.spread import answer_spread
from cacheclip_rag.testing import tiny_model
from tests.conftest import max_diff


def words(text: str) -> int:
    return len(text.split())


def needle_chunks(sample: ruler.Sample, chunks: list[str]) -> set[int]:
    """The chunks that hold an asked needle, a needle repeated in the next chunk's overlap counted once."""
    held = set()
    for needle in sample.needles:
        if needle.key in sample.question:
            held.add(min(i for i, c in enumerate(chunks) if needle.sentence in c))
    return held


@pytest.mark.parametrize("task", ["spread2", "spread3", "spread4", "multivalue"])
def test_a_key_whose_values_several_chunks_hold_is_found_in_exactly_those_chunks(task):
    for seed in range(4):
        sample = ruler.generate(task, 2048, seed, words)
        chunks = ruler.sample_chunks(sample, words)
        found = answer_spread(sample.question, chunks)
        assert set(found.chunks) == needle_chunks(sample, chunks)
        assert found.spread == (len(found.chunks) >= 2)
        assert any(needle.key.replace("-", " ") in " ".join(found.phrases) for needle in sample.needles)


@pytest.mark.parametrize("task", ["single1", "single3", "multikey1", "multikey2", "multikey3"])
def test_a_single_fact_is_in_one_chunk_even_among_distractor_keys(task):
    for seed in range(4):
        sample = ruler.generate(task, 2048, seed, words)
        chunks = ruler.sample_chunks(sample, words)
        found = answer_spread(sample.question, chunks)
        assert set(found.chunks) == needle_chunks(sample, chunks) and not found.spread


def test_a_sentence_repeated_in_the_next_chunks_overlap_counts_once():
    fact = "The vault code of the Osterby mill is 4417."
    chunks = ["Rain fell on the harbour. " + fact, fact + " The bakery opened at six.", "Gulls circled the pier."]
    found = answer_spread("What is the vault code of the Osterby mill?", chunks)
    assert found.chunks == (0,) and not found.spread
    chunks[2] = "The vault code of the Osterby mill was 9902 before."
    assert answer_spread("What is the vault code of the Osterby mill?", chunks).chunks == (0, 2)


def test_common_words_alone_are_no_subject():
    chunks = ["It is in the box and on the shelf.", "It is of the sea and in the air.", "It was the end of it."] * 20
    found = answer_spread("What is in the box of the sea?", chunks)
    assert "the" not in found.phrases and "of the" not in found.phrases
    assert answer_spread("Where is it?", chunks).chunks == ()  # "it" and "is": common
    assert answer_spread("Where is it?", ["It is.", "It is here."]).chunks == ()  # function words: in any context
    assert answer_spread("Is the Osterby mill here?", ["The Osterby mill is here.", "It is here."]).chunks == (0,)
    assert answer_spread("", chunks).chunks == () and answer_spread("What?", []).chunks == ()


def test_function_words_are_no_subject_however_rare_in_the_chunks():
    """The anchors' duplicated handbook once flagged "Who directs the observatory?" on a relative "who" in
    three chunks (two of them about other people), and the request paid the larger budget."""
    chunks = ["It reopened under Tomas Ekwueme, who added the dish.", "Rain fell on the coastal road all week.",
              "The mirror is named after Dagny Halvorsen, who designed it.", "The present director is Amara Oduya."]
    found = answer_spread("Who directs the observatory?", chunks)
    assert "who" not in found.phrases and not found.spread
    assert answer_spread("Who designed the mirror?", chunks).chunks == (2,)


class _Plan:
    def __init__(self, question, texts):
        self.question, self.texts = question, tuple(texts)


SPREAD = _Plan("Which boats did the Osterby mill own?",
               ["The Osterby mill owned the Heron.", "Weather was fine.", "The Osterby mill owned the Tern too."])
SINGLE = _Plan("Which boats did the Osterby mill own?",
               ["The Osterby mill owned the Heron.", "Weather was fine.", "The bakery owned the Tern."])


def test_the_spread_budget_raises_only_a_partial_ratio_below_it():
    assert answer_spread(SPREAD.question, SPREAD.texts).chunks == (0, 2)
    assert spread_budget(SPREAD, RequestOptions(ratio=0.2)).ratio == 0.5
    assert spread_budget(SINGLE, RequestOptions(ratio=0.2)).ratio == 0.2
    assert spread_budget(SPREAD, RequestOptions(ratio=0.2, spread_ratio=None)).ratio == 0.2
    assert spread_budget(SPREAD, RequestOptions(ratio=0.0)).ratio == 0.0  # shared-prefix reuse, as asked
    assert spread_budget(SPREAD, RequestOptions(ratio=0.7)).ratio == 0.7
    assert spread_budget(SPREAD, RequestOptions(ratio=0.2, spread_ratio=0.3)).ratio == 0.3


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_bad_spread_ratio_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="spread_ratio"):
        RequestOptions(spread_ratio=bad)


def test_a_spread_question_runs_exactly_as_the_larger_ratio_and_any_other_exactly_as_asked(make_engine):
    engine = make_engine(tiny_model("qwen2"))
    engine.ingest(list(SPREAD.texts) + list(SINGLE.texts))

    def answer(plan, **kw):
        return engine.generate(plan.question, list(plan.texts), RequestOptions(max_new_tokens=3, min_recompute_tokens=0, **kw))

    spread, at_half = answer(SPREAD, ratio=0.2), answer(SPREAD, ratio=0.5, spread_ratio=None)
    assert spread.ratio == 0.5 and spread.recomputed_tokens == at_half.recomputed_tokens > 0
    assert spread.token_ids == at_half.token_ids and max_diff(spread.first_logits, at_half.first_logits) == 0
    single, plain = answer(SINGLE, ratio=0.2), answer(SINGLE, ratio=0.2, spread_ratio=None)
    assert single.ratio == 0.2 and single.recomputed_tokens == plain.recomputed_tokens
    assert single.token_ids == plain.token_ids and torch.equal(single.first_logits, plain.first_logits)
    assert answer(SPREAD, ratio=0.2, spread_ratio=None).recomputed_tokens < spread.recomputed_tokens
