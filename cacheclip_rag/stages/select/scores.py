"""Token importance scores for selective recompute (the budget they are spent on: `group.to_budget`).

- `aux_scores` (CacheClip, section 4.2): the aux model runs the question over each chunk's stored
  aux KV, all chunks batched as `chunk_i + question`; the last layer's attention from question
  rows to that chunk's rows, averaged over heads and question rows, scores each chunk token.
- `value_deviation_scores` (CacheBlend): layers 0-1 recomputed for every chunk token; the score is
  how far layer 1's recomputed values moved from the cached ones.
- `primary_attention_scores` (oracle): the primary's own last-layer question->chunk attention under
  full prefill; a reference, not a ceiling (the question's attention over the reused cache beat it).
- `boundary_selection`: each chunk's seam and first tokens, recomputed first (`boundary_tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from ..recompute.attention import AttentionProbe, SelectedRowsKernel
from ..cache import BlendedCache
from ..load.ingest import PrefixCache, new_cache
from ...models.loading import LoadedModel, layer_types
from ..recompute.forward import forward_at
from ...store import ChunkEntry

if TYPE_CHECKING:
    from ..request import Plan


def _slot_mask(
    lm: LoadedModel, prefix_len: int, lengths: list[int], question_len: int, *, dtype: torch.dtype
) -> dict[str, torch.Tensor] | torch.Tensor:
    """Masks [C, 1, Q, P + max_n + Q] for question rows stored after the longest chunk's rows.

    Each cache slot is given the position it holds for its chunk (padding slots none), so causality
    and sliding windows are applied in position space while slots are shared by the batch.
    """
    longest = max(lengths)
    n = torch.tensor(lengths)[:, None]  # [C, 1]
    slot = torch.arange(prefix_len + longest + question_len)[None]  # [1, K]
    q_start = prefix_len + longest
    slot_pos = torch.where(slot < prefix_len + n, slot, slot - q_start + prefix_len + n)  # [C, K]
    valid = (slot < prefix_len + n) | (slot >= q_start)
    q_pos = (prefix_len + n + torch.arange(question_len)[None])[:, None, :, None]  # [C, 1, Q, 1]
    k_pos = slot_pos[:, None, None, :]
    allowed = valid[:, None, None, :] & (k_pos <= q_pos)
    neg = torch.finfo(dtype).min

    def additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, neg).to(lm.device)

    config = lm.config
    if getattr(config, "layer_types", None) is None:
        return additive(allowed)
    masks = {"full_attention": additive(allowed)}
    if "sliding_attention" in layer_types(lm.model):
        masks["sliding_attention"] = additive(allowed & (k_pos > q_pos - config.sliding_window))
    return masks


def question_tokens(lm: LoadedModel, question: str, answer_prefix: str = "") -> tuple[list[int], torch.Tensor]:
    """The question in the model's prompt format: its token ids, and which of them are the question's
    own text [Q] (bool) rather than template ("Question:", "Answer:", role markers)."""
    text = lm.prompt.question(question, answer_prefix)
    ids, spans = lm.encode_with_offsets(text)
    start = text.find(question)
    if start < 0:
        return ids, torch.ones(len(ids), dtype=torch.bool)
    stop = start + len(question)
    own = torch.tensor([a < stop and b > start for a, b in spans], dtype=torch.bool)
    return ids, own if own.any() else torch.ones(len(ids), dtype=torch.bool)


def aux_scores(
    aux: LoadedModel, prefix: PrefixCache, entries: Sequence[ChunkEntry], question_ids: Sequence[int],
    *, question_rows: torch.Tensor | None = None, model: PreTrainedModel | None = None,
) -> list[torch.Tensor]:
    """Per chunk, a score [n_c] for each of its aux tokens (see module doc), averaged over heads and
    the question rows `question_rows` [Q] (bool; default all). Tokens after the last scored row are
    not run at all: causal attention makes them irrelevant to the scores. `model`: the module that
    runs the pass (default the aux's own; e.g. its int8 copy)."""
    if question_rows is not None and bool(question_rows.any()):
        keep = int(torch.nonzero(question_rows).max()) + 1
        question_ids, question_rows = list(question_ids)[:keep], question_rows[:keep]
    p, q = len(prefix.token_ids), len(question_ids)
    lengths = [e.num_tokens for e in entries]
    longest, c = max(lengths), len(entries)
    runner = model or aux.model
    dtype = next(w for w in runner.parameters() if w.is_floating_point()).dtype  # an int8 copy runs in float32
    cache = new_cache(aux, p + longest + q, batch=c, dtype=dtype)
    for i, layer in enumerate(cache.layers):
        layer.keys[:, :, :p] = prefix.keys[i]
        layer.values[:, :, :p] = prefix.values[i]
        for b, e in enumerate(entries):
            layer.keys[b, :, p : p + e.num_tokens] = e.keys[i]
            layer.values[b, :, p : p + e.num_tokens] = e.values[i]
    positions = torch.tensor([[p + n + j for j in range(q)] for n in lengths])
    slots = torch.arange(p + longest, p + longest + q)
    last = aux.config.num_hidden_layers - 1
    probe = AttentionProbe()
    mask = _slot_mask(aux, p, lengths, q, dtype=dtype)
    ids = torch.tensor([list(question_ids)] * c)
    forward_at(runner, cache, ids, positions, slots=slots, mask=mask, probes={last: probe})
    weights = probe.weights  # [C, H, Q, K]
    if question_rows is not None:
        weights = weights[:, :, question_rows.to(weights.device)]
    return [weights[b, :, :, p : p + n].mean(dim=(0, 1)).cpu() for b, n in enumerate(lengths)]


def value_deviation_scores(
    lm: LoadedModel, cache: BlendedCache, chunk_ids: torch.Tensor, start: int, kernel: SelectedRowsKernel | None = None
) -> torch.Tensor:
    """CacheBlend: recompute layers 0 and 1 for every chunk token (rows start..start+T-1).

    Layer 0 keeps the recomputed K/V (CacheBlend recomputes the first layer in full); layer 1 is
    restored after its values are compared, so only selected tokens update it later. With `kernel`
    (CUDA) the pass attends by position with no mask; without, a [T, start+T] position mask is built.
    Returns the deviation [T] = ||V1_recomputed - V1_cached|| summed over kv heads.
    """
    if lm.config.num_hidden_layers < 2:
        raise ValueError("cacheblend needs a model with at least 2 layers")
    stop = start + chunk_ids.numel()
    old_k1 = cache.layers[1].keys[0, :, start:stop].clone()
    old_v1 = cache.layers[1].values[0, :, start:stop].clone()
    base = lm.model.model
    layers = base.layers
    base.layers = torch.nn.ModuleList(list(layers)[:2])
    try:
        forward_at(lm.model, cache, chunk_ids[None], torch.arange(start, stop)[None], base_model_only=True, kernel=kernel)
    finally:
        base.layers = layers
    new_v1 = cache.layers[1].values[0, :, start:stop]
    deviation = (new_v1.float() - old_v1.float()).norm(dim=-1).sum(0)  # [T]
    cache.layers[1].keys[0, :, start:stop] = old_k1
    cache.layers[1].values[0, :, start:stop] = old_v1
    return deviation.cpu()


def primary_attention_scores(
    lm: LoadedModel, context_ids: Sequence[int], question_ids: Sequence[int], chunk_start: int
) -> torch.Tensor:
    """Oracle: last-layer question->context attention of the primary under full prefill.

    Returns scores [S - chunk_start] for context rows chunk_start..S-1 (the chunks).
    """
    s, q = len(context_ids), len(question_ids)
    cache = new_cache(lm, s + q)
    forward_at(lm.model, cache, torch.tensor([list(context_ids)]), torch.arange(s)[None])
    probe = AttentionProbe()
    last = lm.config.num_hidden_layers - 1
    forward_at(lm.model, cache, torch.tensor([list(question_ids)]), torch.arange(s, s + q)[None], probes={last: probe})
    return probe.weights[0, :, :, chunk_start:s].mean(dim=(0, 1)).cpu()


def boundary_selection(plan: Plan, first: int, skip: int, ratio: float) -> list[torch.Tensor]:
    """Per chunk, the primary tokens at its boundaries (bool masks): its separator tokens (the seam to
    what follows) and its first `first` tokens, for every chunk from `skip` on; when they exceed the
    budget ceil(ratio x chunk tokens), seams come first, then the first tokens by their place in the
    chunk (every chunk's token 0, then every chunk's token 1, ...)."""
    masks = [torch.zeros(len(ids), dtype=torch.bool) for ids in plan.chunk_ids]
    ranked: list[tuple[int, int, int]] = []  # (rank, chunk, token)
    for c in range(skip, len(plan.chunk_ids)):
        for t, seam in enumerate(plan.separators(c).tolist()):
            if seam:
                ranked.append((-1, c, t))
            elif t < first:
                ranked.append((t, c, t))
    budget = math.ceil(ratio * sum(len(ids) for ids in plan.chunk_ids) - 1e-9)
    for _, c, t in sorted(ranked)[:budget]:
        masks[c][t] = True
    return masks
