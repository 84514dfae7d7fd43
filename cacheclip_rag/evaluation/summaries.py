"""A run's records summarised: per cell estimates with intervals, paired differences between methods at
the same samples (bootstrap and sign test), and cross-budget comparisons."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from .profiles import VARIANTS
from .stats import bootstrap_ci, paired_bootstrap_ci, sign_test, wilson_interval

if TYPE_CHECKING:
    from .records import Record


def _estimate(values: Sequence[float]) -> dict:
    e = bootstrap_ci(values)
    return {"mean": e.mean, "low": e.low, "high": e.high, "n": e.n}


def summary(records: Sequence[Record]) -> dict:
    """Per (length, variant, ratio): n; mean score, fidelity and Δ log p(gold) with bootstrap 95%
    intervals; the share of samples solved with its Wilson interval; spent budget; timings; per task."""
    groups: dict[tuple[int, str, float | None], list[Record]] = {}
    for r in records:
        groups.setdefault((r.length, r.variant, r.ratio), []).append(r)
    rows = []
    for (length, variant, ratio), rs in groups.items():
        full = groups.get((length, "full", None))
        full_ttft = statistics.fmean(r.ttft_s for r in full) if full else None
        ttft = statistics.fmean(r.ttft_s for r in rs)
        solved = wilson_interval(sum(r.score == 1.0 for r in rs), len(rs))
        rows.append({
            "length": length, "variant": variant, "ratio": ratio, "n": len(rs),
            "score": _estimate([r.score for r in rs]),
            "solved": {"mean": solved.mean, "low": solved.low, "high": solved.high, "n": solved.n},
            "tf_kl": _estimate([r.tf_kl for r in rs]), "tf_top1": _estimate([r.tf_top1 for r in rs]),
            "kl": _estimate([r.kl for r in rs]), "gold_ll_delta": _estimate([r.gold_ll_delta for r in rs]),
            "recomputed_share": statistics.fmean(r.recomputed_share for r in rs),
            "select_s": statistics.fmean(r.select_s for r in rs), "load_s": statistics.fmean(r.load_s for r in rs),
            "recompute_s": statistics.fmean(r.recompute_s for r in rs), "ttft_s": ttft,
            "speedup": full_ttft / ttft if full_ttft and ttft > 0 else None,
            "per_task": {t: statistics.fmean(r.score for r in rs if r.task == t) for t in sorted({r.task for r in rs})},
        })
    return {"rows": rows}


PAIRED_METRICS = ("score", "tf_kl", "tf_top1", "kl", "gold_ll_delta")


def _by_cell(records: Sequence[Record]) -> dict[tuple[str, float | None], dict[tuple[str, int, int], Record]]:
    by: dict[tuple[str, float | None], dict[tuple[str, int, int], Record]] = {}
    for r in records:
        by.setdefault((r.variant, r.ratio), {})[(r.task, r.length, r.seed)] = r
    return by


def _paired_rows(mine: dict[tuple[str, int, int], Record], theirs: dict[tuple[str, int, int], Record],
                 metrics: Sequence[str], **labels: object) -> list[dict]:
    """Per length: mean of mine − theirs over the samples both hold, with a paired bootstrap 95%
    interval, and the sign test (wins = mine higher, ties dropped)."""
    out = []
    for length in sorted({k[1] for k in mine}):
        keys = sorted(k for k in mine if k in theirs and k[1] == length)
        if len(keys) < 2:
            continue
        for metric in metrics:
            a = [getattr(mine[k], metric) for k in keys]
            b = [getattr(theirs[k], metric) for k in keys]
            d = paired_bootstrap_ci(a, b)
            wins, losses, p = sign_test(a, b)
            out.append({"length": length, **labels, "metric": metric, "mean": d.mean, "low": d.low,
                        "high": d.high, "n": d.n, "wins": wins, "losses": losses, "p": p,
                        "excludes_zero": d.excludes_zero()})
    return out


def paired_differences(records: Sequence[Record], method: str = "cacheclip",
                       against: Sequence[str] | None = None) -> list[dict]:
    """`method` minus each other variant on the same samples, at the same ratio where both take one
    (ratio-free baselines are compared at every ratio of `method`): mean difference with a paired
    bootstrap 95% interval, and the sign test (wins = method higher, ties dropped)."""
    by = _by_cell(records)
    variants = dict.fromkeys(r.variant for r in records)
    against = [v for v in (against or variants) if v not in (method, "full") and v in variants]
    out = []
    for (variant, ratio), mine in sorted(by.items(), key=lambda kv: (kv[0][1] or 0.0)):
        if variant != method:
            continue
        for other in against:
            theirs = by.get((other, ratio if VARIANTS[other].uses_ratio else None), {})
            out += _paired_rows(mine, theirs, PAIRED_METRICS, ratio=ratio, method=method, other=other)
    return out


CROSS_BUDGET_METRICS = ("tf_kl", "score")


def cross_budget_differences(records: Sequence[Record], method: str = "cacheclip",
                             other: str = "cacheblend") -> list[dict]:
    """`method` at each ratio minus `other` at every larger ratio, on the same samples: whether the
    method matches the other's fidelity with less recompute (the paper's Figure 6 read across
    budgets). Same statistics as `paired_differences`."""
    by = _by_cell(records)
    mine_ratios = sorted(r for v, r in by if v == method and r is not None)
    their_ratios = sorted(r for v, r in by if v == other and r is not None)
    out = []
    for ratio in mine_ratios:
        for other_ratio in (r for r in their_ratios if r > ratio):
            out += _paired_rows(by[(method, ratio)], by[(other, other_ratio)], CROSS_BUDGET_METRICS, ratio=ratio,
                                method=method, other=other, other_ratio=other_ratio)
    return out


def records_as_dicts(records: Sequence[Record]) -> list[dict]:
    return [asdict(r) for r in records]
