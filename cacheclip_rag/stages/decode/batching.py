"""One forward for several requests, each over its own blended cache.

The server's waiting and running requests each hold a `BlendedCache` of their own length and layout
(prefix, chunks, question, answer rows at their own positions). A decode step is bound by reading the
weights, not by attention, so B requests' next tokens cost little more than one request's when their
linear layers run together (bench/bench_batching.py). `forward_rows` does that with the requests'
rows packed into one sequence, one segment per request (no padding, so requests with different row
counts waste nothing): the embeddings, projections and MLPs run once over all rows, and at each layer
the new K/V of request b's segment are written into request b's own cache and its queries attend over
that cache alone, under its own causal-by-position mask. No cache is copied or padded, so the cost
does not grow with the caches' size.

The result equals `recompute.forward_at` run request by request, up to the float rounding of a
batched matmul (tests/test_batching.py pins it). A batch of plain decode steps (one row each, at its own
position, of a model `decode_step` covers) runs `decode_step.decode_steps` instead: the same packing and
arithmetic without transformers' forward around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from ..recompute.attention import ForwardContext, RaggedBatch, forward_context, position_masks, use_cacheclip_attention
from ..cache import BlendedCache
from .step import decode_steps, supports
from ...models.loading import layer_types, text_config
from ..recompute.forward import cache_argument


@dataclass(frozen=True)
class RowsRequest:
    """One request's part of a batched forward: `input_ids` [T] at RoPE `positions` [T], written at
    cache rows `slots` [T] (default: the positions) of its own `cache`."""

    cache: BlendedCache
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1 or self.input_ids.numel() == 0:
            raise ValueError(f"input_ids must be one non-empty row of ids, got shape {tuple(self.input_ids.shape)}")
        if self.positions.shape != self.input_ids.shape:
            raise ValueError(f"positions {tuple(self.positions.shape)} must match input_ids {tuple(self.input_ids.shape)}")
        if self.slots is not None and self.slots.shape != self.input_ids.shape:
            raise ValueError(f"slots {tuple(self.slots.shape)} must match input_ids {tuple(self.input_ids.shape)}")

    @property
    def rows(self) -> torch.Tensor:
        return self.positions if self.slots is None else self.slots


class _RaggedLayer(CacheLayerMixin):
    """Layer `index` of every request's cache: `update` hands request b its own segment of the packed
    rows and returns the per-request keys and values (lists), which only the ragged attention reads."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: RaggedCache, index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a ragged batch writes into its requests' own caches")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = [], []
        for cache, (start, stop) in zip(self.owner.caches, self.owner.segments):
            # key_states: [1, KV, sum T, D]; request b owns rows [start, stop) of the packed sequence
            k, v = cache.layers[self.index].update(key_states[:, :, start:stop], value_states[:, :, start:stop])
            keys.append(k)
            values.append(v)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length(), 0

    def get_seq_length(self) -> int:
        return max(cache.visible_length for cache in self.owner.caches)

    def get_max_length(self) -> int:
        return max(cache.capacity for cache in self.owner.caches)


class RaggedCache(Cache):
    """Several requests' blended caches seen as one batch by the model's forward."""

    def __init__(self, caches: list[BlendedCache], segments: list[tuple[int, int]]):
        self.caches, self.segments = caches, segments  # each cache has the model's layers (`_check`)
        super().__init__(layers=[_RaggedLayer(self, i) for i in range(len(caches[0].layers))])


def _check(model: PreTrainedModel, requests: list[RowsRequest]) -> None:
    if not requests:
        raise ValueError("a batched forward needs at least one request")
    if len({id(r.cache) for r in requests}) != len(requests):
        raise ValueError("two requests of one batch share a cache; each request needs its own")
    layers = text_config(model).num_hidden_layers
    for i, r in enumerate(requests):
        if len(r.cache.layers) != layers:
            raise ValueError(f"request {i}'s cache has {len(r.cache.layers)} layers, the model {layers}")
        if r.cache.stale_layers:
            raise ValueError(f"request {i}'s cache has stale layers set (a diagnostic that runs alone)")


def _plain_step(model: PreTrainedModel, request: RowsRequest) -> bool:
    return (request.input_ids.numel() == 1 and bool((request.rows == request.positions).all())
            and supports(model, request.cache))


def forward_rows(model: PreTrainedModel, requests: list[RowsRequest]) -> list[torch.Tensor]:
    """Run every request's rows in one forward; each request's next-token logits [V] after its last row.

    Each cache is written exactly as `forward_at(model, r.cache, r.input_ids[None], r.positions[None],
    slots=r.slots)` would write it; no rows outside `r.slots` are touched.
    """
    _check(model, requests)
    if all(_plain_step(model, r) for r in requests):
        return list(decode_steps(model, [r.cache for r in requests], [int(r.input_ids[0]) for r in requests],
                                 [int(r.rows[0]) for r in requests]))
    return _forward_packed(model, requests)


@torch.inference_mode()
def _forward_packed(model: PreTrainedModel, requests: list[RowsRequest]) -> list[torch.Tensor]:
    use_cacheclip_attention(model)  # the per-request attention is the registered function's
    device = requests[0].cache.layers[0].keys.device
    dtype = requests[0].cache.layers[0].keys.dtype
    input_ids = torch.cat([r.input_ids.long() for r in requests]).to(device)[None]  # [1, sum T]
    positions = torch.cat([r.positions.long() for r in requests]).to(device)[None]
    ends = torch.tensor([r.input_ids.numel() for r in requests]).cumsum(0)
    segments = [(int(end) - r.input_ids.numel(), int(end)) for r, end in zip(requests, ends)]
    masks = []
    for r in requests:
        r.cache.write_at(r.rows.to(device))  # checks the rows fit; sets what each cache's layers write
        masks.append(position_masks(model, r.positions.long().to(device)[None], r.cache.visible_length, dtype))
    batch = RaggedBatch(segments=segments, masks=masks, kinds=layer_types(model))
    cache = RaggedCache([r.cache for r in requests], segments)
    with forward_context(ForwardContext(query_positions=positions, ragged=batch)):
        # logits_to_keep as indices: the head (and Gemma's final softcap) runs on each request's last row only
        out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=(ends - 1).to(device),
                    **{cache_argument(type(model)): cache})
    return list(out.logits[0])  # [B, V]
