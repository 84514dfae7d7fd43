"""How many chunk rows the cacheclip method recomputes for a request: the ratio asked, raised for a question
whose subject several chunks hold (`spread_budget`), and a floor for short prompts (`short_prompt_budget`),
below which the request runs as `full`."""

from __future__ import annotations

from dataclasses import replace

from ..config import RequestOptions
from ..stages.request import Plan
from .spread import answer_spread


def budget(plan: Plan, options: RequestOptions) -> RequestOptions:
    """The request's options at the ratio it runs at (method `full` under the short-prompt floor)."""
    return short_prompt_budget(plan, spread_budget(plan, options))


def spread_budget(plan: Plan, options: RequestOptions) -> RequestOptions:
    """`options` at `spread_ratio` when that is more than the ratio and the question's subject is in two
    chunks or more (`spread.answer_spread`); ratio 0 (reuse alone) and ratio 1 are left as asked."""
    if options.spread_ratio is None or not 0.0 < options.ratio < options.spread_ratio:
        return options
    if not answer_spread(plan.question, plan.texts).spread:
        return options
    return replace(options, ratio=options.spread_ratio)


def short_prompt_budget(plan: Plan, options: RequestOptions) -> RequestOptions:
    """`options` with a ratio that recomputes at least `min_recompute_tokens` chunk rows; a prompt with fewer
    chunk tokens runs as `full` (ratio 1: its answer, by the shortest path: nothing loaded, no mask); ratio 0
    (reuse alone) is left as asked. Below a few hundred chunk tokens reuse saves a fraction of a second at
    most, and there the reused caches lost answers (the README's two-chunk example answered with the other
    chunk's year). Served, recomputing every row over the loaded caches took longer than `full` itself
    (median 0.93 s against 0.57 s on 79-156-token prompts, bench/RESULTS.md)."""
    total = sum(len(ids) for ids in plan.chunk_ids)
    if options.ratio <= 0.0 or total == 0 or options.min_recompute_tokens <= options.ratio * total:
        return options
    if options.min_recompute_tokens >= total:
        return replace(options, method="full", ratio=1.0)
    return replace(options, ratio=options.min_recompute_tokens / total)
