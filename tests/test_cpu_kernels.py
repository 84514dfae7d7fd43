"""The CPU decode kernels (cpu_kernels.py, csrc/cpu_decode.cpp) against float64 references and the torch
paths they replace. On a CPU with AVX-512 BF16 and a compiler they must build; elsewhere these are skipped
and `available()` must say why."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from cacheclip_rag import cpu_kernels
from cacheclip_rag import decode_step as lean
from cacheclip_rag.attention import one_row_attention
from cacheclip_rag.cache import BlendedCache
from cacheclip_rag.packed_linear import PackedLinear, pack_linears, packing_available
from cacheclip_rag.recompute import forward_at

BF16_CPU = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
needs_kernels = pytest.mark.skipif(not (BF16_CPU and cpu_kernels.available()),
                                   reason=f"CPU decode kernels not available: {cpu_kernels._state.get('reason')}")


def test_kernels_build_where_they_can():
    """Where the CPU has AVX-512 BF16 and a compiler is on PATH, the build must succeed: a silent fallback
    would hide a broken kernel behind torch's slower path."""
    if not BF16_CPU or shutil.which("c++") is None:
        assert not cpu_kernels.available() or BF16_CPU
        pytest.skip("no AVX-512 BF16 or no compiler here")
    assert cpu_kernels.available(), cpu_kernels._state.get("reason")


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("CACHECLIP_CPU_KERNELS", "0")
    assert cpu_kernels._why_not() == "CACHECLIP_CPU_KERNELS=0"


@needs_kernels
@pytest.mark.parametrize("out_features,in_features,bias", [(64, 32, False), (200, 96, True), (896, 896, True),
                                                           (1000, 4864, False), (3, 64, True)])
def test_packed_gemv_matches_float64(out_features, in_features, bias):
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.gemv_address is not None  # the layout check accepted oneDNN's packing
    x = torch.randn(1, 1, in_features).to(torch.bfloat16)
    expected = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    got = packed(x)
    assert got.shape == (1, 1, out_features) and got.dtype == torch.bfloat16
    scale = expected.abs().max()
    assert (got.double() - expected).abs().max() <= 2 ** -7 * scale  # one bf16 rounding of the output
    cpu_kernels.set_enabled(False)
    try:
        onednn = packed(x)
    finally:
        cpu_kernels.set_enabled(True)
    assert (got.double() - onednn.double()).abs().max() <= 2 ** -7 * scale


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40])
def test_packed_gemv_for_few_rows(rows):
    """Up to GEMV_MAX_ROWS rows (a decode batch) take the kernel, more keep oneDNN; either way each row
    matches float64 and the same row run alone, to bf16 rounding."""
    torch.manual_seed(rows)
    linear = nn.Linear(128, 192).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 128).to(torch.bfloat16)
    calls = {"n": 0}
    kernel = cpu_kernels.packed_gemv

    def counted(*args):
        calls["n"] += 1
        return kernel(*args)

    cpu_kernels.packed_gemv = counted
    try:
        many = packed(x)
    finally:
        cpu_kernels.packed_gemv = kernel
    assert calls["n"] == (1 if rows <= cpu_kernels.GEMV_MAX_ROWS else 0)
    expected = x.double() @ linear.weight.double().t() + linear.bias.double()
    scale = expected.abs().max()
    assert (many.double() - expected).abs().max() <= 2 ** -7 * scale
    for r in range(rows):
        assert (packed(x[:, r:r + 1]).double() - many[:, r:r + 1].double()).abs().max() <= 2 ** -7 * scale


@needs_kernels
def test_odd_width_keeps_onednn():
    linear = nn.Linear(33, 64).to(torch.bfloat16)
    assert PackedLinear(linear).gemv_address is None


def _reference(query, key, value, scaling):
    heads, kv_heads = query.shape[1], key.shape[1]
    k = key.double().repeat_interleave(heads // kv_heads, dim=1)
    v = value.double().repeat_interleave(heads // kv_heads, dim=1)
    probs = torch.softmax(query.double() @ k.transpose(-1, -2) * scaling, dim=-1)
    return (probs @ v).transpose(1, 2)  # [1, 1, H, D]


@needs_kernels
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 14, 2, 64), (17, 8, 2, 32), (130, 4, 1, 64),
                                                      (600, 14, 2, 64), (2049, 16, 8, 128), (513, 7, 7, 64),
                                                      (1500, 4, 1, 64)])
def test_one_row_attention_matches_float64(rows, heads, kv_heads, dim):
    """Over a strided cache slice (room to grow, as a decode cache holds), every GQA grouping, key counts
    that are not multiples of the kernel's 16-key and 128-key tiles, and (one KV head, 1,500 keys) key ranges
    split over the threads and merged."""
    torch.manual_seed(rows + heads)
    cache_k = torch.randn(1, kv_heads, rows + 40, dim).to(torch.bfloat16)
    cache_v = torch.randn(1, kv_heads, rows + 40, dim).to(torch.bfloat16)
    query = (2 * torch.randn(1, heads, 1, dim)).to(torch.bfloat16)
    key, value = cache_k[:, :, :rows], cache_v[:, :, :rows]
    assert cpu_kernels.attention_applies(query, key, value)
    got = one_row_attention(query, key, value, None, scaling=dim ** -0.5, softcap=None)
    expected = _reference(query, key, value, dim ** -0.5)
    assert got.shape == (1, 1, heads, dim)
    assert (got.double() - expected).abs().max() <= 2 ** -7 * expected.abs().max() + 1e-3
    cpu_kernels.set_enabled(False)
    try:
        torch_path = one_row_attention(query, key, value, None, scaling=dim ** -0.5, softcap=None)
    finally:
        cpu_kernels.set_enabled(True)
    assert (got.double() - torch_path.double()).abs().max() <= 2 ** -6 * expected.abs().max() + 1e-3


@needs_kernels
def test_attention_kernel_declines_what_it_does_not_take():
    query = torch.randn(1, 4, 1, 64).to(torch.bfloat16)
    key = torch.randn(1, 2, 10, 64).to(torch.bfloat16)
    assert not cpu_kernels.attention_applies(query.float(), key.float(), key.float())  # not bf16
    assert not cpu_kernels.attention_applies(query[..., :48], key[..., :48], key[..., :48])  # width 48
    assert not cpu_kernels.attention_applies(torch.cat([query, query], 2), key, key)  # two rows
    assert not cpu_kernels.attention_applies(query, key.transpose(2, 3).contiguous().transpose(2, 3), key)


@needs_kernels
@pytest.mark.skipif(not packing_available(), reason="oneDNN bf16 packing unavailable")
def test_decode_steps_agree_with_kernels_on_and_off():
    """A small Qwen2 (head width 32) in bf16, prepacked: decode steps over copies of one cache give logits
    equal to bf16 rounding with the kernels and without, and both kernels ran."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    assert pack_linears(model) == 2 * 7 + 1
    assert all(m.gemv_address is not None for m in model.modules() if isinstance(m, PackedLinear))
    prompt = 70
    cache = BlendedCache.empty(2, 1, 2, prompt + 8, 32, dtype=torch.bfloat16, device="cpu")
    forward_at(model, cache, (torch.arange(prompt) % 97 + 3)[None], torch.arange(prompt)[None])

    def steps(own: BlendedCache) -> list[torch.Tensor]:
        return [lean.decode_step(model, own, 5 + k, prompt + k).float() for k in range(4)]

    calls = {"attention": 0}
    kernel = cpu_kernels.one_row_attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return kernel(*args, **kwargs)

    cpu_kernels.one_row_attention = counted
    try:
        on = steps(cache.copy())
    finally:
        cpu_kernels.one_row_attention = kernel
    assert calls["attention"] == 4 * 2  # every layer of every step
    cpu_kernels.set_enabled(False)
    try:
        off = steps(cache.copy())
    finally:
        cpu_kernels.set_enabled(True)
    for a, b in zip(on, off):
        assert (a - b).abs().max() <= 0.05 * b.abs().max()
