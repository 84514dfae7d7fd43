"""The deployed-format families (`cacheclip_rag.evaluation.deployed`): frozen (their digests pinned here, set
before any tuning: a change to the generator is a new set, to be reported as such), written as described, and
scored strictly."""

import re

import pytest

from cacheclip_rag.evaluation.deployed import FAMILIES, WORDS_FOR, Case, case, cases, digest, strict_score

FROZEN = {("short", 0): "5d4d830ace228a67", ("values", 1500): "6e5361606f6bf8ef", ("values", 3000): "94f8ce40fd8e17ca",
          ("compare", 1500): "1f82710f86b33ed6", ("compare", 3000): "16998dcbaa4b39ea",
          ("link", 1500): "718033047f965475", ("link", 3000): "58e558a621a5b3fb",
          ("topical", 1500): "36dff5ae099c5e27", ("topical", 3000): "93963507b1194ae4"}


@pytest.mark.parametrize("family, words", sorted(FROZEN))
def test_the_sets_are_frozen(family, words):
    assert digest(cases(family, words, 52)) == FROZEN[(family, words)]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_case_holds_its_answer_where_it_says_and_no_digits_elsewhere(family):
    for words in (0,) if family == "short" else tuple(WORDS_FOR.values()):
        for c in cases(family, words, 52):
            assert c.question and c.references and c.fact_chunks
            values = set(c.references) | set(c.wrong)
            for r in c.references:
                if family in ("short", "values", "link", "topical"):
                    assert any(r in c.chunks[i] for i in c.fact_chunks), (c.seed, r)
            for chunk in c.chunks:  # every number in the context is a value or a wrong one (no digits in filler)
                numbers = set(re.findall(r"\d+(?::\d+)?", chunk))
                assert numbers <= values | {n for v in values for n in re.findall(r"\d+", v)} | {
                    m for m in numbers if family == "compare"}, (c.seed, numbers - values)
            if family != "short":
                assert abs(sum(len(ch.split()) for ch in c.chunks) - words) < 0.15 * words


def test_strict_scoring_needs_every_part_and_nothing_wrong():
    c = Case("values", 1500, 0, ("x",), "q", ("1434", "9678"), ("8307",), (0,))
    assert strict_score("Codes 1434 and 9678.", c)
    assert not strict_score("Code 1434.", c)  # a part missing is wrong
    assert not strict_score("1434, 9678, 8307", c)  # a distractor named
    assert not strict_score("21434 and 96789", c)  # inside other numbers
    t = Case("short", 0, 0, ("x",), "q", ("7:40",), ("17:40",), (0,))
    assert strict_score("At 7:40.", t) and not strict_score("At 17:40.", t)


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown family"):
        case("haiku", 1500, 0)
