"""What both framework adapters share: the metadata key, answer metadata, and async iteration."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.engine.core import Answer
from cacheclip_rag.models.openmp_pools import to_thread_releasing

KV_KEY = "cacheclip_kv_key"  # metadata field holding the chunk's KV store key (hex); excluded from LLM/embedding text

_DONE = object()


async def aiter_in_thread(pieces: Iterator[str]) -> AsyncIterator[str]:
    """Drive a blocking iterator from asyncio's executor threads, yielding each item as soon as it is ready.
    Each step's thread gives its OpenMP pool back: pools left in several executor threads would slow every
    later step by 15-20% (`cacheclip_rag.models.openmp_pools`)."""
    while True:
        piece = await to_thread_releasing(next, pieces, _DONE)
        if piece is _DONE:
            return
        yield piece  # type: ignore[misc]


def answer_metadata(answer: Answer, options: RequestOptions) -> dict:
    return {
        "method": options.method, "ratio": options.ratio, "prompt_tokens": answer.prompt_tokens,
        "recomputed_tokens": answer.recomputed_tokens, "timings": answer.timings.as_dict(),
    }
