"""The state of one request, passed explicitly between its stages: the prompt's token layout (`Plan`),
a method's prefill (`Prefill`), its stage times (`Timings`, kept by a `Trace`), and what it answered (`Answer`,
`Stream`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .select.align import beyond_text
from .recompute.attention import ChunkScaling
from .cache import BlendedCache

if TYPE_CHECKING:
    from .decode.decoder import TokenDecoder


@dataclass(frozen=True)
class Plan:
    """Token layout of one request in the primary's tokenizer:
    prefix | chunk 0 | gap 0 | chunk 1 | gap 1 | ... | question.

    Chunks come from the store (placed, re-rotated, partly recomputed); gaps are text between them that
    a client's own prompt holds (empty in the engine's own layout), computed fresh in every method,
    as the question is."""

    texts: tuple[str, ...]
    prefix_ids: tuple[int, ...]
    chunk_ids: tuple[tuple[int, ...], ...]
    char_spans: tuple[tuple[tuple[int, int], ...], ...]  # per chunk token: its characters in the chunk
    question_ids: tuple[int, ...]
    question: str
    system_prompt: object = ""  # the shared prefix: a system prompt (str) or an ingest.FormattedPrefix
    bare: tuple[bool, ...] = ()  # per chunk: stored without the chunk separator (default: with it)
    gaps: tuple[tuple[int, ...], ...] = ()  # per chunk: token ids of the text after it (default: none)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    def gap_ids(self, i: int) -> tuple[int, ...]:
        return self.gaps[i] if self.gaps else ()

    @property
    def has_gaps(self) -> bool:
        return any(self.gaps)

    @property
    def chunk_offsets(self) -> list[int]:
        offsets, at = [], self.prefix_len
        for i, ids in enumerate(self.chunk_ids):
            offsets.append(at)
            at += len(ids) + len(self.gap_ids(i))
        return offsets

    def separators(self, c: int) -> torch.Tensor:
        """Chunk c's separator tokens (bool [n_c]): those after its text; none for a chunk stored bare."""
        if self.bare and self.bare[c]:
            return torch.zeros(len(self.chunk_ids[c]), dtype=torch.bool)
        return beyond_text(self.char_spans[c], self.texts[c])

    def chunk_rows(self) -> list[tuple[int, int]]:
        """Each chunk's rows [start, stop) relative to the first chunk row (the prefix's end)."""
        return [(o - self.prefix_len, o - self.prefix_len + len(ids)) for o, ids in zip(self.chunk_offsets, self.chunk_ids)]

    @property
    def question_start(self) -> int:
        return self.prefix_len + sum(len(c) for c in self.chunk_ids) + sum(len(g) for g in self.gaps)

    @property
    def length(self) -> int:
        return self.question_start + len(self.question_ids)

    def context_ids(self) -> list[int]:
        ids = list(self.prefix_ids)
        for i, chunk in enumerate(self.chunk_ids):
            ids += [*chunk, *self.gap_ids(i)]
        return ids

    def all_ids(self) -> list[int]:
        return [*self.context_ids(), *self.question_ids]

    def question_positions(self) -> torch.Tensor:
        return torch.arange(self.question_start, self.length)

    def gap_positions(self) -> torch.Tensor:
        parts = [torch.arange(o + len(ids), o + len(ids) + len(self.gap_ids(i)))
                 for i, (o, ids) in enumerate(zip(self.chunk_offsets, self.chunk_ids))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class Timings:
    load_s: float = 0.0
    select_s: float = 0.0
    recompute_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    store: dict[str, float] = field(default_factory=dict)  # reads per tier: {tier}_hits, _misses, _s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "load_s": self.load_s, "select_s": self.select_s, "recompute_s": self.recompute_s,
            "ttft_s": self.ttft_s, "decode_tokens_per_s": self.decode_tokens_per_s, "store": dict(self.store),
        }


class Trace:
    """One prefill's seconds per stage: `with trace.stage("load"):` adds the block's time to `timings.load_s`.
    With `sync` (a request's `sync_timings` on CUDA) each boundary first waits for `device`'s queued work:
    GPU work is asynchronous, and otherwise a stage's kernels are billed to the later stage that waits."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.device, self.sync = device, sync and device.type == "cuda"
        self.timings = Timings()

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - start)

    def add(self, name: str, seconds: float) -> None:
        setattr(self.timings, f"{name}_s", getattr(self.timings, f"{name}_s") + seconds)


@dataclass
class Prefill:
    """What a method's prefill leaves for decoding."""

    cache: BlendedCache
    logits: torch.Tensor  # [V] next-token logits after the question
    recomputed_positions: torch.Tensor  # chunk positions whose K/V were recomputed
    timings: Timings
    rope_shift: int = 0  # cache row minus RoPE position for the question and answer (APE's parallel positions)
    chunk_scaling: ChunkScaling | None = None  # APE's attention on the chunk rows, kept while decoding
    reused_tokens: int = 0  # prompt tokens whose K/V were read from the store and kept as read
    extra_recomputed: int = 0  # rows recomputed before, then again among recomputed_positions (two-stage selection)
    ratio: float | None = None  # the ratio the method ran at, where it chose one (cacheclip's spread budget)

    @property
    def recomputed_rows(self) -> int:
        """Chunk rows run through the model: the recomputed positions, and those run twice."""
        return int(self.recomputed_positions.numel()) + self.extra_recomputed


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    method: str
    ratio: float
    prompt_tokens: int
    recomputed_tokens: int
    first_logits: torch.Tensor
    timings: Timings
    reused_tokens: int = 0  # prompt tokens served from stored caches (not recomputed, not computed on a miss)

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed_tokens / max(1, self.prompt_tokens)


@dataclass
class Stream:
    """Iterate for text pieces; `answer` is set once the iteration ends."""

    pieces: Iterator[str]
    answer: Answer | None = None
    token_ids: list[int] = field(default_factory=list)  # filled as tokens decode, also when iteration stops early
    decoder: TokenDecoder | None = None  # the engine's token decoder behind `pieces` (a server batches its forwards)

    def __iter__(self) -> Iterator[str]:
        return self.pieces
