"""The blocks every method is built from, over the engine's parts (`Parts`: its models, store, config and
kernel): the blended cache (one prefix, each chunk's stored rows at its place in the prompt), the
recompute of chosen rows with the question, the aux's selection (the paper's), and where rows sit.
Methods (`methods`) and the query-driven selection (`requery`) use these; the engine (`engine`) holds
the parts and runs the methods. Nothing here imports the engine."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .align import map_selection
from .attention import SelectedRowsKernel
from .cache import BlendedCache
from .config import EngineConfig, RequestOptions
from .group import grouped_to_budget
from .ingest import DIRECT, SHARED, PrefixCache, chunk_unit, fetch_or_compute, load_into, new_cache, storage_dtype
from .layerwise import LayerStream, load_layerwise
from .models import LoadedModel, layer_types
from .recompute import recompute
from .request import Plan
from .rope import rotate_keys_
from .select import aux_scores, boundary_selection, question_tokens, top_k_candidates
from .store import ChunkEntry, KVStore
from .store.tiers import HostTier


@dataclass(frozen=True)
class Parts:
    """What a request runs on: the models, the store, the method's fixed settings and the attention kernel."""

    primary: LoadedModel
    store: KVStore
    config: EngineConfig
    aux: LoadedModel | None = None
    aux_scorer: Any = None  # the module the aux's selection pass runs (its int8 copy when configured)
    kernel: SelectedRowsKernel | None = None
    layer_stream: Callable[[LoadedModel], LayerStream | None] = lambda lm: None


@contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Run the block on a CUDA stream of its own (finished before leaving), so it overlaps work queued
    on the default stream by another thread; a no-op elsewhere."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def store_dtype(parts: Parts, lm: LoadedModel) -> torch.dtype:
    """The dtype `lm`'s chunk caches are stored in (see `EngineConfig.store_dtype`)."""
    return storage_dtype(parts.config.store_dtype, lm)


def chunk_entries(parts: Parts, lm: LoadedModel, texts: Sequence[str], variant: str, system_prompt: object = None,
                  bare: Sequence[bool] | None = None) -> tuple[PrefixCache, list[ChunkEntry]]:
    """Stored entries for `texts` behind `system_prompt` (default the engine's; or a FormattedPrefix);
    a miss is computed, stored and used."""
    return fetch_or_compute(lm, parts.store, texts, variant, system_prompt or parts.config.system_prompt,
                            parts.config.ingest_batch_size, store_dtype(parts, lm), bare)


def blended_cache(parts: Parts, plan: Plan, options: RequestOptions, shared: bool,
                  reposition: bool = True) -> BlendedCache:
    """One prefix, then every chunk's cached rows at its offset in the prompt: decoded from the store
    straight into its place, its keys then re-rotated there to the contiguous positions (or, with
    `reposition=False`, APE, left at the positions they were computed at, right behind the prefix, so
    the chunks' positions overlap). On CUDA behind a host tier the load runs layer by layer beside
    the recompute (`layerwise`)."""
    lm = parts.primary
    cache = new_cache(lm, plan.length + options.max_new_tokens)
    computed_at = plan.prefix_len if shared else 0
    slots = [cache.slot(offset, len(ids)) for offset, ids in zip(plan.chunk_offsets, plan.chunk_ids)]
    deltas = [offset - computed_at if reposition else 0 for offset in plan.chunk_offsets]
    variant = SHARED if shared else DIRECT
    batch, dtype = parts.config.ingest_batch_size, store_dtype(parts, lm)
    stream = parts.layer_stream(lm) if isinstance(parts.store, HostTier) else None
    if stream is not None:
        loaded = load_layerwise(lm, parts.store, texts=plan.texts, token_ids=plan.chunk_ids, slots=slots, deltas=deltas,
                                variant=variant, system_prompt=plan.system_prompt, stream=stream, batch_size=batch,
                                store_dtype=dtype, bare=plan.bare or None)
        cache.wait_for_layer = stream.wait
    else:
        loaded = load_into(lm, parts.store, texts=plan.texts, token_ids=plan.chunk_ids, slots=slots, variant=variant,
                           system_prompt=plan.system_prompt, batch_size=batch, store_dtype=dtype, bare=plan.bare or None)
        rotations: dict = {}
        for (keys, _), delta in zip(slots, deltas):
            rotate_keys_(lm.model, keys, delta, rotations=rotations)  # in the compute dtype, in place
    cache.place(0, loaded.prefix.keys, loaded.prefix.values)
    # which rows came from the store, for the answer's count of reused tokens
    cache.from_store = torch.zeros(cache.capacity, dtype=torch.bool)
    cache.from_store[: plan.prefix_len] = loaded.prefix.read
    for offset, ids, read in zip(plan.chunk_offsets, plan.chunk_ids, loaded.read):
        cache.from_store[offset : offset + len(ids)] = read
    return cache

def recompute_and_answer(parts: Parts, cache: BlendedCache, plan: Plan, positions: torch.Tensor,
                         options: RequestOptions | None = None) -> torch.Tensor:
    """Recompute the chunk rows at `positions` together with the text between chunks (a client's own
    layout) and the question; next-token logits. `options.recompute_layers` (a diagnostic) writes the
    recomputed chunk rows back only in that kind of layer."""
    positions = torch.cat([positions, plan.gap_positions()]).sort().values if plan.has_gaps else positions.sort().values
    positions = torch.cat([positions, plan.question_positions()])
    ids = torch.tensor(plan.all_ids())[positions]
    which = options.recompute_layers if options is not None else "all"
    if which != "all":
        kinds = layer_types(parts.primary.model)
        if "sliding_attention" not in kinds or plan.has_gaps:
            raise ValueError(f"recompute_layers={which!r} needs a primary with sliding-window layers and the "
                             f"engine's own layout ({parts.primary.name} has {sorted(set(kinds))})")
        keep = "full_attention" if which == "sliding" else "sliding_attention"
        cache.stale_layers = frozenset(i for i, kind in enumerate(kinds) if kind == keep)
        cache.stale_before = plan.question_start
    try:
        return recompute(parts.primary.model, cache, ids, positions, kernel=parts.kernel)
    finally:
        cache.stale_layers = frozenset()

def aux_selection(parts: Parts, plan: Plan, options: RequestOptions) -> list[torch.Tensor]:
    """Per chunk, the primary tokens CacheClip recomputes: aux scores -> grouped to the budget ->
    mapped to the primary's tokens. Chunk 0 behind the shared prefix is exact already: it is not
    scored (no aux pass) and never recomputed. Separator tokens are not chunk text: they rank last."""
    aux = parts.aux
    if aux is None:
        raise ValueError("cacheclip's aux selection (requery=None or > 0) needs an aux model; set EngineConfig.aux, "
                         "or use the default selection (requery=0), which needs none")
    prefix, entries = chunk_entries(parts, aux, plan.texts, SHARED, plan.system_prompt, plan.bare or None)
    question_ids, question_rows = question_tokens(aux, plan.question, options.answer_prefix)
    skip = 1 if options.shared_prefix else 0
    forced, ratio = None, options.ratio
    if options.boundary_tokens is not None and 0.0 < options.ratio < 1.0:
        forced = boundary_selection(plan, options.boundary_tokens, skip, options.ratio)
        total = sum(len(ids) for ids in plan.chunk_ids)
        ratio = max(0.0, (math.ceil(options.ratio * total - 1e-9) - sum(int(f.sum()) for f in forced)) / total)
    with side_stream(aux.device):  # on a GPU, off the stream that loads the primary's caches
        scored = (aux_scores(aux, prefix, entries[skip:], question_ids, question_rows, model=parts.aux_scorer)
                  if len(entries) > skip else [])
    scores = [torch.full((entries[0].num_tokens,), float("-inf"))] * skip + scored
    outside = [torch.tensor([start >= len(text) for start, _ in entry.offsets], dtype=torch.bool)
               for entry, text in zip(entries, plan.texts)]
    for score, out in zip(scores, outside):
        # separators rank below every chunk token: chosen only once the budget has room for all text
        # (their cached K/V lack cross-chunk attention too, so ratio 1 still recomputes them)
        score[out & torch.isfinite(score)] = -1e30
    if options.grouping:
        chosen = grouped_to_budget(scores, ratio, parts.config.window, parts.config.threshold, options.exact_budget)
    else:
        chosen = top_k_candidates(scores, ratio)
    bare = plan.bare or (False,) * len(plan.texts)
    mapped = [map_selection(entry.offsets, c, spans, len(chunk_unit(aux, text, b)))
              for text, b, entry, c, spans in zip(plan.texts, bare, entries, chosen, plan.char_spans)]
    return mapped if forced is None else [m | f for m, f in zip(mapped, forced)]

def positions_of(plan: Plan, selected: Sequence[torch.Tensor]) -> torch.Tensor:
    """The prompt positions of the rows `selected` (per chunk, bool)."""
    parts = [offset + torch.nonzero(mask).flatten() for offset, mask in zip(plan.chunk_offsets, selected)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
