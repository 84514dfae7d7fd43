"""Flash-attention forward for selected query rows at arbitrary sorted positions.

Queries are the recomputed tokens plus the question, at sorted positions of the blended cache; keys
and values are the whole cache. A query at position p sees keys at positions <= p, and > p - window
on sliding-window layers; optional logit soft-cap (Gemma 2 style).

How the kernel is laid out (FlashAttention-2 style, the Triton tutorial's structure):
- **GQA packing.** A program owns one kv head and a tile of BLOCK_M (row, query-head) pairs: the G
  query heads that share the kv head, for BLOCK_M / G consecutive rows. Each K/V tile it loads
  serves all G heads, instead of being loaded once per query head.
- **Bounds from sorted rows.** Rows are sorted, so a tile's first and last rows bound every key it
  needs. Key blocks wholly below the first row's position (and inside every row's window) are read
  in an unmasked bulk loop; only the edge blocks are masked. After grouping, rows come in runs, so
  a tile spans few positions and nearly every key block is bulk.
- **Heaviest first.** The tile with the latest rows has the most keys; tiles are launched from the
  last to the first, kv heads fastest, so the long ones do not trail at the end.
- **Split keys** when there are too few tiles to fill the GPU (question-only forwards, decode):
  each split writes an unnormalised partial (acc, max, sum) and `_combine_splits` merges them.
- Scores take one FMA for the base-2 scale; the soft-cap's tanh is built from exp2.

`selected_attention_reference` is the pure-torch reference and the CPU path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without Triton
    triton = None
    tl = None

LOG2E = 1.4426950408889634
# (pairs per tile, keys per tile, warps, stages) by head dim: FlashAttention-2's Hopper/Ampere
# choices for the tutorial's kernel (64 and 128: 128x64; 256 halves both for shared memory).
TILES = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}


def selected_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [B, H, Tq, D], key/value [B, KV, N, D], positions [B, Tq] -> out [B, Tq, H, D] (fp32 math)."""
    b, h, tq, d = query.shape
    kv = key.shape[1]
    k = key.float().repeat_interleave(h // kv, dim=1)  # [B, H, N, D]
    v = value.float().repeat_interleave(h // kv, dim=1)
    scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling  # [B, H, Tq, N]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    kv_idx = torch.arange(key.shape[2], device=query.device)
    q_pos = positions[:, None, :, None]
    allowed = kv_idx <= q_pos
    if sliding_window is not None:
        allowed &= kv_idx > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing outputs 0
    return torch.matmul(probs, v).transpose(1, 2).to(query.dtype)


# Integer arguments that change with every request (row count, context length, tile count, strides):
# Triton would otherwise specialise on each one's divisibility by 16 (and == 1) and compile anew for
# most new shapes. Only the constexprs below select a compiled variant, and they take a few values.
DO_NOT_SPECIALIZE = (
    "stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
    "stride_vn", "stride_pb", "stride_pm", "stride_ob", "stride_om", "stride_oh",
    "num_queries", "num_keys", "num_kv_heads", "num_tiles", "split_len", "num_splits", "window",
)


if triton is not None:

    @triton.jit
    def _attend(acc, m_i, l_i, q, pos, K_base, V_base, stride_kn, stride_vn, offs_d, offs_n,
                start, stop, num_keys, qk_scale, cap_scale, cap_out, window,
                MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                IEEE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online softmax over key blocks [start, stop); MASKED applies causality, window and the
        key count per score, the bulk path (MASKED=False) trusts that every pair sees every key."""
        for block in range(start, stop, BLOCK_N):
            cols = block + offs_n
            if MASKED:
                col_ok = cols < num_keys
                k = tl.load(K_base + cols[:, None] * stride_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            else:
                k = tl.load(K_base + cols[:, None] * stride_kn + offs_d[None, :])
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            if USE_SOFTCAP:
                # cap * tanh(s * scale / cap) in base 2: tanh(x) = 1 - 2 / (exp(2x) + 1)
                e = tl.exp2(qk * cap_scale)
                qk = cap_out - tl.fdiv(2.0 * cap_out, e + 1.0)
            else:
                qk = qk * qk_scale
            if MASKED:
                allowed = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
                if USE_WINDOW:
                    allowed = allowed & (cols[None, :] > pos[:, None] - window)
                qk = tl.where(allowed, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = m_new
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(V_base + cols[:, None] * stride_vn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            else:
                v = tl.load(V_base + cols[:, None] * stride_vn + offs_d[None, :])
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
    def _selected_attention_fwd(
        Q, K, V, Pos, Out, Acc, Max, Sum,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_pb, stride_pm,
        stride_ob, stride_om, stride_oh,
        num_queries, num_keys, num_kv_heads, num_tiles, split_len, num_splits,
        qk_scale, cap_scale, cap_out, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)  # fastest: all kv heads of the heaviest tile go first
        tile = num_tiles - 1 - tl.program_id(1)
        split = tl.program_id(2)
        batch = pid_bh // num_kv_heads
        kv_head = pid_bh % num_kv_heads

        pairs = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (row, head in group) pairs, row-major
        num_pairs = num_queries * GROUP
        pair_ok = pairs < num_pairs
        rows = pairs // GROUP
        heads = kv_head * GROUP + pairs % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(Q + batch * stride_qb + heads[:, None] * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                    mask=pair_ok[:, None], other=0.0)
        P = Pos + batch * stride_pb
        pos = tl.load(P + rows * stride_pm, mask=pair_ok, other=-1)
        # rows are sorted: the tile's first and last valid rows bound every key it needs
        min_pos = tl.load(P + ((tile * BLOCK_M) // GROUP) * stride_pm)
        max_pos = tl.load(P + ((tl.minimum(tile * BLOCK_M + BLOCK_M, num_pairs) - 1) // GROUP) * stride_pm)
        hi = max_pos + 1
        full_hi = ((min_pos + 1) // BLOCK_N) * BLOCK_N  # blocks ending at or before the first row
        lo = 0
        full_lo = 0
        if USE_WINDOW:
            lo = (tl.maximum(min_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(max_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        # [lo, b) masked head (window), [b, c) unmasked bulk, [c, d) masked tail (causal edge)
        b = tl.maximum(lo, full_lo)
        c = tl.maximum(b, full_hi)
        d = tl.maximum(c, hi)
        if num_splits > 1:
            s_lo = split * split_len
            s_hi = s_lo + split_len
            lo, b, c, d = tl.maximum(lo, s_lo), tl.minimum(tl.maximum(b, s_lo), s_hi), \
                tl.minimum(tl.maximum(c, s_lo), s_hi), tl.minimum(d, s_hi)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        K_base = K + batch * stride_kb + kv_head * stride_kh
        V_base = V + batch * stride_vb + kv_head * stride_vh
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, pos, K_base, V_base, stride_kn, stride_vn, offs_d, offs_n,
                                lo, b, num_keys, qk_scale, cap_scale, cap_out, window,
                                True, USE_SOFTCAP, USE_WINDOW, IEEE, BLOCK_N)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, pos, K_base, V_base, stride_kn, stride_vn, offs_d, offs_n,
                                b, c, num_keys, qk_scale, cap_scale, cap_out, window,
                                False, USE_SOFTCAP, USE_WINDOW, IEEE, BLOCK_N)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, pos, K_base, V_base, stride_kn, stride_vn, offs_d, offs_n,
                                c, d, num_keys, qk_scale, cap_scale, cap_out, window,
                                True, USE_SOFTCAP, USE_WINDOW, IEEE, BLOCK_N)
        if num_splits == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees nothing outputs 0
            tl.store(Out + batch * stride_ob + rows[:, None] * stride_om + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(Out.dtype.element_ty), mask=pair_ok[:, None])
        else:
            # partials [splits, B, Tq, H, (D)], contiguous; merged by _combine_splits
            batches = tl.num_programs(0) // num_kv_heads
            base = ((split * batches + batch) * num_queries + rows) * (num_kv_heads * GROUP) + heads
            tl.store(Max + base, m_i, mask=pair_ok)
            tl.store(Sum + base, l_i, mask=pair_ok)
            tl.store(Acc + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=pair_ok[:, None])


def _combine_splits(acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge split-key partials: acc [S, B, Tq, H, D], maxes/sums [S, B, Tq, H] (base 2) -> [B, Tq, H, D]."""
    top = maxes.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp2(maxes - top)  # 0 for a split that saw nothing
    total = (weight * sums).sum(0)
    out = (weight[..., None] * acc).sum(0) / torch.where(total == 0, 1.0, total)[..., None]
    return out.to(dtype)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_positions(positions: torch.Tensor, num_keys: int) -> None:
    """Positions [B, Tq] must be sorted ascending per batch and inside [0, num_keys): the kernel takes
    each tile's key range from its first and last rows, so unsorted rows would silently read too few
    keys. One device sync; the engine checks once per forward, not per layer."""
    if positions.numel() == 0:
        return
    bad = (positions[:, 1:] < positions[:, :-1]).any() | (positions.min() < 0) | (positions.max() >= num_keys)
    if bool(bad):
        raise ValueError(f"positions must be sorted ascending per batch and within [0, {num_keys}); got "
                         f"min {int(positions.min())}, max {int(positions.max())}")


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is launched: the grid, the runtime split of the keys, and the compile-time choices.
    Only `constexprs`, `num_warps` and `num_stages` pick a compiled variant (the rest of the integers
    are in `DO_NOT_SPECIALIZE`), so their few values bound the compiles a server ever makes."""

    grid: tuple[int, int, int]
    num_tiles: int
    num_splits: int
    split_len: int
    constexprs: dict
    num_warps: int
    num_stages: int

    @property
    def variant(self) -> tuple:
        return (tuple(sorted(self.constexprs.items())), self.num_warps, self.num_stages)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_plan(b: int, h: int, kv: int, tq: int, n: int, d: int, dtype: torch.dtype, window: bool, softcap: bool,
                multiprocessors: int = 0, block_m: int | None = None, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                num_splits: int | None = None) -> LaunchPlan:
    """The launch of `selected_attention` for these sizes. The row tile shrinks for few rows to a
    power of two (16..BLOCK_M: at most 4 sizes); keys are split at run time (no recompile) until the
    grid covers the GPU twice (`multiprocessors`), keeping >= 4 key blocks a split."""
    group = h // kv
    tile_m, tile_n, warps, stages = TILES[d]
    block_m = block_m or tile_m
    block_n = block_n or tile_n
    block_m = min(block_m, max(16, 1 << max(0, (tq * group - 1).bit_length())))
    num_tiles = _cdiv(tq * group, block_m)
    key_blocks = _cdiv(n, block_n)
    if num_splits is None:
        num_splits = 1
        if multiprocessors:
            programs = num_tiles * b * kv
            num_splits = max(1, min(_cdiv(2 * multiprocessors, programs), key_blocks // 4))
    num_splits = max(1, min(num_splits, key_blocks))
    split_len = _cdiv(key_blocks, num_splits) * block_n
    num_splits = _cdiv(n, split_len)
    constexprs = dict(GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, USE_SOFTCAP=softcap,
                      USE_WINDOW=window, IEEE=dtype == torch.float32)
    return LaunchPlan((b * kv, num_tiles, num_splits), num_tiles, num_splits, split_len, constexprs,
                      num_warps or warps, num_stages or stages)


def selected_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Triton launcher; same contract as `selected_attention_reference`.

    query [B, H, Tq, D]; key, value [B, KV, N, D] (last dim contiguous); positions [B, Tq] sorted
    ascending per batch, each < N (int32 avoids a conversion). Returns [B, Tq, H, D] in the query
    dtype. Tiles default to `TILES[D]`; `num_splits` defaults to splitting keys only when the tiles
    alone would leave most of the GPU idle. `validate=False` skips the positions check (one device
    sync) for callers that checked them once for many layers.
    """
    if triton is None:
        raise ModuleNotFoundError("selected_attention needs Triton: pip install 'cacheclip-rag[triton]'")
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"expected query [B,H,Tq,D], key=value [B,KV,N,D]; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    b, h, tq, d = query.shape
    kv, n = key.shape[1], key.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if d not in TILES:
        raise ValueError(f"head dim {d} not supported ({', '.join(map(str, TILES))})")
    if positions.shape != (b, tq):
        raise ValueError(f"positions must be [B, Tq] = {(b, tq)}, got {tuple(positions.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"dtypes must match and be fp16/bf16/fp32; got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("query, key and value need a contiguous last (head) dim")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    out = torch.empty((b, tq, h, d), dtype=query.dtype, device=query.device)
    if tq == 0:
        return out
    if positions.dtype != torch.int32:
        positions = positions.to(torch.int32)
    if validate:
        check_positions(positions, n)
    plan = launch_plan(b, h, kv, tq, n, d, query.dtype, sliding_window is not None, softcap is not None,
                       _multiprocessors(query.device.index or 0) if query.is_cuda else 0,
                       block_m, block_n, num_warps, num_stages, num_splits)
    num_splits = plan.num_splits
    if num_splits > 1:
        acc = torch.empty((num_splits, b, tq, h, d), dtype=torch.float32, device=query.device)
        maxes = torch.empty((num_splits, b, tq, h), dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxes)
    else:
        acc = maxes = sums = out  # unused
    use_cap = softcap is not None
    _selected_attention_fwd[plan.grid](
        query, key, value, positions, out, acc, maxes, sums,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        tq, n, kv, plan.num_tiles, plan.split_len, num_splits,
        float(scaling) * LOG2E,
        float(scaling) / float(softcap) * 2.0 * LOG2E if use_cap else 1.0,
        float(softcap) * LOG2E if use_cap else 1.0,
        int(sliding_window or 0),
        **plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if num_splits > 1:
        # partial maxes are in base 2 and include the scale; sums match them
        return _combine_splits(acc, maxes, sums, query.dtype)
    return out
