"""Sliding-window grouping of candidate tokens (CacheClip section 4.3).

A window of w tokens is evaluated where it starts on a candidate; if it holds at least tau
candidates, every token in it is selected. Candidates no such window covers are dropped. Windows
stop at the end of the sequence; tau is clipped to the sequence length so that a sequence shorter
than tau whose tokens are all candidates is kept whole.
"""

from __future__ import annotations

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
