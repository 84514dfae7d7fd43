"""What the ridge map works on: each text's KV from both models, keys stripped of RoPE, tokens aligned
by characters, features of the chosen source layers stacked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..stages.select.align import tiled_spans
from ..stages.recompute.attention import use_cacheclip_attention
from ..stages.load.ingest import new_cache
from ..models.loading import LoadedModel
from ..stages.recompute.forward import forward_at
from ..stages.load.rope import rotate_keys

# ---- features --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVText:
    """One model's cache of a text: keys with RoPE stripped and values, [L, T, KV*D], and char spans."""

    keys: torch.Tensor
    values: torch.Tensor
    offsets: tuple[tuple[int, int], ...]
    text_length: int


def prefill_kv(lm: LoadedModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, KV, T, D] of a plain prefill of `ids` at positions 0..T-1."""
    use_cacheclip_attention(lm.model)
    cache = new_cache(lm, len(ids))
    forward_at(lm.model, cache, torch.tensor([list(ids)]), torch.arange(len(ids))[None])
    return cache.rows(0, len(ids))


def flat(kv: torch.Tensor) -> torch.Tensor:
    """[L, KV, T, D] -> [L, T, KV*D] float32."""
    layers, heads, tokens, dim = kv.shape
    return kv.float().permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)


def unflat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, T, KV*D] -> [L, KV, T, D]."""
    layers, tokens, width = x.shape
    return x.reshape(layers, tokens, heads, width // heads).permute(0, 2, 1, 3).contiguous()


def strip_rope(lm: LoadedModel, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [L, KV, T, D] cached at `positions` [T], rotated back to position 0."""
    return rotate_keys(lm.model, keys, -positions)


def apply_rope(lm: LoadedModel, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Position-free keys [L, KV, T, D] rotated to `positions` [T]."""
    return rotate_keys(lm.model, keys, positions)


def text_kv(lm: LoadedModel, text: str) -> KVText:
    """Prefill BOS (if the model uses one) + text; the text's rows, keys RoPE-stripped."""
    ids, offsets = lm.encode_with_offsets(text)
    prefix = lm.encode_prefix("")
    keys, values = prefill_kv(lm, [*prefix, *ids])
    start = len(prefix)
    positions = torch.arange(start, start + len(ids))
    keys = strip_rope(lm, keys[:, :, start:], positions)
    return KVText(flat(keys), flat(values[:, :, start:]), tuple(offsets), len(text))


def align(source_offsets: Sequence[tuple[int, int]], target_offsets: Sequence[tuple[int, int]],
          text_length: int) -> torch.Tensor:
    """For each target token, the index of the source token holding its last character: [T_target]."""
    if list(source_offsets) == list(target_offsets):
        return torch.arange(len(target_offsets))
    source = tiled_spans(source_offsets, text_length)
    target = tiled_spans(target_offsets, text_length)
    last_char = target[:, 1] - 1
    index = torch.searchsorted(source[:, 0].contiguous(), last_char, right=True) - 1
    return index.clamp(0, len(source_offsets) - 1)


def stacked(features: torch.Tensor, chosen: Sequence[int]) -> torch.Tensor:
    """The chosen layers' features [L, T, F] side by side: [T, len(chosen)*F]."""
    return torch.cat([features[s] for s in chosen], dim=-1)


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], dim=-1)
