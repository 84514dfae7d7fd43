"""The blocks every method is built from, over the engine's parts (`Parts`: its models, store, config and
kernel): the blended cache (one prefix, each chunk's stored rows at its place in the prompt), the
recompute of chosen rows with the question, and where rows sit. The methods (`methods`) and the
selectors (`selection`) use these; the engine (`engine`) holds the parts and runs the methods."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..recompute.attention import SelectedRowsKernel
from ..cache import BlendedCache
from ...config import EngineConfig, RequestOptions
from .ingest import (
    DIRECT,
    SHARED,
    PrefixCache,
    fetch_or_compute,
    load_into,
    new_cache,
    storage_dtype,
)
from .layerwise import LayerStream, load_layerwise
from ...models.loading import LoadedModel, layer_types
from ..recompute.forward import recompute
from ..request import Plan
from .rope import rotate_keys_
from ...store import ChunkEntry, KVStore


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


def chunk_entries(parts: Parts, lm: LoadedModel, texts: Sequence[str], *, variant: str, system_prompt: object = None,
                  bare: Sequence[bool] | None = None) -> tuple[PrefixCache, list[ChunkEntry]]:
    """Stored entries for `texts` behind `system_prompt` (default the engine's; or a FormattedPrefix);
    a miss is computed, stored and used."""
    return fetch_or_compute(lm, parts.store, texts, variant=variant, system_prompt=system_prompt or parts.config.system_prompt,
                            batch_size=parts.config.ingest_batch_size, store_dtype=store_dtype(parts, lm), bare=bare)


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
    # layer by layer where the store keeps entries in host memory (a host tier, or a tenant's view of one)
    stream = parts.layer_stream(lm) if getattr(parts.store, "layerwise", False) else None
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


def recompute_and_answer(parts: Parts, cache: BlendedCache, plan: Plan, positions: torch.Tensor, *,
                         options: RequestOptions | None = None) -> torch.Tensor:
    """Recompute the chunk rows at `positions` together with the text between chunks (a client's own
    layout) and the question; next-token logits. `recompute_layers` (a diagnostic) writes the
    recomputed chunk rows back only in that kind of layer."""
    positions = torch.cat([positions, plan.gap_positions()]).sort().values if plan.has_gaps else positions.sort().values
    positions = torch.cat([positions, plan.question_positions()])
    ids = torch.tensor(plan.all_ids())[positions]
    which = options.diagnostics.recompute_layers if options is not None else "all"
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


def positions_of(plan: Plan, selected: Sequence[torch.Tensor]) -> torch.Tensor:
    """The prompt positions of the rows `selected` (per chunk, bool)."""
    parts = [offset + torch.nonzero(mask).flatten() for offset, mask in zip(plan.chunk_offsets, selected)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
