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

from . import blend
from .attention import ChunkScaling
from .blend import Parts
from .config import RequestOptions
from .group import grouped_to_budget
from .ingest import new_cache
from .recompute import forward_at
from .request import Plan, Prefill, Trace
from .requery import requery_positions
from .select import primary_attention_scores, top_k_candidates, value_deviation_scores

if TYPE_CHECKING:
    from .cache import BlendedCache


def _trace(parts: Parts, options: RequestOptions) -> Trace:
    return Trace(parts.primary.device, options.sync_timings)


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
        scaling = ChunkScaling(plan.prefix_len, plan.question_start, options.ape_temperature, options.ape_scale, rows)
        slots = plan.question_positions()
        ids = torch.tensor([list(plan.question_ids)])
        logits = forward_at(parts.primary.model, cache, ids, (slots - shift)[None], slots=slots,
                            chunk_scaling=scaling)[0, -1]
    return Prefill(cache, logits, torch.zeros(0, dtype=torch.long), trace.timings, rope_shift=shift,
                   chunk_scaling=scaling)


def _load_while_selecting(parts: Parts, plan: Plan, options: RequestOptions, trace: Trace,
                          selecting: RequestOptions) -> tuple[BlendedCache, list[torch.Tensor]]:
    """The primary's caches loaded (stage "load") while the aux selects under `selecting` in a thread
    (its own seconds go to stage "select"). An aux that is the primary itself shares its stored caches
    (the same keys): it selects after the load, so a missing chunk is computed once, by the load, and the
    request's count of reused tokens does not depend on which thread won."""
    if parts.aux is not None and parts.aux.fingerprint.digest == parts.primary.fingerprint.digest:
        with trace.stage("load"):
            cache = blend.blended_cache(parts, plan, options, options.shared_prefix)
        selected, seconds = _timed(blend.aux_selection, parts, plan, selecting)
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            # the aux's store reads count for this request too: the thread runs in a copy of this context
            pending = pool.submit(contextvars.copy_context().run, _timed, blend.aux_selection, parts, plan, selecting)
            with trace.stage("load"):
                cache = blend.blended_cache(parts, plan, options, options.shared_prefix)
            selected, seconds = pending.result()
    trace.add("select", seconds)
    return cache, selected


def _prefill_cacheclip(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """The paper's: the aux selects in a thread while the primary's caches load; then the recompute. With
    `requery` (the default, 0): the question's own attention selects (`_prefill_requery`)."""
    if options.requery is not None:
        return _prefill_requery(parts, plan, options)
    trace = _trace(parts, options)
    cache, selected = _load_while_selecting(parts, plan, options, trace, options)
    positions = blend.positions_of(plan, selected)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, positions, options)
    return Prefill(cache, logits, positions, trace.timings)


def _prefill_requery(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    """CacheClip with the query-driven second stage (`requery`): the aux's share of the budget selected while
    the caches load (none at share 0), then the two stages, then the final recompute."""
    trace = _trace(parts, options)
    share = float(options.requery or 0.0)
    if share > 0.0 and options.ratio > 0.0:
        stage_one = replace(options, ratio=share * options.ratio, requery=None)
        cache, first = _load_while_selecting(parts, plan, options, trace, stage_one)
        trace.timings.select_s = 0.0  # the aux's stage overlaps the load; the select stage is the question's
    else:
        with trace.stage("load"):
            cache = blend.blended_cache(parts, plan, options, options.shared_prefix)
        first = [torch.zeros(len(ids), dtype=torch.bool) for ids in plan.chunk_ids]
    with trace.stage("select"):
        positions, early = requery_positions(parts, cache, plan, options, first)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, positions, options)
    return Prefill(cache, logits, positions, trace.timings, extra_recomputed=early)


def _prefill_cacheblend(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    trace = _trace(parts, options)
    with trace.stage("load"):
        cache = blend.blended_cache(parts, plan, options, options.shared_prefix)
    with trace.stage("select"):
        chunk_ids = torch.tensor(plan.all_ids()[plan.prefix_len : plan.question_start])
        deviation = value_deviation_scores(parts.primary, cache, chunk_ids, plan.prefix_len, kernel=parts.kernel)
        candidates = top_k_candidates([deviation[a:b] for a, b in plan.chunk_rows()], options.ratio)
    positions = blend.positions_of(plan, candidates)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, positions, options)
    return Prefill(cache, logits, positions, trace.timings)


def _prefill_oracle(parts: Parts, plan: Plan, options: RequestOptions) -> Prefill:
    trace = _trace(parts, options)
    with trace.stage("select"):
        scores = primary_attention_scores(parts.primary, plan.context_ids(), plan.question_ids, plan.prefix_len)
        per_chunk = [scores[a:b] for a, b in plan.chunk_rows()]
        if options.grouping:
            candidates = grouped_to_budget(per_chunk, options.ratio, parts.config.window,
                                           parts.config.threshold, options.exact_budget)
        else:
            candidates = top_k_candidates(per_chunk, options.ratio)
    with trace.stage("load"):
        cache = blend.blended_cache(parts, plan, options, options.shared_prefix)
    positions = blend.positions_of(plan, candidates)
    with trace.stage("recompute"):
        logits = blend.recompute_and_answer(parts, cache, plan, positions, options)
    return Prefill(cache, logits, positions, trace.timings)


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
