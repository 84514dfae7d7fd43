"""Moving cached keys to new positions by composing RoPE rotations.

A key stored at position a is R(a)·k (times the variant's attention scaling s). R(b) = R(b - a)·R(a),
so rotating the stored key by the unscaled rotation of (b - a) gives exactly the key at b. This holds
for every variant whose rotation is a fixed linear function of the position: default, linear,
llama3, YaRN, and dynamic at a fixed length. Each layer is rotated with its own parameters (Gemma 3
uses different bases on local and global layers).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .models import layer_types


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

    `delta` is one int or a tensor [T]. Works in float32 and returns the input dtype; only the first
    R dims rotate when the model uses partial rotary embeddings.
    """
    num_tokens = keys.shape[2]
    if isinstance(delta, int):
        if delta == 0:
            return keys
        delta = torch.full((num_tokens,), delta, dtype=torch.long, device=keys.device)
    out = torch.empty_like(keys)
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, kind in enumerate(layer_types(model)):
        if kind not in cache:
            cache[kind] = rotation(model, kind, delta.to(keys.device), torch.float32)
        cos, sin = cache[kind]  # [T, R]
        r = cos.shape[-1]
        k = keys[layer].float()  # [KV, T, D]
        rotated = k[..., :r] * cos + _rotate_half(k[..., :r]) * sin
        out[layer, ..., :r] = rotated.to(keys.dtype)
        out[layer, ..., r:] = keys[layer, ..., r:]
    return out
