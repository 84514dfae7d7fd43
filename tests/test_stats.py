"""The statistics behind every quality claim, against hand-computed values."""

import math

import numpy as np
import pytest

from cacheclip_rag.evaluation.stats import (
    bootstrap_ci,
    median_ci,
    paired_bootstrap_ci,
    ratio_of_medians,
    sign_test,
    wilson_interval,
)


def test_wilson_interval_matches_the_formula():
    est = wilson_interval(8, 10)  # the textbook example: 8/10 -> [0.490, 0.943]
    assert est.mean == 0.8 and math.isclose(est.low, 0.4902, abs_tol=1e-3) and math.isclose(est.high, 0.9433, abs_tol=1e-3)
    assert wilson_interval(0, 10).low == 0.0 and math.isclose(wilson_interval(10, 10).high, 1.0)


def test_sign_test_is_the_exact_binomial():
    wins, losses, p = sign_test([1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0])
    assert (wins, losses) == (5, 0) and math.isclose(p, 2 / 32)
    assert sign_test([1, 0], [0, 1])[2] == 1.0
    assert sign_test([0.5, 0.5], [0.5, 0.5]) == (0, 0, 1.0)  # ties only


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    small = bootstrap_ci(rng.normal(0.3, 1, 20))
    large = bootstrap_ci(rng.normal(0.3, 1, 2000))
    assert small.low < small.mean < small.high and large.low < 0.3 < large.high
    assert large.high - large.low < (small.high - small.low) / 5
    half = 1.96 / math.sqrt(2000)  # normal theory for sd 1
    assert math.isclose(large.high - large.low, 2 * half, rel_tol=0.1)


def test_pairing_removes_between_sample_variance():
    rng = np.random.default_rng(2)
    difficulty = rng.normal(0, 5, 200)  # large per-sample effect shared by both methods
    a, b = difficulty + 0.2 + rng.normal(0, 0.1, 200), difficulty + rng.normal(0, 0.1, 200)
    paired = paired_bootstrap_ci(a, b)
    assert paired.excludes_zero() and paired.low > 0.15
    unpaired_width = bootstrap_ci(a).high - bootstrap_ci(a).low
    assert paired.high - paired.low < unpaired_width / 10
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap_ci([1, 2], [1])


def test_median_ci_holds_the_median_and_narrows_with_n():
    rng = np.random.default_rng(3)
    small, large = rng.exponential(1.0, 24), rng.exponential(1.0, 2400)
    a, b = median_ci(small), median_ci(large)
    assert a.mean == pytest.approx(float(np.median(small))) and a.low <= a.mean <= a.high and a.n == 24
    assert b.high - b.low < (a.high - a.low) / 3
    assert b.low < np.log(2) < b.high  # the exponential's median


def test_ratio_of_medians_pairs_requests_and_refuses_mismatches():
    times = np.linspace(1.0, 3.0, 30)
    same = ratio_of_medians(0.5 * times, times)
    assert same.mean == pytest.approx(0.5) and same.low == pytest.approx(0.5) and same.high == pytest.approx(0.5)
    noisy = ratio_of_medians(times[::-1] * np.random.default_rng(1).uniform(0.2, 0.4, 30), times)
    assert noisy.low < noisy.mean < noisy.high and noisy.high < 1.0
    with pytest.raises(ValueError, match="same non-zero number"):
        ratio_of_medians([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        ratio_of_medians([1.0], [0.0])
