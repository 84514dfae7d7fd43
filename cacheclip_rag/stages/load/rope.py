"""Moving cached keys to new positions by composing RoPE rotations.

A key stored at position a is R(a)·k (times the variant's attention scaling s). R(b) = R(b - a)·R(a),
so rotating the stored key by the unscaled rotation of (b - a) gives exactly the key at b. This holds
for every variant whose rotation is a fixed linear function of the position: default, linear,
llama3, YaRN, and dynamic at a fixed length. Each layer is rotated with its own parameters (Gemma 3
uses different bases on local and global layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ...models.loading import layer_types


def _rotary_module(model: PreTrainedModel) -> torch.nn.Module:
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise NotImplementedError(f"{type(model).__name__} has no rotary embedding module; RoPE re-rotation needs one")
    return rotary


def rotation(
    model: PreTrainedModel, layer_type: str, delta: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] of the rotation by `delta` [T] positions, without the variant's scaling."""
    rotary = _rotary_module(model)
    probe = torch.zeros(1, dtype=torch.float32, device=delta.device)
    positions = delta.to(torch.float32)[None]  # [1, T]
    if hasattr(rotary, f"{layer_type}_inv_freq"):
        cos, sin = rotary(probe, positions, layer_type)
        scale = getattr(rotary, f"{layer_type}_attention_scaling")
    else:
        cos, sin = rotary(probe, positions)
        scale = getattr(rotary, "attention_scaling", 1.0)
    return (cos[0] / scale).to(dtype), (sin[0] / scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(model: PreTrainedModel, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
    """Keys [L, KV, T, D] cached at positions p, returned at positions p + delta.

    `delta` is one int or a tensor [T]. All layers of one RoPE type rotate in one batched op (a
    handful of launches per chunk, not several per layer), in float32, returning the input dtype;
    only the first R dims rotate when the model uses partial rotary embeddings.
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    return rotate_keys_(model, keys.clone(), delta)  # the unrotated tail dims (partial rotary) come along


def rotate_keys_(model: PreTrainedModel, keys: torch.Tensor, delta: int | torch.Tensor,
                 layers: Sequence[int] | None = None, rotations: dict | None = None) -> torch.Tensor:
    """`rotate_keys` in place, on any view (a chunk's slot of the blended cache); `layers` limits it to
    those layers (layer-wise loading rotates each layer as it arrives), and `rotations` (a dict the
    caller keeps) reuses each (layer type, delta)'s cos and sin across calls. Returns `keys`."""
    num_tokens = keys.shape[2]
    memo_key = None
    if isinstance(delta, int):
        if delta == 0:
            return keys
        memo_key = (delta, num_tokens)
        delta = torch.full((num_tokens,), delta, dtype=torch.long, device=keys.device)
    kinds = layer_types(model)
    if len(kinds) != keys.shape[0]:
        raise ValueError(f"keys for {keys.shape[0]} layers given to a model of {len(kinds)} layers")
    wanted = set(range(len(kinds)) if layers is None else layers)
    out = keys
    for kind in dict.fromkeys(kinds):
        index = [layer for layer, k in enumerate(kinds) if k == kind and layer in wanted]
        if not index:
            continue
        if rotations is not None and memo_key is not None and (kind, memo_key) in rotations:
            cos, sin = rotations[(kind, memo_key)]
        else:
            cos, sin = rotation(model, kind, delta.to(keys.device), torch.float32)  # [T, R]
            if rotations is not None and memo_key is not None:
                rotations[(kind, memo_key)] = (cos, sin)
        r = cos.shape[-1]
        chosen = slice(index[0], index[-1] + 1) if index == list(range(index[0], index[-1] + 1)) else index
        k = keys[chosen, ..., :r].float()  # [Lk, KV, T, R]
        out[chosen, ..., :r] = (k * cos + _rotate_half(k) * sin).to(keys.dtype)
    return out
