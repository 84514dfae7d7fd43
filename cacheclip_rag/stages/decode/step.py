"""One decode step of a Llama-family model, run layer by layer without transformers' module machinery.

A decode step over the blended cache does little arithmetic a layer (one row through seven linears and
one attention row), so on a CPU the time around the arithmetic counts: transformers' forward adds, per
step, mask preparation, output capturing, keyword plumbing and a wrapper call per layer and attention
(~6,300 aten calls a step for a 24-layer model). `decode_step` runs the same modules' weights through
the same ops in the same order — embeddings, the rotary module once, then per layer the norm modules, the
projection modules, RoPE, the cache write, `attention.dense_attention`, the MLP module — so its logits
and the cache rows it writes are bit-identical to `recompute.forward_at`'s (tests/test_decode_step.py).

`decode_steps` runs several requests' steps together (each over its own cache), as the server batches
them, equal to `batching.forward_rows`'s packed forward. It covers what a plain decode step is: a Llama or
Qwen2 decoder whose layers all attend fully, one token on the cache's next row at its own position, a
cache of batch one, no diagnostic stale layers. Anything
else (Gemma 3's windows and norms, APE's shifted positions and chunk scaling) goes through `forward_at`;
`supports` says which.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..recompute.attention import dense_attention
from ..cache import BlendedCache
from ...models.loading import layer_types

LEAN_MODEL_TYPES = frozenset({"llama", "qwen2"})


def supports(model: PreTrainedModel, cache: BlendedCache) -> bool:
    """Whether `decode_step` runs this model over this cache exactly as `forward_at` would."""
    config = model.config
    return (config.model_type in LEAN_MODEL_TYPES and not model.training
            and all(kind == "full_attention" for kind in layer_types(model))
            and cache.layers[0].keys.shape[0] == 1 and not cache.stale_layers
            and len(cache.layers) == config.num_hidden_layers)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def decode_steps(model: PreTrainedModel, caches: list[BlendedCache], tokens: list[int], rows: list[int]) -> torch.Tensor:
    """Logits [B, V] after request b's `tokens[b]`, run at position `rows[b]` and written to row `rows[b]` of
    its own `caches[b]`, where it sees every row before it (the cache's visible length becomes
    `rows[b] + 1`). The B rows go through each linear as one matrix, as `batching.forward_rows` packs
    them; each attends over its own cache. Check `supports(model, cache)` for each cache first."""
    base, batch = model.model, len(caches)
    device = caches[0].layers[0].keys.device
    for cache, row in zip(caches, rows):
        cache.write_at(torch.tensor([row]))
    hidden = base.embed_tokens(torch.tensor([tokens], device=device))  # [1, B, H]
    cos, sin = base.rotary_emb(hidden, torch.tensor([rows], device=device))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for index, layer in enumerate(base.layers):
        for cache in caches:
            if cache.wait_for_layer is not None:  # its rows may still be arriving (layer-wise loading)
                cache.wait_for_layer(index)
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(1, batch, -1, attn.head_dim).transpose(1, 2)  # [1, heads, B, D]
        key = attn.k_proj(x).view(1, batch, -1, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(x).view(1, batch, -1, attn.head_dim).transpose(1, 2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        outs = []
        for b, (cache, row) in enumerate(zip(caches, rows)):
            own = cache.layers[index]
            own.keys[:, :, row] = key[:, :, b]  # the copy casts to the cache's dtype, as `PositionedLayer.update`
            own.values[:, :, row] = value[:, :, b]
            outs.append(dense_attention(attn, query[:, :, b:b + 1], own.keys[:, :, :row + 1],
                                        own.values[:, :, :row + 1], None, scaling=attn.scaling, softcap=None))
        out = outs[0] if batch == 1 else torch.cat(outs, dim=1)  # [1, B, heads, D]
        hidden = hidden + attn.o_proj(out.reshape(1, batch, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(base.norm(hidden))[0]


def decode_step(model: PreTrainedModel, cache: BlendedCache, token: int, row: int) -> torch.Tensor:
    """`decode_steps` for one request: logits [V]."""
    return decode_steps(model, [cache], [token], [row])[0]
