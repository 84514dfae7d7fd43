"""Token-by-token decoding over a blended cache: greedy or sampled, stop ids, stop strings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .attention import ChunkScaling
from .cache import BlendedCache
from .models import LoadedModel
from .recompute import forward_at


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


def decode_tokens(
    lm: LoadedModel,
    cache: BlendedCache,
    first_logits: torch.Tensor,
    position: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    rope_shift: int = 0,
    chunk_scaling: ChunkScaling | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids; the first comes from `first_logits`, the next token is
    written at `position`, `position + 1`, ... (cache rows; its RoPE position is the row minus
    `rope_shift`, for APE's parallel positions). Stops after an end-of-sequence id."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    logits = first_logits
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        yield token
        if token in lm.eos_token_ids or step == max_new_tokens - 1:
            return
        row = position + step
        logits = forward_at(lm.model, cache, torch.tensor([[token]]), torch.tensor([[row - rope_shift]]),
                            slots=torch.tensor([row]), chunk_scaling=chunk_scaling)[0, -1]


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
