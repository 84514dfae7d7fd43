"""The methods, each a prefill `(parts, plan, options) -> Prefill` over the engine's `Parts` (models, store,
config, kernel) and the same cache, mask and recompute blocks (`blend`), so their outputs are directly
comparable: `full`, `direct`, `shared_prefix`, `ape`, `cacheblend`, `cacheclip`, `oracle`."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..stages.load import blend
from ..stages.recompute.attention import ChunkScaling
from ..stages.load.blend import Parts
from ..config import RequestOptions
from ..stages.load.ingest import new_cache
from ..stages.recompute.forward import forward_at
from ..stages.request import Plan, Prefill, Trace
from ..stages.select.selection import (
    Selection,
    aux_attention,
    oracle_attention,
    question_attention,
    require_aux,
    value_deviation,
)
from .budget import budget

if TYPE_CHECKING:
    from ..stages.cache import BlendedCache


def _trace(parts: Parts, options: RequestOptions) -> Trace:
    return Trace(parts.primary.device, options.diagnostics.sync_timings)


# ---- methods: each a prefill, load -> select -> recompute ---------------------------------------


def _prefill_full(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    trace = _trace(parts, options)
    with trace.stage("recompute"):
        cache = new_cache(parts.primary, plan.length + options.max_new_tokens)
        ids = torch.tensor([plan.all_ids()])
        logits = forward_at(parts.primary.model, cache, ids, torch.arange(plan.length)[None])[0, -1]
    return Prefill(cache, logits, torch.arange(plan.prefix_len, plan.question_start), trace.timings)


def _reuse(parts: Parts, plan: Plan, options: RequestOptions, shared: bool) -> Prefill:
    trace, nothing = _trace(parts, options), torch.zeros(0, dtype=torch.long)
    with trace.stage("load"):
        cache = blend.blended_cache(parts, plan, options, shared)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, nothing)
    return Prefill(cache, logits, nothing, trace.timings)


def _prefill_direct(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    return _reuse(parts, plan, options, shared=False)


def _prefill_shared_prefix(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    return _reuse(parts, plan, options, shared=True)


def _prefill_ape(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """APE: chunks encoded in parallel behind the shared prefix (each keeps the positions it was computed
    at), the question at the position after the longest chunk, and APE's temperature and scale on the
    chunk rows for every query token, the answer's included. Nothing is recomputed."""
    if plan.has_gaps:
        raise ValueError("method 'ape' places chunks in parallel: it needs the engine's own layout, not a prompt with "
                         "text between its chunks")
    trace = _trace(parts, options)
    with trace.stage("load"):
        cache = blend.blended_cache(parts, plan, options, shared=True, reposition=False)
    with trace.stage("recompute"):
        longest = max((len(c) for c in plan.chunk_ids), default=0)
        shift = plan.question_start - (plan.prefix_len + longest)
        rows = torch.arange(cache.capacity) - shift  # question and answer rows: after the longest chunk
        rows[: plan.prefix_len] = torch.arange(plan.prefix_len)
        for offset, ids in zip(plan.chunk_offsets, plan.chunk_ids):
            rows[offset:offset + len(ids)] = torch.arange(plan.prefix_len, plan.prefix_len + len(ids))
        scaling = ChunkScaling(start=plan.prefix_len, stop=plan.question_start, temperature=options.ape_temperature,
                               scale=options.ape_scale, row_positions=rows)
        slots = plan.question_positions()
        ids = torch.tensor([list(plan.question_ids)])
        logits = forward_at(parts.primary.model, cache, ids, (slots - shift)[None], slots=slots,
                            chunk_scaling=scaling)[0, -1]
    return Prefill(cache, logits, torch.zeros(0, dtype=torch.long), trace.timings, rope_shift=shift,
                   chunk_scaling=scaling)


def _recompute(parts: Parts, plan: Plan, options: RequestOptions, *, trace: Trace, cache: BlendedCache,
               chosen: Selection) -> Prefill:
    """The chosen rows recomputed with the question over the blended cache: the prefill."""
    positions = chosen.positions(plan)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, positions, options=options)
    return Prefill(cache, logits, positions, trace.timings, extra_recomputed=chosen.early)


def _load(parts: Parts, plan: Plan, options: RequestOptions, trace: Trace) -> BlendedCache:
    with trace.stage("load"):
        return blend.blended_cache(parts, plan, options, options.diagnostics.shared_prefix)


def _load_while_aux_selects(parts: Parts, plan: Plan, options: RequestOptions, *, trace: Trace,
                            selecting: RequestOptions) -> tuple[BlendedCache, Selection]:
    """The primary's caches loaded (stage "load") while the aux selects under `selecting` in a thread
    (its own seconds go to stage "select"). An aux that is the primary itself shares its stored caches
    (the same keys): it selects after the load, so a missing chunk is computed once, by the load, and the
    request's count of reused tokens does not depend on which thread won."""
    if parts.aux is not None and parts.aux.fingerprint.digest == parts.primary.fingerprint.digest:
        cache = _load(parts, plan, options, trace)
        chosen, seconds = _timed(aux_attention, parts, plan, selecting)
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            # the aux's store reads count for this request too: the thread runs in a copy of this context
            pending = pool.submit(contextvars.copy_context().run, _timed, aux_attention, parts, plan, selecting)
            cache = _load(parts, plan, options, trace)
            chosen, seconds = pending.result()
    trace.add("select", seconds)
    return cache, chosen


def _prefill_cacheclip(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """CacheClip: load (the aux's pick overlapped) -> select -> recompute. `selection="aux"`, the paper's:
    the aux's pick is the selection. `"question"` (the default): the question's attention over the loaded
    cache picks the budget, after the aux's pick of `aux_share` of it (none at 0) was recomputed. A question
    whose subject several chunks hold, read by the primary's question probe as combining passages, gets
    `spread_ratio`'s budget (`spread_budget`); a short prompt at
    least `min_recompute_tokens` (`short_prompt_budget`)."""
    if options.selection == "aux" or options.aux_share > 0.0:
        require_aux(parts)  # a clear error before any work, whatever the budget
    trace = _trace(parts, options)
    with trace.stage("select"):
        options = budget(plan, options, parts.primary)
    if options.method == "full":  # a prompt under the floor
        prefill = _prefill_full(parts, plan, options)
        prefill.timings.select_s += trace.timings.select_s
    else:
        prefill = _prefill_cacheclip_at(parts, plan, options, trace)
    prefill.ratio = options.ratio
    return prefill


def _prefill_cacheclip_at(parts: Parts, plan: Plan, options: RequestOptions, trace: Trace) -> Prefill:
    if options.selection == "aux":
        cache, chosen = _load_while_aux_selects(parts, plan, options, trace=trace, selecting=options)
        return _recompute(parts, plan, options, trace=trace, cache=cache, chosen=chosen)
    first = None
    if options.aux_share > 0.0 and options.ratio > 0.0:
        stage_one = replace(options, ratio=options.aux_share * options.ratio, selection="aux", aux_share=0.0)
        before = trace.timings.select_s  # the spread check's
        cache, first = _load_while_aux_selects(parts, plan, options, trace=trace, selecting=stage_one)
        trace.timings.select_s = before  # the aux's stage overlaps the load; the select stage is the question's
    else:
        cache = _load(parts, plan, options, trace)
    with trace.stage("select"):
        chosen = question_attention(parts, cache, plan, options, first=first)
    return _recompute(parts, plan, options, trace=trace, cache=cache, chosen=chosen)


def _prefill_cacheblend(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """CacheBlend: load -> select by layer-1 value deviation -> recompute."""
    trace = _trace(parts, options)
    cache = _load(parts, plan, options, trace)
    with trace.stage("select"):
        chosen = value_deviation(parts, cache, plan, options)
    return _recompute(parts, plan, options, trace=trace, cache=cache, chosen=chosen)


def _prefill_oracle(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """The oracle: select by full prefill's own attention -> load -> recompute."""
    trace = _trace(parts, options)
    with trace.stage("select"):
        chosen = oracle_attention(parts, plan, options)
    cache = _load(parts, plan, options, trace)
    return _recompute(parts, plan, options, trace=trace, cache=cache, chosen=chosen)


def _timed(fn: Callable, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


PREFILLS: dict[str, Callable[[Parts, Plan, RequestOptions], Prefill]] = {
    "full": _prefill_full,
    "direct": _prefill_direct,
    "shared_prefix": _prefill_shared_prefix,
    "ape": _prefill_ape,
    "cacheblend": _prefill_cacheblend,
    "cacheclip": _prefill_cacheclip,
    "oracle": _prefill_oracle,
}
