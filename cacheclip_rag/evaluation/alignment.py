"""Does a small model attend where a large one does? (paper section 3.3, Tables 2-3, Figure 3)

Each model reads the same prompt (shared prefix, chunks, question) under full prefill; the last
token's attention at a chosen layer, averaged over heads, is spread over the characters of the
chunk texts through each tokenizer's offsets (a token's weight split evenly over the characters
it owns), so models with different tokenizers are compared character by character.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..stages.select.align import tiled_spans
from ..stages.recompute.attention import AttentionProbe, use_cacheclip_attention
from ..stages.load.ingest import chunk_unit, new_cache
from ..models.loading import LoadedModel
from ..stages.recompute.forward import forward_at


def char_attention(
    lm: LoadedModel, system_prompt: str, texts: Sequence[str], question: str, *, layers: Sequence[int]
) -> dict[int, torch.Tensor]:
    """Per layer, the last prompt token's attention over the characters of `texts` joined: [sum len(text)]."""
    use_cacheclip_attention(lm.model)
    prefix_ids = lm.encode_prefix(lm.prompt.prefix(system_prompt))
    units = [chunk_unit(lm, t) for t in texts]
    encoded = [lm.encode_with_offsets(u) for u in units]
    context = [*prefix_ids, *(i for ids, _ in encoded for i in ids)]
    question_ids = lm.encode(lm.prompt.question(question))
    s, q = len(context), len(question_ids)
    cache = new_cache(lm, s + q)
    forward_at(lm.model, cache, torch.tensor([context]), torch.arange(s)[None])
    probes = {layer: AttentionProbe() for layer in layers}
    forward_at(lm.model, cache, torch.tensor([question_ids]), torch.arange(s, s + q)[None], probes=probes)
    result = {}
    for layer, probe in probes.items():
        row = probe.weights[0, :, -1, :s].float().mean(0).cpu()  # [S] last token, heads averaged
        parts, at = [], len(prefix_ids)
        for text, unit, (ids, offsets) in zip(texts, units, encoded):
            parts.append(_spread(row[at : at + len(ids)], offsets, len(unit))[: len(text)])
            at += len(ids)
        result[layer] = torch.cat(parts)
    return result


def _spread(token_scores: torch.Tensor, offsets: Sequence[tuple[int, int]], length: int) -> torch.Tensor:
    """Token scores [T] -> character scores [length], each token's score split over its characters."""
    chars = torch.zeros(length)
    if token_scores.numel() == 0:
        return chars
    spans = tiled_spans(offsets, length).clamp(max=length)
    widths = (spans[:, 1] - spans[:, 0]).clamp(min=0)
    spread = torch.repeat_interleave(token_scores / widths.clamp(min=1), widths)
    start = int(spans[0, 0])
    chars[start : start + spread.numel()] = spread[: length - start]
    return chars


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank), for Spearman."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    return ((ends - (counts.double() - 1) / 2))[inverse]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denom = a.norm() * b.norm()
    return float((a @ b) / denom) if denom > 0 else 0.0


def compare(reference: torch.Tensor, other: torch.Tensor, top: float = 0.2) -> dict[str, float]:
    """Agreement of two character-attention maps: Jaccard of their top-`top` characters, KL(ref || other)
    of the normalised maps, Pearson and Spearman correlation."""
    if reference.shape != other.shape:
        raise ValueError(f"maps cover different texts: {tuple(reference.shape)} vs {tuple(other.shape)}")
    k = max(1, int(round(top * reference.numel())))
    a = set(torch.topk(reference, k).indices.tolist())
    b = set(torch.topk(other, k).indices.tolist())
    eps = 1e-12
    p = reference.double().clamp(min=0) + eps
    q = other.double().clamp(min=0) + eps
    p, q = p / p.sum(), q / q.sum()
    return {
        "jaccard": len(a & b) / len(a | b),
        "kl": float((p * (p / q).log()).sum()),
        "pearson": _pearson(reference, other),
        "spearman": _pearson(_ranks(reference), _ranks(other)),
    }
