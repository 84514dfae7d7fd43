"""Which chunk rows a request recomputes: the selectors, each returning one frozen `Selection`.

- `question_attention` (cacheclip's default, `selection="question"`): the question runs over the reused
  cache; its attention to each chunk row (heads and the question's own rows averaged), normalised over the
  chunk rows per layer and averaged over the full-attention layers (every layer where the model has no
  sliding-window layers), scores the rows. With `aux_share` p > 0 the aux's pick at p x ratio is recomputed
  first and the question looks at that partly corrected cache (ProphetKV's two stages); the final pass
  recomputes stage 1's rows again, so that ratio 1 is exact and ratio 0 recomputes nothing
  (`Selection.early` counts those rows).
- `aux_attention` (the paper's, `selection="aux"`): a small aux model's last-layer attention from the
  question to each chunk, run while the primary's caches load, mapped to the primary's tokens by characters.
- `value_deviation` (CacheBlend): how far layer 1's values move when layers 0-1 are recomputed.
- `oracle_attention`: the primary's own last-layer attention under full prefill (not a ceiling).

Chunk 0 behind the shared prefix is exact already and never chosen; separator tokens rank last. Every
budget is spent by `to_budget` (top-k, grouped by sliding windows unless an ablation turns it off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .align import beyond_text, map_selection
from ..recompute.attention import AttentionProbe
from ..load.blend import Parts, chunk_entries, positions_of, side_stream
from ..cache import BlendedCache
from ...config import DEFAULT_AUX, RequestOptions
from ...models.embedded import missing
from ..group import to_budget as group_budget
from ..load.ingest import SHARED, chunk_unit
from ...models.loading import LoadedModel, layer_types
from ..recompute.forward import forward_at
from ..request import Plan
from .scores import (
    aux_scores,
    boundary_selection,
    primary_attention_scores,
    question_tokens,
    value_deviation_scores,
)

CHOSEN = 1e30  # stage 1's rows rank above every score
SEPARATOR = -1e30  # separators rank below every chunk token: chosen only once the budget has room for all text


@dataclass(frozen=True)
class Selection:
    """Per chunk, the rows to recompute (bool), and how many rows an earlier stage already ran (they run
    again in the final pass)."""

    rows: tuple[torch.Tensor, ...]
    early: int = 0

    def positions(self, plan: Plan) -> torch.Tensor:
        return positions_of(plan, self.rows)


def none_of(plan: Plan) -> Selection:
    return Selection(tuple(torch.zeros(len(ids), dtype=torch.bool) for ids in plan.chunk_ids))


def to_budget(parts: Parts, options: RequestOptions, scores: list[torch.Tensor], ratio: float,
              grouped: bool = True) -> list[torch.Tensor]:
    """`group.to_budget` with the engine's window and the request's diagnostics (grouping off: plain top-k)."""
    return group_budget(scores, ratio, window=parts.config.window, threshold=parts.config.threshold,
                        grouped=grouped and options.diagnostics.grouping, exact=options.diagnostics.exact_budget)


def question_scores(parts: Parts, cache: BlendedCache, plan: Plan, options: RequestOptions) -> torch.Tensor:
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
    # no logits: the probes are what this pass is for (the output head is 11.7 ms of Qwen2.5-0.5B's 0.12 s pass)
    forward_at(lm.model, cache, torch.tensor([list(plan.question_ids)]), positions[None], probes=probes,
               base_model_only=True)
    fused = torch.zeros(plan.question_start - plan.prefix_len)
    for probe in probes.values():
        row = probe.weights[0, plan.prefix_len : plan.question_start].float().cpu()
        fused += row / row.sum().clamp_min(1e-30)
    return fused / len(probes)


def question_attention(parts: Parts, cache: BlendedCache, plan: Plan, options: RequestOptions, *,
                       first: Selection | None = None) -> Selection:
    """The default selector over the loaded `cache`: stage 1's rows `first` (the aux's pick, or none)
    recomputed, then the rest of the budget by the question's attention (`question_scores`)."""
    first = first or none_of(plan)
    early = first.positions(plan)
    if early.numel():
        ids = torch.tensor(plan.all_ids())[early]
        forward_at(parts.primary.model, cache, ids[None], early[None], kernel=parts.kernel)
    if options.ratio <= 0.0:
        return Selection(first.rows, int(early.numel()))
    skip = 1 if options.diagnostics.shared_prefix else 0
    if options.ratio >= 1.0:  # every row: nothing to rank, so no question pass
        every = [torch.full((len(ids),), c >= skip, dtype=torch.bool) for c, ids in enumerate(plan.chunk_ids)]
        return Selection(tuple(every), int(early.numel()))
    scores = question_scores(parts, cache, plan, options)
    per_chunk = []
    for c, ((a, b), chosen) in enumerate(zip(plan.chunk_rows(), first.rows)):
        score = scores[a:b].clone()
        if c < skip:
            score[:] = float("-inf")
        else:
            score[plan.separators(c)] = SEPARATOR
        score[chosen] = CHOSEN
        per_chunk.append(score)
    picked = to_budget(parts, options, per_chunk, options.ratio)
    return Selection(tuple(p | f for p, f in zip(picked, first.rows)), int(early.numel()))


def require_aux(parts: Parts) -> LoadedModel:
    """The aux model, or a clear error where none is configured."""
    if parts.aux is None:
        command = missing(DEFAULT_AUX)
        raise ValueError("cacheclip's aux selection (selection='aux', or aux_share > 0) needs an aux model; set "
                         "EngineConfig.aux, or use the default selection='question', which needs none"
                         + (f" (the default aux is not installed: {command})" if command else ""))
    return parts.aux


def aux_attention(parts: Parts, plan: Plan, options: RequestOptions) -> Selection:
    """The paper's selector: aux scores -> to the budget -> mapped to the primary's tokens. Chunk 0 behind
    the shared prefix is not scored (no aux pass). With `boundary_tokens`, each chunk's seam and first
    tokens come first, out of the same budget."""
    aux = require_aux(parts)
    prefix, entries = chunk_entries(parts, aux, plan.texts, variant=SHARED, system_prompt=plan.system_prompt,
                                    bare=plan.bare or None)
    question_ids, question_rows = question_tokens(aux, plan.question, options.answer_prefix)
    skip = 1 if options.diagnostics.shared_prefix else 0
    forced, ratio, boundary = None, options.ratio, options.diagnostics.boundary_tokens
    if boundary is not None and 0.0 < options.ratio < 1.0:
        forced = boundary_selection(plan, boundary, skip, options.ratio)
        total = sum(len(ids) for ids in plan.chunk_ids)
        ratio = max(0.0, (math.ceil(options.ratio * total - 1e-9) - sum(int(f.sum()) for f in forced)) / total)
    with side_stream(aux.device):  # on a GPU, off the stream that loads the primary's caches
        scored = (aux_scores(aux, prefix, entries[skip:], question_ids, question_rows=question_rows, model=parts.aux_scorer)
                  if len(entries) > skip else [])
    scores = [torch.full((entries[0].num_tokens,), float("-inf"))] * skip + scored
    for score, entry, text in zip(scores, entries, plan.texts):
        # their cached K/V lack cross-chunk attention too, so ratio 1 still recomputes them
        score[beyond_text(entry.offsets, text) & torch.isfinite(score)] = SEPARATOR
    chosen = to_budget(parts, options, scores, ratio)
    bare = plan.bare or (False,) * len(plan.texts)
    mapped = [map_selection(entry.offsets, c, spans, len(chunk_unit(aux, text, b)))
              for text, b, entry, c, spans in zip(plan.texts, bare, entries, chosen, plan.char_spans)]
    return Selection(tuple(mapped if forced is None else [m | f for m, f in zip(mapped, forced)]))


def value_deviation(parts: Parts, cache: BlendedCache, plan: Plan, options: RequestOptions) -> Selection:
    """CacheBlend's selector over the loaded `cache`: the rows whose layer-1 values deviate most (top-k,
    no grouping, as CacheBlend has none)."""
    chunk_ids = torch.tensor(plan.all_ids()[plan.prefix_len : plan.question_start])
    deviation = value_deviation_scores(parts.primary, cache, chunk_ids, plan.prefix_len, kernel=parts.kernel)
    return Selection(tuple(to_budget(parts, options, [deviation[a:b] for a, b in plan.chunk_rows()], options.ratio,
                                     grouped=False)))


def oracle_attention(parts: Parts, plan: Plan, options: RequestOptions) -> Selection:
    """The primary's own last-layer attention from the question under full prefill, to the budget."""
    scores = primary_attention_scores(parts.primary, plan.context_ids(), plan.question_ids, plan.prefix_len)
    return Selection(tuple(to_budget(parts, options, [scores[a:b] for a, b in plan.chunk_rows()], options.ratio)))
