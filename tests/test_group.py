import math
"""Sliding-window grouping on hand-worked sequences (w=8, tau=5 unless stated)."""

import pytest
import torch

from cacheclip_rag.stages.group import group


def mask(n, ones):
    m = torch.zeros(n, dtype=torch.bool)
    m[list(ones)] = True
    return m


def idx(m):
    return torch.nonzero(m).flatten().tolist()


def test_empty_candidates_select_nothing():
    assert idx(group(mask(20, []))) == []
    assert group(torch.zeros(0, dtype=torch.bool)).numel() == 0


def test_dense_run_extends_by_the_last_passing_window():
    # candidates 4..11; the window at 7 (7..14) still holds 5 of them, so it is kept whole: 4..14.
    # The window at 8 holds 4 and is not.
    assert idx(group(mask(20, range(4, 12)))) == list(range(4, 15))


def test_exactly_tau_candidates_keep_the_whole_window():
    # window starting at 3 covers 3..10 and holds 5 candidates: all 8 tokens selected
    assert idx(group(mask(20, [3, 4, 6, 8, 10]))) == list(range(3, 11))


def test_tau_minus_one_candidates_are_dropped():
    assert idx(group(mask(20, [3, 4, 6, 8]))) == []


def test_window_is_evaluated_only_where_it_starts_on_a_candidate():
    # candidates 5..9: the window starting at 2 (not a candidate) would hold 5, but is not evaluated;
    # the window starting at 5 holds 5 -> 5..12
    assert idx(group(mask(20, range(5, 10)))) == list(range(5, 13))


def test_overlapping_windows_merge():
    sel = idx(group(mask(30, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10])))
    # windows at 0 (0..7, 7 candidates), 1,2 (6,5 candidates), 3 (4+... 3,4,6,7,8,9,10 -> 7) ... up to 6 (6..13: 5)
    assert sel == list(range(0, 14))


def test_isolated_candidates_are_dropped_among_groups():
    sel = idx(group(mask(40, [1, 20, 21, 22, 23, 24, 39])))
    assert sel == list(range(20, 28))


def test_window_is_cut_at_the_end_of_the_sequence():
    # window at 16 covers 16..19 (4 tokens, 4 candidates) < tau: dropped
    assert idx(group(mask(20, [16, 17, 18, 19]))) == []
    # window at 14 covers 14..19 with 5 candidates: kept up to the end, not beyond
    assert idx(group(mask(20, [14, 15, 17, 18, 19]))) == list(range(14, 20))


def test_sequence_shorter_than_tau_is_kept_when_all_candidates():
    assert idx(group(mask(3, [0, 1, 2]))) == [0, 1, 2]
    assert idx(group(mask(3, [0, 2]))) == []


def test_all_candidates_select_everything():
    for n in (1, 4, 5, 8, 9, 50):
        assert group(torch.ones(n, dtype=torch.bool)).all()


@pytest.mark.parametrize("w,tau,cands,expected", [
    (4, 2, [0, 1, 9], [0, 1, 2, 3]),
    (1, 1, [2, 5], [2, 5]),
    (3, 3, [0, 1, 3, 4, 5], [3, 4, 5]),
])
def test_other_window_and_threshold(w, tau, cands, expected):
    assert idx(group(mask(10, cands), window=w, threshold=tau)) == expected


def test_invalid_parameters_are_rejected():
    with pytest.raises(ValueError):
        group(mask(5, [1]), window=4, threshold=5)
    with pytest.raises(ValueError):
        group(torch.zeros(2, 2, dtype=torch.bool))


def test_exact_budget_fills_whole_windows_up_to_the_ratio():
    """The nominal rule recomputes far less than the ratio (grouping drops isolated candidates); the
    exact rule grows the candidate pool until the grouped selection meets the budget, overshooting by
    less than two windows, and never picks a token scored -inf."""
    from cacheclip_rag.stages.group import grouped_to_budget
    from cacheclip_rag.stages.group import top_k_candidates

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        scores = [torch.rand(int(n), generator=g) for n in torch.randint(5, 120, (4,), generator=g)]
        scores[0][:] = float("-inf")  # chunk 0: exact behind the prefix, never a candidate
        ratio = float(torch.rand(1, generator=g)) * 0.6
        total = sum(s.numel() for s in scores)
        budget = math.ceil(ratio * total - 1e-9)
        exact = grouped_to_budget(scores, ratio, window=8, threshold=5)
        nominal = grouped_to_budget(scores, ratio, window=8, threshold=5, exact=False)
        assert not exact[0].any() and not nominal[0].any()
        assert [torch.equal(a, group(c, 8, 5)) for a, c in zip(nominal, top_k_candidates(scores, ratio))] == [True] * 4
        got = sum(int(m.sum()) for m in exact)
        eligible = total - scores[0].numel()
        assert budget <= got <= budget + 14 or got == sum(int(group(torch.ones(s.numel(), dtype=torch.bool), 8, 5).sum())
                                                        for s in scores[1:]) <= eligible, (trial, got, budget)
