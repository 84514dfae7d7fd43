"""The decode step's attention path: one query row by grouped matmuls (no repeated keys, no mask where the
row sees everything) equals sdpa's and the eager path's outputs, and a decode step equals a full forward."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers.integrations.sdpa_attention import repeat_kv

from cacheclip_rag.stages.recompute.attention import one_row_attention, position_masks
from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.testing import tiny_model


def reference(query, key, value, mask, scaling, softcap=None):
    """Eager attention over repeated keys, float64: [B, 1, H, D]."""
    group = query.shape[1] // key.shape[1]
    k, v = repeat_kv(key, group).double(), repeat_kv(value, group).double()
    scores = query.double() @ k.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_one_row_attention_equals_eager_attention_with_every_mask_form(softcap):
    torch.manual_seed(0)
    query, key = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16)
    value = torch.randn_like(key)
    allowed = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    allowed[0, ..., 30:] = False  # a row that sees only part of the cache (a window, an earlier row)
    allowed[2, ..., :25] = False
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (None, allowed, additive, additive[:1].expand(3, -1, -1, -1)):
        expected = reference(query, key, value, mask, 0.25, softcap).float()
        got = one_row_attention(query, key, value, mask, scaling=0.25, softcap=softcap)
        assert got.shape == (3, 1, 8, 16)
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    masked_out = one_row_attention(query, key, value, allowed, scaling=0.25, softcap=softcap)
    assert not torch.allclose(masked_out, one_row_attention(query, key, value, None, scaling=0.25, softcap=softcap))
    # the cache's keys are a slice of a buffer with room to grow: strided, the same answer
    room_k, room_v = torch.zeros(3, 2, 64, 16), torch.zeros(3, 2, 64, 16)
    room_k[:, :, :40], room_v[:, :, :40] = key, value
    strided = one_row_attention(query, room_k[:, :, :40], room_v[:, :, :40], allowed, scaling=0.25, softcap=softcap)
    assert torch.equal(strided, masked_out)


def test_one_row_attention_matches_sdpa_in_bfloat16():
    torch.manual_seed(1)
    query, key = torch.randn(1, 14, 1, 64, dtype=torch.bfloat16), torch.randn(1, 2, 500, 64, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    sdpa = scaled_dot_product_attention(query, repeat_kv(key, 7), repeat_kv(value, 7), scale=0.125).transpose(1, 2)
    got = one_row_attention(query, key, value, None, scaling=0.125, softcap=None)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), sdpa.float(), atol=4e-3)


def test_a_decode_step_on_the_last_row_needs_no_full_attention_mask():
    lm = tiny_model("gemma3")  # full and sliding layers
    last = position_masks(lm.model, torch.tensor([[19]]), 20, torch.float32)
    assert last["full_attention"] is None
    window = last["sliding_attention"]  # the window still masks: rows 8..19 of 20 visible to row 19
    assert window.shape == (1, 1, 1, 20) and int((window == 0).sum()) == 12
    earlier = position_masks(lm.model, torch.tensor([[15]]), 20, torch.float32)
    assert int((earlier["full_attention"] == 0).sum()) == 16  # an earlier row must not see later ones


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_decode_steps_equal_a_full_forward(arch, monkeypatch):
    """Each single-token step over the cache gives the logits a full forward gives at that position
    (gemma3's sliding window is 12 rows, shorter than the 30-token prompt), through the one-row path."""
    from cacheclip_rag.stages.recompute import attention

    calls = []
    monkeypatch.setattr(attention, "one_row_attention",
                        lambda *a, **k: calls.append(1) or one_row_attention(*a, **k))
    lm = tiny_model(arch)
    ids = torch.randint(5, 300, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = lm.model(input_ids=ids).logits[0]
    cache = new_cache(lm, 30)
    forward_at(lm.model, cache, ids[:, :24], torch.arange(24)[None])
    for position in range(24, 30):
        step = forward_at(lm.model, cache, ids[:, position:position + 1], torch.tensor([[position]]))[0, -1]
        assert torch.allclose(step, full[position], atol=1e-4), (step - full[position]).abs().max()
    assert len(calls) == 6 * lm.config.num_hidden_layers  # every layer of every step took it


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_probed_attention_by_kv_head_equals_eager_attention_over_repeated_keys(softcap):
    """The probed (eager, with weights) path runs each KV head's query heads as one mm against its unrepeated
    keys: its weights and outputs equal attention over repeated keys, for several rows, sequences and a
    strided cache slice."""
    from cacheclip_rag.stages.recompute.attention import _eager_with_weights

    torch.manual_seed(2)
    query = torch.randn(2, 5, 8, 16).transpose(1, 2)  # transformers' layout: a transposed view
    room_k, room_v = torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    key, value = room_k[:, :, :40], room_v[:, :, :40]  # the cache's strided slice
    allowed = torch.rand(2, 1, 5, 40) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, probs = _eager_with_weights(None, query, key, value, additive, scaling=0.25, softcap=softcap)
    group = 4
    scores = query.double() @ repeat_kv(key, group).double().transpose(2, 3) * 0.25
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    expected_probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    expected = (expected_probs @ repeat_kv(value, group).double()).transpose(1, 2)
    assert probs.shape == (2, 8, 5, 40) and out.shape == (2, 5, 8, 16)
    assert torch.allclose(probs.double(), expected_probs, atol=1e-6)
    assert torch.allclose(out.double(), expected, atol=1e-5)
