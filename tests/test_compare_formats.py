"""bench/compare_formats.py: per variant and format, the strict answers kept of full's, retention within each run,
and the change between formats over the same samples; folders of mixed formats or missing variants are refused."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_evaluation import record

spec = importlib.util.spec_from_file_location("compare_formats", Path(__file__).parents[1] / "bench" / "compare_formats.py")
compare_formats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_formats)


def run(fmt: str, method_right: set[int], full_right: set[int], samples: int = 10) -> list:
    rows = []
    for s in range(samples):
        rows += [record(s, "full", None, 0.0, score=float(s in full_right)),
                 record(s, "shared_prefix", None, 0.4, score=0.0),
                 record(s, "cacheclip_spread", 0.2, 0.1, score=float(s in method_right))]
    return [replace(r, format=fmt) for r in rows]


def test_kept_counts_retention_and_the_change_between_formats_are_exact_on_constructed_runs():
    """RULER format: full right on 0-7, the method on 0-7 (keeps 8 of 8). Deployed: full right on 0-7, the
    method on 0-3 and on 9, which full missed (keeps 4 of 8; solved 5, retention 5/8). Moved: 5/8 - 1 = -0.375.
    A partial score (0.5) is not solved."""
    ruler = run("ruler", set(range(8)), set(range(8)))
    deployed = run("deployed", {0, 1, 2, 3, 9}, set(range(8)))
    deployed = [replace(r, score=0.5) if r.variant == "cacheclip_spread" and r.seed == 4 else r for r in deployed]
    result = compare_formats.compare(ruler, deployed, ["full", "cacheclip_spread"], 0.2)
    row = next(r for r in result["rows"] if r["variant"] == "cacheclip_spread")
    assert result["formats"] == ["ruler", "deployed"] and row["n"] == 10
    assert (row["ruler"]["kept_of_full"], row["ruler"]["full_solved"]) == (8, 8)
    assert (row["deployed"]["kept_of_full"], row["deployed"]["solved"]) == (4, 5)
    assert row["deployed"]["retention"]["mean"] == pytest.approx(5 / 8)
    assert row["deployed"]["kept_by_task"] == {"single1": [4, 8]}
    assert row["retention_deployed_minus_ruler"]["mean"] == pytest.approx(5 / 8 - 1)
    assert row["deployed"]["tf_kl_share_of_reuse"]["mean"] == pytest.approx(0.25)


def test_mixed_formats_and_missing_variants_are_refused():
    ruler = run("ruler", {0}, {0})
    with pytest.raises(SystemExit, match="one format"):
        compare_formats.compare(ruler + run("deployed", {0}, {0}), run("deployed", {0}, {0}), ["full"], 0.2)
    with pytest.raises(SystemExit, match="no rows of"):
        compare_formats.compare(ruler, [r for r in run("deployed", {0}, {0}) if r.variant != "shared_prefix"],
                                ["full"], 0.2)
