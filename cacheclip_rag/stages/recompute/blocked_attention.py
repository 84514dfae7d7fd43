"""Attention of scattered query rows on the CPU, by blocks of rows over only the keys each block can see.

A selective recompute's rows lie anywhere in a long cache, and sdpa under a mask runs every key for
every row: at 4K most of its work is on keys the mask hides. Here the rows, sorted by position, are cut
into blocks; a block attends over the keys up to its last row's position (and, on a sliding-window
layer, from its first row's position minus the window), the only keys its mask can allow, so the
result is sdpa's over all keys up to float rounding.

torch's CPU flash kernel is efficient only for long query blocks (its query tile is 256 rows from
768 rows on, 32 below 192), so a block of ~120 rows would run slowly. Each block therefore packs the
query heads that share a KV head into its rows (GQA packing, as the Triton kernel does on the GPU): a
KV head's keys are read once for its whole group, and a block of 120 rows is 840 query rows for a
7-head group. Measured (Qwen2.5 0.5B shapes, 830 scattered rows over 4,100 keys, bf16, 2 cores): 82-90
ms a layer for sdpa over all keys, 55 ms in 7 packed blocks (bench/RESULTS.md, issue 50).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Packed query rows (rows x query heads per KV head) in a block: at least the 768 rows from which torch's
# CPU flash kernel uses its largest query tile.
PACKED_ROWS_PER_BLOCK = 840


@dataclass(frozen=True)
class RowBlock:
    """Query rows [start, stop) of one sequence, whose positions lie in [first, last]."""

    start: int
    stop: int
    first: int
    last: int


def row_blocks(positions: torch.Tensor, *, group: int, packed_rows: int | None = None) -> tuple[RowBlock, ...] | None:
    """Blocks of consecutive query rows at `positions` [Tq], ~`packed_rows` / `group` rows each (`group`:
    query heads per KV head), or None when that makes fewer than two (one block is plain sdpa's work).
    Rows need not be sorted (a block's keys span its lowest to its highest position), but sorted rows,
    as a recompute's are, keep each block's keys short."""
    values = positions.tolist()
    count = round(len(values) * group / (packed_rows or PACKED_ROWS_PER_BLOCK))
    if count < 2:
        return None
    edges = [len(values) * i // count for i in range(count + 1)]
    return tuple(RowBlock(a, b, min(values[a:b]), max(values[a:b])) for a, b in zip(edges, edges[1:]))


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      blocks: tuple[RowBlock, ...], *, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [B, H, Tq, D], key/value [B, KV, N, D] and a causal-by-position `mask` [B or 1, 1, Tq, >= N]
    (additive or boolean) built from the rows' positions (`attention.position_masks`), whose blocks are
    `blocks` -> [B, Tq, H, D], sdpa's result up to float rounding."""
    batch, heads, rows, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    # [B, KV, Tq, G, D]: row-major within a KV head, so a block of rows is a contiguous run of packed rows
    packed = query.transpose(1, 2).reshape(batch, rows, kv_heads, group, dim).transpose(1, 2)
    out = torch.empty(batch, rows, kv_heads, group, dim, dtype=query.dtype, device=query.device)
    for block in blocks:
        stop = min(n, block.last + 1)
        start = 0 if sliding_window is None else min(stop - 1, max(0, block.first - sliding_window + 1))
        size = block.stop - block.start
        q = packed[:, :, block.start:block.stop].reshape(batch, kv_heads, size * group, dim)
        m = mask[:, :, block.start:block.stop, start:stop].repeat_interleave(group, dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, key[:, :, start:stop], value[:, :, start:stop],
                                                             attn_mask=m, scale=scaling)
        out[:, block.start:block.stop] = o.reshape(batch, kv_heads, size, group, dim).transpose(1, 2)
    return out.reshape(batch, rows, heads, dim)
