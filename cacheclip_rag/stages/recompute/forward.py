"""Forwards over tokens at explicit positions of a blended cache: prefill, selective recompute, decode.

`forward_at` is the one primitive: the given tokens run through every layer at their true
positions; at each layer their K/V overwrite the cache rows at those positions, and they attend
by position to every row before them (rows written earlier in the same layer included). Run over
the selected chunk tokens plus the question, it is CacheClip's layer-wise selective recompute.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import PreTrainedModel

from .attention import (AttentionProbe, ChunkScaling, ForwardContext, SelectedRowsKernel, forward_context,
                        position_masks, use_cacheclip_attention)
from .blocked_attention import row_blocks
from ...kernels.selected_attention import check_positions
from ..cache import BlendedCache
from ...models.loading import text_config


@functools.cache
def cache_argument(forward_owner: type) -> str:
    """The name a model class's forward takes its cache under: transformers 5.24 renamed
    `past_key_values` to `cache`, and the older name is silently dropped by releases that only know the
    new one (and vice versa), so it is read from the signature, never guessed."""
    parameters = inspect.signature(forward_owner.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{forward_owner.__name__}.forward takes neither `cache` nor `past_key_values`")


@torch.inference_mode()
def forward_at(
    model: PreTrainedModel,
    cache: BlendedCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    mask: torch.Tensor | dict | None = None,
    probes: dict[int, AttentionProbe] | None = None,
    kernel: SelectedRowsKernel | None = None,
    logits_to_keep: int = 1,
    base_model_only: bool = False,
    chunk_scaling: ChunkScaling | None = None,
) -> torch.Tensor:
    """Run `input_ids` [B, T] at RoPE `positions` [B, T], writing K/V at cache rows `slots` [T].

    `slots` defaults to `positions[0]` (the blended cache is addressed by position); `mask`
    defaults to the causal-by-position masks (under `chunk_scaling`, APE: causal by row, windows by
    the rows' positions); `chunk_scaling` applies APE's attention on chunk rows (eager; no kernel). Returns logits
    [B, logits_to_keep, V], or the last hidden states when `base_model_only`.
    """
    use_cacheclip_attention(model)  # the masks, probes and kernels below are read by its attention function
    device = cache.layers[0].keys.device
    input_ids, positions = input_ids.to(device), positions.to(device)
    cache.write_at(positions[0] if slots is None else slots.to(device))
    query_positions = positions
    blocks, by_position = None, False
    if chunk_scaling is not None:
        kernel = None
    if kernel is not None and not probes:
        # the kernel masks by position: no mask is built (see attention.cacheclip_mask); its int32
        # positions are converted and checked once here, not in every layer
        query_positions = positions.to(torch.int32)
        check_positions(query_positions, cache.visible_length)
        kernel = functools.partial(kernel, validate=False)
    elif mask is None and chunk_scaling is not None:
        rows = positions[0] if slots is None else slots.to(device)
        mask = position_masks(model, positions, cache.visible_length, cache.layers[0].keys.dtype,
                              query_slots=rows[None].expand_as(positions), key_positions=chunk_scaling.row_positions)
    elif mask is None:
        mask = position_masks(model, positions, cache.visible_length, cache.layers[0].keys.dtype)
        if device.type == "cpu" and positions.shape[0] == 1:  # the masks are by these positions: blocks may trim keys
            config = text_config(model)
            blocks = row_blocks(positions[0], group=config.num_attention_heads // config.num_key_value_heads)
            by_position = True
    context = ForwardContext(query_positions=query_positions, kernel=kernel, probes=probes or {},
                             chunk_scaling=chunk_scaling, row_blocks=blocks, masks_by_position=by_position)
    with forward_context(context):
        if base_model_only:
            base = model.model
            return base(
                input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                **{cache_argument(type(base)): cache},
            ).last_hidden_state
        out = model(
            input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
            logits_to_keep=logits_to_keep, **{cache_argument(type(model)): cache},
        )
    return out.logits


def recompute(
    model: PreTrainedModel,
    cache: BlendedCache,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    kernel: SelectedRowsKernel | None = None,
) -> torch.Tensor:
    """Selective recompute: tokens [T] at sorted positions [T] (selected chunk tokens, then the
    question); overwrites their K/V in every layer. Returns next-token logits [V] after the last one."""
    return forward_at(model, cache, token_ids[None], positions[None], kernel=kernel)[0, -1]
