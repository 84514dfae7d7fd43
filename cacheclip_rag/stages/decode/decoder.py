"""Token-by-token decoding over a blended cache: greedy or sampled, stop ids, stop strings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..recompute.attention import ChunkScaling
from .batching import RowsRequest
from ..cache import BlendedCache
from .step import decode_step, supports
from ...models.loading import LoadedModel
from ..recompute.forward import forward_at


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0; else nucleus sampling. logits: [V]."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class TokenDecoder(Iterator[int]):
    """Up to `max_new_tokens` ids, one per `next`; the first comes from `first_logits`, the next token is
    written at `position`, `position + 1`, ... (cache rows; its RoPE position is the row minus
    `rope_shift`, for APE's parallel positions). Stops after an end-of-sequence id.

    Each `next` runs the forward of the token before it, unless a batch ran it already: `pending()` is
    that forward (a `batching.RowsRequest`), and `provide(logits)` hands its result in, so the server can
    run several requests' next forwards as one batch (`batching.forward_rows`).
    """

    def __init__(self, lm: LoadedModel, cache: BlendedCache, first_logits: torch.Tensor, position: int, *,
                 max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 rope_shift: int = 0, chunk_scaling: ChunkScaling | None = None):
        self.lm, self.cache, self.position, self.max_new_tokens = lm, cache, position, max_new_tokens
        self.temperature, self.top_p, self.rope_shift, self.chunk_scaling = temperature, top_p, rope_shift, chunk_scaling
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._logits: torch.Tensor | None = first_logits
        self._steps = 0  # tokens sampled so far
        self._last = -1  # the last token sampled
        self.finished = max_new_tokens <= 0
        # a plain step (no APE shift or scaling) of a model `decode_step` covers skips transformers' forward
        self.lean = rope_shift == 0 and chunk_scaling is None and supports(lm.model, cache)

    @property
    def batchable(self) -> bool:
        """Whether its forwards can join a batch (APE's chunk scaling runs alone)."""
        return self.chunk_scaling is None

    @property
    def _waiting(self) -> bool:
        """Whether the next token needs a forward that has not run."""
        return not self.finished and self._logits is None

    @property
    def _row(self) -> int:
        """The cache row the next forward writes: the last sampled token's."""
        return self.position + self._steps - 1

    def pending(self) -> RowsRequest | None:
        """The forward the next token needs; None when its logits are at hand or decoding is over."""
        if not self._waiting:
            return None
        row = self._row
        return RowsRequest(self.cache, torch.tensor([self._last]), torch.tensor([row - self.rope_shift]),
                           slots=torch.tensor([row]))

    def provide(self, logits: torch.Tensor) -> None:
        """The logits [V] of `pending()`'s forward, run elsewhere (in a batch)."""
        if not self._waiting:
            raise RuntimeError("no forward is pending: logits were already provided, or decoding is over")
        self._logits = logits

    def __iter__(self) -> TokenDecoder:
        return self

    def __next__(self) -> int:
        if self.finished:
            raise StopIteration
        if self._logits is None and self.lean:
            self._logits = decode_step(self.lm.model, self.cache, self._last, self._row)
        elif self._logits is None:
            step = self.pending()
            self._logits = forward_at(self.lm.model, self.cache, step.input_ids[None], step.positions[None],
                                      slots=step.slots, chunk_scaling=self.chunk_scaling)[0, -1]
        token = sample(self._logits, self.temperature, self.top_p, self.generator)
        self._logits, self._last = None, token
        self._steps += 1
        self.finished = token in self.lm.eos_token_ids or self._steps == self.max_new_tokens
        return token


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could be the start of a stop string."""
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    return hold


def text_deltas(lm: LoadedModel, tokens: Iterator[int], stops: Sequence[str], generated: list[int]) -> Iterator[str]:
    """Turn a token stream into text pieces, ending at the first stop string (not emitted).

    Appends each consumed token id to `generated`.
    """
    emitted = ""
    for token in tokens:
        generated.append(token)
        text = lm.tokenizer.decode(generated, skip_special_tokens=True)
        # a stop string counts only after the answer's first visible character: an answer that opens
        # with a newline is not an empty answer
        lead = len(text) - len(text.lstrip())
        cut = min((i for s in stops if s and (i := text.find(s, lead)) >= 0), default=-1) if lead < len(text) else -1
        if cut >= 0:
            if cut > len(emitted):
                yield text[len(emitted) : cut]
            return
        safe = len(text) - _held_back(text, stops)
        if safe > len(emitted) and not text[:safe].endswith("\ufffd"):
            yield text[len(emitted) : safe]
            emitted = text[:safe]
    text = lm.tokenizer.decode(generated, skip_special_tokens=True)
    if len(text) > len(emitted):
        yield text[len(emitted) :]
