"""Sliding-window grouping of candidate tokens (CacheClip section 4.3).

A window of w tokens is evaluated where it starts on a candidate; if it holds at least tau
candidates, every token in it is selected. Candidates no such window covers are dropped. Windows
stop at the end of the sequence; tau is clipped to the sequence length so that a sequence shorter
than tau whose tokens are all candidates is kept whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def group(candidates: torch.Tensor, window: int = 8, threshold: int = 5) -> torch.Tensor:
    """Selected tokens [T] (bool) from candidate tokens [T] (bool) of one sequence."""
    if candidates.dim() != 1:
        raise ValueError(f"candidates must be 1-D, got shape {tuple(candidates.shape)}")
    if window < 1 or not 1 <= threshold <= window:
        raise ValueError(f"need window >= 1 and 1 <= threshold <= window, got w={window}, tau={threshold}")
    n = candidates.numel()
    if n == 0:
        return candidates.clone()
    counts = torch.cat([torch.zeros(1, dtype=torch.long), candidates.long().cumsum(0)])  # [T+1]
    starts = torch.arange(n)
    ends = torch.clamp(starts + window, max=n)
    in_window = counts[ends] - counts[starts]  # candidates in the window starting at each token
    kept_starts = candidates.bool() & (in_window >= min(threshold, n))
    # token t is covered by a kept window starting in (t - window, t]
    covered = torch.cat([torch.zeros(1, dtype=torch.long), kept_starts.long().cumsum(0)])
    lo = torch.clamp(starts - window + 1, min=0)
    return (covered[starts + 1] - covered[lo]) > 0


def grouped_to_budget(
    scores: list[torch.Tensor], ratio: float, *, window: int, threshold: int, exact: bool = True
) -> list[torch.Tensor]:
    """CacheClip's selection per chunk (bool masks) from token scores [n_c] per chunk.

    The budget is ceil(ratio x all chunk tokens). Nominal (the paper): the top `ratio` tokens are
    candidates, then grouped, which drops isolated candidates, so fewer tokens are recomputed than
    the ratio says. Exact: the candidate pool grows in score order (the w/tau rule still decides what
    a window is) until the grouped selection meets the budget; whole windows are kept, so it can
    exceed the budget by up to 2w - 2 tokens (one more candidate can complete windows on both sides). Tokens scored -inf are never candidates (chunk 0
    behind the shared prefix, separators); adding candidates never removes a selected token, so
    the pool size is found by bisection."""
    lengths = [s.numel() for s in scores]
    flat = torch.cat([s.float().flatten() for s in scores]) if scores else torch.zeros(0)
    budget = min(flat.numel(), math.ceil(ratio * flat.numel() - 1e-9))
    eligible = int(torch.isfinite(flat).sum())
    order = torch.sort(flat, descending=True, stable=True).indices[:eligible]

    def select(k: int) -> list[torch.Tensor]:
        chosen = torch.zeros(flat.numel(), dtype=torch.bool)
        chosen[order[:k]] = True
        return [group(c, window, threshold) for c in chosen.split(lengths)]

    def count(k: int) -> int:
        return sum(int(m.sum()) for m in select(k))

    if not exact or budget == 0:
        return select(min(budget, eligible))
    # the smallest pool whose grouped selection meets the budget; windows can also make the nominal
    # pool overshoot it (a window keeps up to w tokens for tau candidates)
    lo, hi = 0, eligible  # count(lo) < budget <= count(hi), unless no pool reaches it
    if count(hi) < budget:
        return select(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) >= budget:
            hi = mid
        else:
            lo = mid
    return select(hi)


def top_k_candidates(scores: Sequence[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Bool masks per chunk: the top ceil(ratio x total tokens) scores over all chunks together
    (tokens scored -inf never: they do not count as candidates)."""
    lengths = [s.numel() for s in scores]
    flat = torch.cat([s.float().flatten() for s in scores])
    k = min(int(torch.isfinite(flat).sum()), math.ceil(ratio * flat.numel() - 1e-9))
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    if k > 0:
        chosen[torch.topk(flat, k).indices] = True
    return list(chosen.split(lengths))


def to_budget(scores: list[torch.Tensor], ratio: float, *, window: int, threshold: int, grouped: bool = True,
              exact: bool = True) -> list[torch.Tensor]:
    """The one budget every selector spends: the best-scored rows for `ratio` of all chunk rows, grouped by
    sliding windows (CacheClip) or plain top-k (`grouped=False`: CacheBlend's tokens, the `grouping=False`
    ablation). Rows scored -inf are never chosen."""
    if not grouped:
        return top_k_candidates(scores, ratio)
    return grouped_to_budget(scores, ratio, window=window, threshold=threshold, exact=exact)
