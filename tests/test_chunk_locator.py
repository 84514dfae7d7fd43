"""bench/chunk_locator.py: a chunk's attention share over the mean share at its position in the *other*
families (no request is its own baseline), and the locating AUC it reports."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
spec = importlib.util.spec_from_file_location("chunk_locator", BENCH / "chunk_locator.py")
chunk_locator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chunk_locator)


def request(family: str, shares: list[float], facts: list[int], full: bool = True, default: bool = True) -> dict:
    return {"case": {"family": family, "fact_chunks": facts}, "length": 2048, "signals": {"shares": shares},
            "rows": {"full": {"right": full}, "default": {"right": default}}}


def test_the_baseline_is_the_other_families_mean_at_the_same_position():
    rows = [request("topical", [0.2, 0.3, 0.5], [1]), request("link", [0.1, 0.1, 0.8], [2]),
            request("link", [0.3, 0.3, 0.4], [0])]
    z = chunk_locator.ratios(rows)
    assert z[0] == pytest.approx([0.2 / 0.2, 0.3 / 0.2, 0.5 / 0.6])  # link's means: 0.2, 0.2, 0.6
    assert z[1] == pytest.approx([0.1 / 0.2, 0.1 / 0.3, 0.8 / 0.5])  # topical's shares are link's baseline
    rows.append(request("compare", [0.5, 0.5], [0]))  # no other family has two chunks: no baseline, no ratio
    assert all(v != v for v in chunk_locator.ratios(rows)[3])


def test_a_fact_chunk_that_stands_out_only_after_the_position_bias_is_found():
    # the last chunk always takes most of the mass; the fact chunk takes more than its position's usual share
    rows = [request("topical", [0.1, 0.1, 0.8], [2]), request("topical", [0.05, 0.25, 0.7], [1]),
            request("link", [0.2, 0.1, 0.7], [0]), request("link", [0.1, 0.25, 0.65], [1])]
    report = chunk_locator.report(rows)
    by_family = {row["family"]: row for row in report["locating"]}
    assert by_family["link"]["top_k_recall"] == [2, 2]
    assert by_family["link"]["auc"] == 1.0
