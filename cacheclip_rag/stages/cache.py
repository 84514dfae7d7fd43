"""A full-length KV cache whose rows are written at explicit positions.

This is the blended cache of the design: one prefix, chunks at contiguous positions, room for the
question and the answer. A forward over any set of tokens, run with `position_ids` = their
positions and `cache.write_at(positions)`, overwrites exactly those rows in every layer before the
layer's attention reads the cache; that is the layer-wise selective recompute. Sliding-window
layers stay full-length; the window lives in the mask (see `attention.position_masks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PositionedLayer(CacheLayerMixin):
    """One layer's K/V buffers [B, KV, N, D]; `update` writes rows at the cache's write positions."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: BlendedCache, index: int = 0):
        super().__init__()
        self.keys, self.values = keys, values
        self.owner = owner
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("PositionedLayer buffers are allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.owner.wait_for_layer is not None:  # its rows may still be arriving (layer-wise loading)
            self.owner.wait_for_layer(self.index)
        positions = self.owner.write_positions  # [T]
        if self.index in self.owner.stale_layers:  # diagnostic: rows before `stale_before` keep what was loaded
            fresh = positions >= self.owner.stale_before
            positions, key_states, value_states = positions[fresh], key_states[:, :, fresh], value_states[:, :, fresh]
        self.keys.index_copy_(2, positions, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, positions, value_states.to(self.values.dtype))
        n = self.owner.visible_length
        return self.keys[:, :, :n], self.values[:, :, :n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.visible_length, 0

    def get_seq_length(self) -> int:
        return self.owner.visible_length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class BlendedCache(Cache):
    """Per-layer K/V of shape [B, KV, N, D] with position-addressed writes.

    `keys[l]`, `values[l]`: [B, KV, N, D]. Call `write_at(positions)` before each forward; the
    forward then writes its T rows at those positions (sorted, unique) and every layer attends over
    rows [0, max(positions)] under the mask built from the same positions.
    """

    def __init__(self, keys: list[torch.Tensor] | torch.Tensor, values: list[torch.Tensor] | torch.Tensor):
        super().__init__(layers=[PositionedLayer(k, v, self, i) for i, (k, v) in enumerate(zip(keys, values))])
        # set while a layer-wise load is in flight: called with a layer's index before the layer is used
        self.wait_for_layer: Callable[[int], None] | None = None
        self.from_store: torch.Tensor | None = None  # [capacity] bool: rows read from the store (blended caches)
        # diagnostic (RequestOptions.recompute_layers): in these layers, forwards leave rows < stale_before as they are
        self.stale_layers: frozenset[int] = frozenset()
        self.stale_before = 0
        self.write_positions = torch.zeros(0, dtype=torch.long, device=keys[0].device)
        self.visible_length = 0
        # one [L, B, KV, N, D] buffer behind all layers (when built that way): a chunk's rows are placed
        # in every layer with one copy instead of one per layer
        self.key_buffer = keys if isinstance(keys, torch.Tensor) else None
        self.value_buffer = values if isinstance(values, torch.Tensor) else None

    @classmethod
    def empty(
        cls, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, *,
        dtype: torch.dtype, device: torch.device | str,
    ) -> BlendedCache:
        shape = (layers, batch, kv_heads, length, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def copy(self) -> BlendedCache:
        """A cache holding a copy of these rows (built on one buffer, as `empty` builds it)."""
        if self.key_buffer is None:
            raise ValueError("copy needs a cache built on one [L, B, KV, N, D] buffer (BlendedCache.empty)")
        return BlendedCache(self.key_buffer.clone(), self.value_buffer.clone())

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    def write_at(self, positions: torch.Tensor) -> None:
        """Rows the next forward writes: positions [T], sorted and unique."""
        if positions.numel() == 0:
            raise ValueError("a forward needs at least one position")
        last = int(positions[-1])
        if last >= self.capacity:
            raise ValueError(f"position {last} is beyond the cache capacity {self.capacity}")
        self.write_positions = positions.to(self.layers[0].keys.device)
        self.visible_length = last + 1

    def place(self, position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy precomputed rows in at `position`: keys, values [L, KV, T, D] (batch 0)."""
        t = keys.shape[2]
        if keys.shape[0] != len(self.layers) or values.shape != keys.shape:
            raise ValueError(f"rows for {keys.shape[0]} layers (values {tuple(values.shape)}) placed into a "
                             f"{len(self.layers)}-layer cache")
        if self.key_buffer is not None:
            self.key_buffer[:, 0, :, position:position + t].copy_(keys)
            self.value_buffer[:, 0, :, position:position + t].copy_(values)
            return
        for layer, k, v in zip(self.layers, keys, values):
            layer.keys[0, :, position:position + t].copy_(k)
            layer.values[0, :, position:position + t].copy_(v)

    def slot(self, position: int, length: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows [position, position + length) in every layer: keys, values [L, KV, T, D], the
        place a stored chunk is decoded into."""
        if self.key_buffer is None:
            raise ValueError("slots need a cache built on one [L, B, KV, N, D] buffer (BlendedCache.empty)")
        if position < 0 or position + length > self.capacity:
            raise ValueError(f"rows [{position}, {position + length}) lie outside the cache's {self.capacity}")
        return (self.key_buffer[:, batch, :, position:position + length],
                self.value_buffer[:, batch, :, position:position + length])

    def rows(self, start: int, stop: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows [start, stop) stacked over layers: [L, KV, T, D] each."""
        keys = torch.stack([layer.keys[batch, :, start:stop] for layer in self.layers])
        values = torch.stack([layer.values[batch, :, start:stop] for layer in self.layers])
        return keys, values
