"""One decode step of a Llama-family model, run layer by layer without transformers' module machinery.

A decode step over the blended cache does little arithmetic a layer (one row through seven linears and
one attention row), so on a CPU the time around the arithmetic counts: transformers' forward adds, per
step, mask preparation, output capturing, keyword plumbing and a wrapper call per layer and attention
(~6,300 aten calls a step for a 24-layer model). `decode_step` runs the same modules' weights through
the same ops in the same order — embeddings, the rotary module once, then per layer the norm modules, the
projection modules, RoPE, the cache write, `attention.dense_attention`, the MLP module — so its logits
and the cache rows it writes are bit-identical to `recompute.forward_at`'s (tests/test_decode_step.py).

It covers what a plain decode step is: a Llama or Qwen2 decoder whose layers all attend fully, one
token on the cache's next row at its own position, a batch of one, no diagnostic stale layers. Anything
else (Gemma 3's windows and norms, APE's shifted positions and chunk scaling) goes through `forward_at`;
`supports` says which.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import dense_attention
from .cache import BlendedCache
from .models import layer_types

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
def decode_step(model: PreTrainedModel, cache: BlendedCache, token: int, row: int) -> torch.Tensor:
    """Logits [V] after `token`, run at position `row` and written to cache row `row`; every row before it
    is visible (the cache's visible length becomes `row + 1`). Check `supports(model, cache)` first."""
    cache.write_at(torch.tensor([row]))
    base = model.model
    device = cache.layers[0].keys.device
    hidden = base.embed_tokens(torch.tensor([[token]], device=device))
    cos, sin = base.rotary_emb(hidden, torch.tensor([[row]], device=device))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    visible = row + 1
    for index, layer in enumerate(base.layers):
        if cache.wait_for_layer is not None:  # its rows may still be arriving (layer-wise loading)
            cache.wait_for_layer(index)
        attn, rows = layer.self_attn, cache.layers[index]
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        key = attn.k_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(x).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        rows.keys[:, :, row] = key[:, :, 0]  # the copy casts to the cache's dtype, as `PositionedLayer.update`
        rows.values[:, :, row] = value[:, :, 0]
        out = dense_attention(attn, query, rows.keys[:, :, :visible], rows.values[:, :, :visible], None,
                              scaling=attn.scaling, softcap=None)
        hidden = hidden + attn.o_proj(out.reshape(1, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(base.norm(hidden))[0, -1]
