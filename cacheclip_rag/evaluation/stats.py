"""Intervals and paired tests for quality claims: a number is reported with n and a 95% interval,
and a difference between methods is claimed only when its paired interval excludes zero.

- `bootstrap_ci`: percentile bootstrap interval of a mean.
- `paired_bootstrap_ci`: the same for the mean of paired differences (sample i of method A against
  sample i of method B), which removes the between-sample variance that unpaired intervals carry.
- `sign_test`: exact two-sided sign test of paired differences (ties dropped).
- `wilson_interval`: Wilson score interval of a proportion (scores in [0, 1] averaged over samples).
- `ratio_of_means`: mean(a) / mean(b) over paired samples with a paired bootstrap interval (retention, a KL
  share of another method's).
- `median_ci`, `ratio_of_medians`: the same for medians (a p50 time to first token; one engine's p50 over
  another's on the same requests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Estimate:
    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> Estimate:
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1 - level) / 2
    return Estimate(float(x.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail)), int(x.size))


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> Estimate:
    """Interval of mean(a - b) over paired samples."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    return bootstrap_ci(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64), level, resamples, seed)


def sign_test(a: Sequence[float], b: Sequence[float]) -> tuple[int, int, float]:
    """(times a > b, times a < b, exact two-sided p-value); ties are dropped."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    n = wins + losses
    if n == 0:
        return 0, 0, 1.0
    k = min(wins, losses)
    p = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return wins, losses, min(1.0, p)


def wilson_interval(successes: float, n: int, level: float = 0.95) -> Estimate:
    """Wilson score interval of a proportion; `successes` may be fractional (mean score x n)."""
    if n <= 0:
        raise ValueError("n must be positive")
    z = {0.95: 1.959963984540054, 0.9: 1.6448536269514722, 0.99: 2.5758293035489004}[level]
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half), n)


def ratio_of_means(pairs: Sequence[tuple[float, float]], resamples: int = 10_000, seed: int = 0) -> dict:
    """mean(a) / mean(b) over paired samples (a method's score over full's, or its KL over shared-prefix
    reuse's), with a paired bootstrap 95% interval."""
    a = np.array([p[0] for p in pairs], dtype=np.float64)
    b = np.array([p[1] for p in pairs], dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(resamples, len(a)))
    sa, sb = a[idx].mean(1), b[idx].mean(1)
    ok = sb > 0
    ratios = sa[ok] / sb[ok]
    return {"mean": float(a.mean() / b.mean()), "low": float(np.quantile(ratios, 0.025)),
            "high": float(np.quantile(ratios, 0.975)), "n": int(len(a))}


def median_ci(values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> Estimate:
    """The median with its percentile bootstrap interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    tail = (1 - level) / 2
    return Estimate(float(np.median(x)), float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail)),
                    int(x.size))


def ratio_of_medians(a: Sequence[float], b: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                     seed: int = 0) -> Estimate:
    """median(a) / median(b) over the same requests (a[i] and b[i] answer request i), with a paired bootstrap
    interval: the requests are resampled, each keeping both its times."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.size != y.size or x.size == 0:
        raise ValueError(f"need the same non-zero number of times: {x.size} and {y.size}")
    if np.median(y) <= 0:
        raise ValueError("the reference median must be positive")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    ratios = np.median(x[idx], axis=1) / np.maximum(np.median(y[idx], axis=1), 1e-300)
    tail = (1 - level) / 2
    return Estimate(float(np.median(x) / np.median(y)), float(np.quantile(ratios, tail)),
                    float(np.quantile(ratios, 1 - tail)), int(x.size))
