"""CacheClip's query-driven selection (`RequestOptions(requery=p)`; ProphetKV's idea). p = 0 is the default
since it kept 0.96 of full's RULER 2K answers on the default primary where the paper's aux selection
(`requery=None`) kept 0.85 (bench/RESULTS.md); p > 0 adds the aux's pick as a first stage.

The quality-gap diagnosis found the error spread over the bulk of the chunk tokens, largest in the
chunk that holds what the question asks for, and only partly reached by the aux's selection. This
option lets the primary's own question pick most of the budget, under a cache the aux has begun to
correct:
1. the aux's selection at p x ratio is recomputed over the blended cache (skipped at p = 0);
2. the question runs over that partly corrected cache; its attention to each chunk row (heads and the
   question's own rows averaged), normalised over the chunk rows per layer and averaged over the
   full-attention layers (every layer where the model has no sliding-window layers), scores the rows;
3. the rest of the budget goes to the best-scored rows, grouped as CacheClip groups, and stage 1's rows
   plus these are recomputed with the question in one pass.
Stage 3 recomputes stage 1's rows again, so that ratio 1 is exact (every row then attends over rows of
the same pass) and ratio 0 recomputes nothing; those rows and the question's probe pass are the price
(`Prefill.extra_recomputed`), so budgets are compared by the rows actually run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import blend
from .attention import AttentionProbe
from .blend import Parts
from .config import RequestOptions
from .group import grouped_to_budget
from .models import layer_types
from .recompute import forward_at
from .request import Plan
from .select import question_tokens, top_k_candidates

if TYPE_CHECKING:
    from .cache import BlendedCache

CHOSEN = 1e30  # stage 1's rows rank above every score; separators rank below (-1e30), as in aux_selection


def question_attention(parts: Parts, cache: BlendedCache, plan: Plan, options: RequestOptions) -> torch.Tensor:
    """The question's attention to each row between the prefix and the question, [question_start -
    prefix_len], fused over layers as the module doc says. Writes the question's rows into `cache`
    (the final pass writes them again)."""
    lm = parts.primary
    kinds = layer_types(lm.model)
    layers = [i for i, kind in enumerate(kinds) if kind == "full_attention"] or list(range(len(kinds)))
    ids, own = question_tokens(lm, plan.question, options.answer_prefix)
    rows = own if list(ids) == list(plan.question_ids) else torch.ones(len(plan.question_ids), dtype=torch.bool)
    probes = {layer: AttentionProbe(rows=rows) for layer in layers}
    positions = plan.question_positions()
    forward_at(lm.model, cache, torch.tensor([list(plan.question_ids)]), positions[None], probes=probes)
    fused = torch.zeros(plan.question_start - plan.prefix_len)
    for probe in probes.values():
        row = probe.weights[0, plan.prefix_len : plan.question_start].float().cpu()
        fused += row / row.sum().clamp_min(1e-30)
    return fused / len(probes)


def second_stage(parts: Parts, plan: Plan, options: RequestOptions, scores: torch.Tensor,
                 first: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per chunk, the rows to recompute (bool): stage 1's `first`, then the best of `scores` up to the
    budget. Chunk 0 behind the shared prefix is exact already and never chosen; separators rank last."""
    skip = 1 if options.shared_prefix else 0
    per_chunk = []
    for c, ((a, b), chosen) in enumerate(zip(plan.chunk_rows(), first)):
        score = scores[a:b].clone()
        if c < skip:
            score[:] = float("-inf")
        else:
            score[plan.separators(c)] = -CHOSEN
        score[chosen] = CHOSEN
        per_chunk.append(score)
    if options.grouping:
        picked = grouped_to_budget(per_chunk, options.ratio, parts.config.window, parts.config.threshold,
                                   options.exact_budget)
    else:
        picked = top_k_candidates(per_chunk, options.ratio)
    return [p | f for p, f in zip(picked, first)]


def requery_positions(parts: Parts, cache: BlendedCache, plan: Plan, options: RequestOptions,
                      first: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Stages 1 and 2 over the loaded `cache`: stage 1's rows `first` (per chunk, bool) recomputed, then the
    positions the final pass recomputes, and how many rows stage 1 ran (they run again in that pass)."""
    early = blend.positions_of(plan, first)
    if early.numel():
        ids = torch.tensor(plan.all_ids())[early]
        forward_at(parts.primary.model, cache, ids[None], early[None], kernel=parts.kernel)
    chosen = first
    if options.ratio > 0.0:
        chosen = second_stage(parts, plan, options, question_attention(parts, cache, plan, options), first)
    return blend.positions_of(plan, chosen), int(early.numel())
