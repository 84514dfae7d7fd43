"""The diagnosis-and-fix options of the quality-gap issue: `boundary_tokens` (each chunk's seam and first
tokens recomputed first, out of the budget) and `recompute_layers` (recomputed rows written back in one
kind of layer only). Both keep the engine's exact ends: ratio 1.0 is full attention, ratio 0 is
shared-prefix reuse; in between they do exactly what they say, row by row."""

import pytest
import torch

from cacheclip_rag.stages.select.scores import boundary_selection
from cacheclip_rag.testing import tiny_model
from tests.conftest import max_diff, options_of, prefill

TOL = 1e-4


@pytest.mark.parametrize("option", [{"boundary_tokens": 0, "requery": None}, {"boundary_tokens": 3, "requery": None},
                                    {"requery": None}, {"requery": 0.0}, {"requery": 0.5}])
def test_the_selection_options_keep_both_exact_ends(tiny, make_engine, option):
    """the paper's selection, boundary_tokens and requery (tests/test_question_selection.py): ratio 1 is full attention, ratio 0 is shared-prefix
    reuse with nothing recomputed (and nothing run twice)."""
    engine = make_engine(tiny)
    full, shared = prefill(engine, "full")[1].logits, prefill(engine, "shared_prefix")[1].logits
    assert max_diff(prefill(engine, ratio=1.0, **option)[1].logits, full) < TOL
    at_zero = prefill(engine, ratio=0.0, **option)[1]
    assert max_diff(at_zero.logits, shared) < TOL and at_zero.recomputed_rows == 0


def test_boundary_tokens_recompute_every_seam_and_first_tokens_within_the_budget(make_engine):
    engine = make_engine(tiny_model("llama"))
    plan, paper = prefill(engine, ratio=0.3, requery=None)
    _, bounded = prefill(engine, ratio=0.3, boundary_tokens=2, requery=None)
    chosen = set(bounded.recomputed_positions.tolist())
    for c in range(1, len(plan.chunk_ids)):  # chunk 0 behind the prefix is exact: never recomputed
        start = plan.chunk_offsets[c]
        seams = [start + t for t, (s, _) in enumerate(plan.char_spans[c]) if s >= len(plan.texts[c])]
        assert seams and set(seams) <= chosen
        assert {start, start + 1} <= chosen
    assert not chosen & set(range(plan.chunk_offsets[0], plan.chunk_offsets[1]))
    chunk_tokens = plan.question_start - plan.prefix_len
    budget = -(-3 * chunk_tokens // 10)
    window = engine.config.window
    assert len(chosen) <= budget + 2 * window - 2  # whole windows may overshoot, as for the paper's selection
    assert chosen != set(paper.recomputed_positions.tolist())  # the option changed the selection


def test_boundary_selection_ranks_seams_first_when_the_budget_is_short(make_engine):
    engine = make_engine(tiny_model("llama"))
    plan, _ = prefill(engine)
    total = plan.question_start - plan.prefix_len
    masks = boundary_selection(plan, 4, 1, ratio=2.5 / total)  # a budget of 3 tokens
    picked = [(c, t) for c, m in enumerate(masks) for t in torch.nonzero(m).flatten().tolist()]
    assert len(picked) == 3
    assert all(plan.char_spans[c][t][0] >= len(plan.texts[c]) for c, t in picked)  # the seams
    assert not masks[0].any()


def test_recompute_layers_write_back_only_their_kind(make_engine):
    lm = tiny_model("gemma3")  # layers: sliding, sliding, global, sliding
    engine = make_engine(lm)
    plan, full = prefill(engine, "full")
    _, stored = prefill(engine, "shared_prefix")
    rows = slice(plan.chunk_offsets[1], plan.question_start)  # chunks after the first: loaded, then recomputed

    def layer_rows(p, layer):
        return p.cache.layers[layer].keys[0, :, rows], p.cache.layers[layer].values[0, :, rows]

    def same(a, b):
        return all(max_diff(x, y) < TOL for x, y in zip(a, b))

    _, sliding = prefill(engine, ratio=1.0, recompute_layers="sliding")
    _, global_ = prefill(engine, ratio=1.0, recompute_layers="global")
    # sliding only: layers before the first global one see exactly full attention's inputs
    assert same(layer_rows(sliding, 0), layer_rows(full, 0)) and same(layer_rows(sliding, 1), layer_rows(full, 1))
    assert same(layer_rows(sliding, 2), layer_rows(stored, 2))  # the global layer keeps what was loaded
    assert not same(layer_rows(sliding, 3), layer_rows(stored, 3))
    for layer in (0, 1, 3):  # global only: every sliding layer keeps what was loaded
        assert same(layer_rows(global_, layer), layer_rows(stored, layer))
    assert not same(layer_rows(global_, 2), layer_rows(stored, 2))
    # fresh global rows: the answer is neither full attention nor plain reuse (the tiny model's 12-token
    # window is shorter than the question, so its last token reads chunk rows in the global layer only)
    assert max_diff(global_.logits, full.logits) > 1e-3 and max_diff(global_.logits, stored.logits) > 1e-3
    # at ratio 0 nothing is recomputed: both are plain reuse
    for which in ("sliding", "global"):
        assert max_diff(prefill(engine, ratio=0.0, recompute_layers=which)[1].logits, stored.logits) < TOL


def test_recompute_layers_refuses_a_model_without_sliding_layers(make_engine):
    engine = make_engine(tiny_model("llama"))
    with pytest.raises(ValueError, match="sliding-window layers"):
        prefill(engine, recompute_layers="sliding")


@pytest.mark.parametrize("kw, match", [({"boundary_tokens": -1}, "boundary_tokens"),
                                       ({"boundary_tokens": 1.5}, "boundary_tokens"),
                                       ({"recompute_layers": "local"}, "recompute_layers")])
def test_bad_options_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        options_of(**kw)
