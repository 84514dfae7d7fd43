"""Flash-attention forward for selected query rows at arbitrary sorted positions.

Queries are the recomputed tokens plus the question, at sorted positions of the blended cache; keys
and values are the whole cache. A query at position p sees keys at positions <= p, and > p - window
on sliding-window layers; optional logit soft-cap (Gemma 2 style). Grouped-query heads share kv
heads. Each program takes BLOCK_M consecutive query rows: because rows are sorted, the last row's
position bounds every key block the program needs, and after grouping rows come in contiguous runs,
so a block's rows sit close together and the causal bound skips most of the cache past them.

`selected_attention_reference` is the pure-torch reference and the CPU path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference works without Triton
    triton = None
    tl = None


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


if triton is not None:

    @triton.jit
    def _selected_attention_fwd(
        Q, K, V, Pos, Out,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_pb, stride_pm,
        stride_ob, stride_om, stride_oh, stride_od,
        num_queries, num_keys, num_heads, group_size,
        sm_scale, softcap, window,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        kv_head = head // group_size

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        row_ok = offs_m < num_queries

        q = tl.load(Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(Pos + batch * stride_pb + offs_m * stride_pm, mask=row_ok, other=-1)
        # rows are sorted: the block's last valid row has the largest position
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, num_queries) - 1
        max_pos = tl.load(Pos + batch * stride_pb + last_row * stride_pm)
        hi = tl.minimum(max_pos + 1, num_keys)
        lo = 0
        if USE_WINDOW:
            min_pos = tl.load(Pos + batch * stride_pb + pid_m * BLOCK_M * stride_pm)
            lo = tl.maximum(min_pos - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        k_base = K + batch * stride_kb + kv_head * stride_kh
        v_base = V + batch * stride_vb + kv_head * stride_vh
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            col_ok = cols < hi
            k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale
            if USE_SOFTCAP:
                # softcap * tanh(s / softcap), tanh written with exp for every Triton version
                x = s * (1.0 / softcap)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
            s = s * 1.4426950408889634  # log2(e): the softmax runs in base 2
            allowed = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
            if USE_WINDOW:
                allowed = allowed & (cols[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + batch * stride_ob + offs_m[:, None] * stride_om + head * stride_oh + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def selected_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton launcher; same contract as `selected_attention_reference`.

    query [B, H, Tq, D]; key, value [B, KV, N, D]; positions [B, Tq] sorted ascending per batch,
    each < N. Returns [B, Tq, H, D] in the query dtype.
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
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {d} not supported (16, 32, 64, 128, 256)")
    if positions.shape != (b, tq):
        raise ValueError(f"positions must be [B, Tq] = {(b, tq)}, got {tuple(positions.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.dtype != query.dtype:
        raise ValueError(f"dtypes must match and be fp16/bf16/fp32; got {query.dtype}, {key.dtype}")
    out = torch.empty((b, tq, h, d), dtype=query.dtype, device=query.device)
    if tq == 0:
        return out
    positions = positions.to(torch.int32)
    block_m = min(block_m, max(16, triton.next_power_of_2(tq)))
    if d == 256:
        block_n = min(block_n, 32)
    grid = (triton.cdiv(tq, block_m), b * h)
    _selected_attention_fwd[grid](
        query, key, value, positions, out,
        *query.stride(), *key.stride(), *value.stride(), *positions.stride(), *out.stride(),
        tq, n, h, h // kv,
        float(scaling), float(softcap or 1.0), int(sliding_window or 0),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=query.dtype == torch.float32,
    )
    return out
