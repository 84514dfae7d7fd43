"""Shared pieces of the benchmarks: prompts of a given size from the bundled handbook, medians, the rows a
recompute forward runs, a prefill with chosen rows added to the default selection's."""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable

import torch

from cacheclip_rag.cli import demo_chunks
from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.models.loading import LoadedModel
from cacheclip_rag.stages.cache import BlendedCache
from cacheclip_rag.stages.load import blend
from cacheclip_rag.stages.request import Plan, Prefill, Timings
from cacheclip_rag.stages.select.selection import question_attention, question_scores
from cacheclip_rag.store import LMDBStore

QUESTIONS = (
    "How many pistons support the Halvorsen mirror?",
    "What is the name of the archive server that releases the data?",
    "In which year did the Lantern programme announce its first confirmed planet?",
    "Who is the present director of the observatory?",
    "How far away is the nearest hospital?",
)


def handbook_chunks(num_chunks: int, sections_per_chunk: int) -> list[str]:
    """Distinct chunks of several handbook sections each (rotated orders), ~180 tokens a section."""
    sections = demo_chunks()
    chunks = []
    for i in range(num_chunks):
        picked = [sections[(i + j * (i + 1)) % len(sections)] for j in range(sections_per_chunk)]
        chunks.append(f"Part {i + 1}.\n" + "\n\n".join(picked))
    return chunks


def engine_with(primary: LoadedModel, aux: LoadedModel | None) -> Engine:
    path = tempfile.mkdtemp(prefix="cacheclip-bench-")
    return Engine(primary=primary, store=LMDBStore(path), config=EngineConfig(store_path=path), aux=aux)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


QUESTION_ROWS = 24


def recompute_rows(length: int, generator: torch.Generator, ratio: float = 0.2) -> torch.Tensor:
    """The rows CacheClip's recompute forward runs over a `length`-token prompt: `ratio` of the chunk rows at
    scattered positions (sorted), then the question's last QUESTION_ROWS."""
    chunk_rows = length - QUESTION_ROWS
    picked = torch.randperm(chunk_rows, generator=generator)[: int(ratio * chunk_rows)].sort().values
    return torch.cat([picked, torch.arange(chunk_rows, length)])


def chunk_shares(engine: Engine, plan: Plan, options: RequestOptions) -> list[float]:
    """The question's attention share of each chunk over the reused cache (the default selection's own scoring
    pass over a fresh blended cache, summed per chunk)."""
    scores = question_scores(engine.parts, blend.blended_cache(engine.parts, plan, options, shared=True), plan, options)
    return [float(scores[a:b].sum()) for a, b in plan.chunk_rows()]


def prefill_with_rows(engine: Engine, plan: Plan, options: RequestOptions, extra: list[torch.Tensor] | None,
                      before: Callable[[BlendedCache], None] | None = None) -> Prefill:
    """The default selection at `options.ratio` over a fresh blended cache, plus `extra` rows (per chunk, bool):
    the prefill the diagnosis conditions decode from. `before` changes the loaded cache first."""
    parts = engine.parts
    cache = blend.blended_cache(parts, plan, options, shared=True)
    if before is not None:
        before(cache)
    chosen = question_attention(parts, cache, plan, options)
    rows = list(chosen.rows) if extra is None else [a | b for a, b in zip(chosen.rows, extra)]
    positions = blend.positions_of(plan, rows)
    logits = blend.recompute_and_answer(parts, cache, plan, positions, options=options)
    return Prefill(cache, logits, positions, Timings())
