"""Scattered query rows attend by blocks over only the keys each block can see (`blocked_attention`, the CPU
path of a selective recompute): sdpa's result over every key, with every mask form, GQA group and sliding
window; keys no row of a block may see are never read; and a recompute through blocks equals one without."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from cacheclip_rag.stages.recompute import blocked_attention as blocked_module
from cacheclip_rag.stages.recompute.blocked_attention import blocked_attention, row_blocks
from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.testing import ARCHITECTURES, tiny_model


def scattered(count: int, length: int, seed: int) -> torch.Tensor:
    """Sorted distinct positions in [0, length), the last rows at the end (a recompute's question)."""
    g = torch.Generator().manual_seed(seed)
    early = torch.randperm(length - 5, generator=g)[:count - 5].sort().values
    return torch.cat([early, torch.arange(length - 5, length)])


def allowed_by_position(positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    keys = torch.arange(length)
    allowed = keys <= positions[:, None]
    if window is not None:
        allowed &= keys > positions[:, None] - window
    return allowed[None, None]  # [1, 1, Tq, N]


def reference(query, key, value, allowed, scaling):
    """Eager attention over repeated keys in float64: [B, Tq, H, D]."""
    group = query.shape[1] // key.shape[1]
    scores = query.double() @ repeat_kv(key, group).double().transpose(2, 3) * scaling
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ repeat_kv(value, group).double()).transpose(1, 2)


def test_row_blocks_cover_every_row_once_and_bound_its_positions():
    positions = scattered(100, 1000, 0)
    blocks = row_blocks(positions, group=4, packed_rows=80)  # 20 rows a block
    assert [b.stop - b.start for b in blocks] == [20] * 5
    assert blocks[0].start == 0 and blocks[-1].stop == 100
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    for b in blocks:
        assert (b.first, b.last) == (int(positions[b.start:b.stop].min()), int(positions[b.start:b.stop].max()))
    unsorted = positions.flip(0)  # a block's keys still span every row it holds
    assert all(b.first <= int(p) <= b.last for b in row_blocks(unsorted, group=4, packed_rows=80)
               for p in unsorted[b.start:b.stop])
    assert row_blocks(positions, group=4, packed_rows=300) is None  # one block is plain sdpa's work
    assert row_blocks(positions, group=1) is None  # 100 rows, 840 packed rows a block by default


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("mask_form", ["additive", "boolean"])
def test_blocked_attention_equals_attention_over_every_key(group, window, mask_form):
    torch.manual_seed(group)
    length, rows, kv_heads, dim = 300, 60, 2, 16
    positions = scattered(rows, length, group)
    query = torch.randn(1, rows, kv_heads * group, dim).transpose(1, 2)  # transformers' layout: a transposed view
    buffer_k, buffer_v = torch.randn(1, kv_heads, length + 50, dim), torch.randn(1, kv_heads, length + 50, dim)
    key, value = buffer_k[:, :, :length], buffer_v[:, :, :length]  # the cache's strided slice
    allowed = allowed_by_position(positions, length, window)
    mask = allowed if mask_form == "boolean" else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    blocks = row_blocks(positions, group=group, packed_rows=group * 12)
    assert len(blocks) == 5
    got = blocked_attention(query, key, value, mask, blocks, scaling=0.25, sliding_window=window)
    expected = reference(query, key, value, allowed, 0.25)
    assert got.shape == (1, rows, kv_heads * group, dim)
    assert torch.allclose(got.double(), expected, atol=1e-5), (got.double() - expected).abs().max()


@pytest.mark.parametrize("window", [None, 40])
def test_keys_no_row_of_a_block_may_see_are_never_read(window):
    """NaN in every key a block's mask hides: sdpa over all keys turns NaN (a masked NaN score is still NaN),
    the blocks never read them."""
    torch.manual_seed(0)
    length, rows = 300, 40
    positions = torch.cat([torch.arange(100, 120), torch.arange(200, 220)])  # two runs, far apart
    query = torch.randn(1, 4, rows, 16)
    key, value = torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
    blocks = row_blocks(positions, group=2, packed_rows=40)  # one block a run
    assert [(b.first, b.last) for b in blocks] == [(100, 119), (200, 219)]
    key[:, :, 220:] = float("nan")  # after every row
    value[:, :, 220:] = float("nan")
    if window is not None:
        key[:, :, :100 - window + 1] = float("nan")  # before every row's window
    allowed = allowed_by_position(positions, length, window)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    got = blocked_attention(query, key, value, mask, blocks, scaling=0.25, sliding_window=window)
    assert not got.isnan().any()
    clean_k, clean_v = key.nan_to_num(0.0), value.nan_to_num(0.0)
    assert torch.allclose(got.double(), reference(query, clean_k, clean_v, allowed, 0.25), atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_recompute_through_blocks_equals_one_without(arch, monkeypatch):
    """forward_at over scattered rows of a prefilled cache: the same logits and cache writes with blocks
    (forced by a small block) as with one sdpa over every key; every full-or-windowed layer took the blocks."""
    lm = tiny_model(arch)
    ids = torch.randint(5, 300, (1, 200), generator=torch.Generator().manual_seed(1))
    rows = scattered(60, 200, 2)

    def run(packed_rows: int):
        monkeypatch.setattr(blocked_module, "PACKED_ROWS_PER_BLOCK", packed_rows)
        cache = new_cache(lm, 200)
        forward_at(lm.model, cache, ids, torch.arange(200)[None])  # a windowed layer's prefill takes blocks too
        calls.clear()
        logits = forward_at(lm.model, cache, ids[:, rows], rows[None], logits_to_keep=60)
        return logits, [layer.keys[:, :, :200].clone() for layer in cache.layers]

    calls = []
    real = blocked_module.blocked_attention
    from cacheclip_rag.stages.recompute import attention
    monkeypatch.setattr(attention, "blocked_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain_logits, plain_keys = run(10**9)
    assert calls == []
    group = lm.config.num_attention_heads // lm.config.num_key_value_heads
    blocked_logits, blocked_keys = run(12 * group)  # 12 rows a block: 5 blocks
    assert len(calls) == lm.config.num_hidden_layers
    assert torch.allclose(blocked_logits, plain_logits, atol=1e-4), (blocked_logits - plain_logits).abs().max()
    for a, b in zip(blocked_keys, plain_keys):
        assert torch.allclose(a, b, atol=1e-5)
