"""How many chunk rows the cacheclip method recomputes for a request: the ratio asked, raised for a question
whose subject several chunks hold and whose answer the primary reads as drawn from several passages
(`spread_budget`), and a floor for short prompts (`short_prompt_budget`), below which the request runs as `full`."""

from __future__ import annotations

from dataclasses import replace

from ..config import RequestOptions
from ..models.loading import LoadedModel
from ..stages.request import Plan
from ..stages.select.question_kind import probe_for
from .spread import answer_spread


def budget(plan: Plan, options: RequestOptions, primary: LoadedModel | None = None) -> RequestOptions:
    """The request's options at the ratio it runs at (method `full` under the short-prompt floor)."""
    return short_prompt_budget(plan, spread_budget(plan, options, primary))


def spread_budget(plan: Plan, options: RequestOptions, primary: LoadedModel | None = None) -> RequestOptions:
    """`options` at `spread_ratio` when that is more than the ratio, the question's subject is in two chunks
    or more (`spread.answer_spread`) and, where `primary` has a shipped question probe, the probe reads the
    answer as drawn from several passages (`question_kind`; `Diagnostics.question_probe=False`: the words
    alone). Ratio 0 (reuse alone) and ratio 1 are left as asked. The words run first: the probe's forward
    (~0.1-0.4 s on 2 CPU cores) is paid only by the requests they flag."""
    if options.spread_ratio is None or not 0.0 < options.ratio < options.spread_ratio:
        return options
    if not answer_spread(plan.question, plan.texts).spread:
        return options
    probe = probe_for(primary) if primary is not None and options.diagnostics.question_probe else None
    if probe is not None and not probe.several(primary, plan.question):
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
