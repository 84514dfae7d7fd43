"""The CPU kernels (cpu_kernels.py, csrc/cpu_kernels.cpp) against float64 references and the torch paths
they replace. On a CPU with AVX-512 BF16 and a compiler they must build; elsewhere these are skipped
and `available()` must say why."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from cacheclip_rag.models import cpu_kernels
from cacheclip_rag.stages.decode import step as lean
from cacheclip_rag.stages.recompute.attention import one_row_attention
from cacheclip_rag.stages.cache import BlendedCache
from cacheclip_rag.models.packed_linear import PackedLinear, pack_linears, packing_available
from cacheclip_rag.stages.recompute.forward import forward_at

BF16_CPU = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
needs_kernels = pytest.mark.skipif(not (BF16_CPU and cpu_kernels.available()),
                                   reason=f"CPU kernels not available: {cpu_kernels._state.get('reason')}")


def test_kernels_build_where_they_can():
    """Where the CPU has AVX-512 BF16 and a compiler is on PATH, the build must succeed: a silent fallback
    would hide a broken kernel behind torch's slower path."""
    if not BF16_CPU:
        assert not cpu_kernels.available()
        pytest.skip("no AVX-512 BF16 here")
    if shutil.which("c++") is None:
        pytest.skip("no compiler here")
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
@pytest.mark.parametrize("rows_hint", [1, 64])
def test_packed_gemv_reads_the_layout_of_either_row_hint(rows_hint):
    """oneDNN lays a weight out by the rows it is packed for (in blocks of 64 outputs for one row, of 32 for many
    on AMX): the kernel reads whichever it gets, and a weight packed only for that hint keeps it."""
    torch.manual_seed(rows_hint)
    linear = nn.Linear(256, 320, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear, (rows_hint,))
    assert packed.rows_hint == rows_hint and packed.gemv_address is not None and packed.gemv_block in (32, 64)
    x = torch.randn(3, 256).to(torch.bfloat16)
    expected = x.double() @ linear.weight.double().t() + linear.bias.double()
    assert (packed(x).double() - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    other = 96 - packed.gemv_block  # the other block width reads the weight wrongly: the check is not vacuous
    wrong = cpu_kernels.packed_gemv(x, packed.gemv_address, 256, 320, packed._bias_for_kernel(), other)
    assert (wrong.double() - expected).abs().max() > 0.1 * expected.abs().max()
    with pytest.raises(RuntimeError, match="a block of 32 or 64 outputs"):
        cpu_kernels.packed_gemv(x, packed.gemv_address, 256, 320, None, 48)


@needs_kernels
def test_odd_width_keeps_onednn():
    linear = nn.Linear(33, 64).to(torch.bfloat16)
    assert PackedLinear(linear).gemv_address is None


def small_bf16_qwen2() -> Qwen2ForCausalLM:
    """A two-layer bf16 Qwen2 of head width 32 (4 query heads, 2 KV heads), random weights: the kernels' shapes."""
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


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
    model = small_bf16_qwen2()
    assert pack_linears(model) == 2 * 7 + 1
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    # every linear of more than one 64-output block reads its weight in place; a single block (k_proj, v_proj
    # here) oneDNN lays out otherwise at some thread counts (2 here, not 1), and the product check then leaves it
    # to oneDNN: the steps below agree either way
    assert all(m.gemv_address is not None for m in packed if m.out_features > 64)
    assert all(m.out_features == 64 for m in packed if m.gemv_address is None)
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


def _positioned_reference(query, positions, key, value, scaling):
    heads, kv_heads = query.shape[1], key.shape[1]
    k = key.double().repeat_interleave(heads // kv_heads, dim=1)
    v = value.double().repeat_interleave(heads // kv_heads, dim=1)
    visible = torch.arange(key.shape[2])[None, :] <= positions[:, None]  # [T, N]
    scores = (query.double() @ k.transpose(-1, -2) * scaling).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)  # [1, T, H, D]


def _sdpa_error(query, positions, key, value, scaling, expected):
    """torch's own bf16 path on the same input: the error the kernel may match."""
    heads, kv_heads = query.shape[1], key.shape[1]
    visible = torch.arange(key.shape[2])[None, :] <= positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1),
        attn_mask=visible, scale=scaling).transpose(1, 2)
    return (out.double() - expected).abs().max()


@needs_kernels
@pytest.mark.parametrize("keys,rows,heads,kv_heads,dim,layout", [
    (300, 300, 14, 2, 64, "causal"), (77, 77, 4, 4, 32, "causal"), (513, 513, 16, 8, 128, "causal"),
    (1000, 37, 14, 2, 64, "scattered"), (260, 9, 32, 1, 64, "scattered"), (129, 5, 7, 1, 128, "last")])
def test_positioned_attention_matches_float64(keys, rows, heads, kv_heads, dim, layout):
    """Causal prefills (row t at position t), scattered recompute rows at sorted positions, and rows at the
    cache's end; key counts off the 16- and 64-key tiles, row counts off the 4-row blocks, GQA groups 1 to
    32, widths 32/64/128, strided cache slices. The error is at most torch's own bf16 sdpa's, doubled."""
    torch.manual_seed(keys + rows)
    cache_k = torch.randn(1, kv_heads, keys + 24, dim).to(torch.bfloat16)
    cache_v = torch.randn(1, kv_heads, keys + 24, dim).to(torch.bfloat16)
    key, value = cache_k[:, :, :keys], cache_v[:, :, :keys]
    query = (2 * torch.randn(1, heads, rows, dim)).to(torch.bfloat16)
    if layout == "causal":
        positions = torch.arange(rows)
    elif layout == "scattered":
        positions = torch.randperm(keys)[:rows].sort().values
    else:
        positions = torch.arange(keys - rows, keys)
    assert cpu_kernels.positioned_applies(query, key, value)
    got = cpu_kernels.positioned_attention(query, positions, key, value, dim ** -0.5)
    expected = _positioned_reference(query, positions, key, value, dim ** -0.5)
    assert got.shape == (1, rows, heads, dim)
    error = (got.double() - expected).abs().max()
    assert error <= 2 * _sdpa_error(query, positions, key, value, dim ** -0.5, expected) + 1e-3, error
    if layout == "causal":
        assert torch.equal(got[0, 0], value[0, :, 0].repeat_interleave(heads // kv_heads, 0))  # row 0 sees key 0


@needs_kernels
def test_prefill_and_recompute_take_the_kernel_and_agree_with_torch(monkeypatch):
    """A small bf16 Qwen2 (head width 32): a causal prefill and recomputes of scattered rows through
    `forward_at` (many rows, which torch's path runs by row blocks; few rows, by sdpa with the mask) call the
    kernel in every layer, and give logits and cache rows equal to torch's paths to bf16 rounding."""
    from cacheclip_rag.stages.recompute import blocked_attention as blocked_module
    from cacheclip_rag.stages.recompute import attention

    torch.manual_seed(0)
    model = small_bf16_qwen2()
    monkeypatch.setattr(blocked_module, "PACKED_ROWS_PER_BLOCK", 24)  # blocks for 40 rows of 2 heads a group
    ids = torch.randint(5, 250, (1, 160), generator=torch.Generator().manual_seed(1))
    rows = torch.randperm(160, generator=torch.Generator().manual_seed(2))[:40].sort().values
    calls = []
    real = cpu_kernels.positioned_attention
    monkeypatch.setattr(cpu_kernels, "positioned_attention", lambda *a: calls.append(a[1].numel()) or real(*a))
    monkeypatch.setattr(cpu_kernels, "torch_attention_is_faster", lambda: False)  # the kernel's path, on any CPU

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = BlendedCache.empty(2, 1, 2, 160, 32, dtype=torch.bfloat16, device="cpu")
        full = forward_at(model, cache, ids, torch.arange(160)[None], logits_to_keep=160).float()
        again = forward_at(model, cache, ids[:, rows], rows[None], logits_to_keep=40).float()
        few = forward_at(model, cache, ids[:, rows[-3:]], rows[-3:][None], logits_to_keep=3).float()
        return full, again, few, cache.key_buffer.float()

    on = run()
    assert calls == [160, 160, 40, 40, 3, 3]  # both layers of the prefill and of each recompute
    cpu_kernels.set_enabled(False)
    try:
        off = run()
    finally:
        cpu_kernels.set_enabled(True)
    assert attention.cpu_kernels is cpu_kernels
    for a, b in zip(on, off):
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()


@needs_kernels
def test_a_batch_of_prefills_takes_the_kernel_per_request_and_equals_each_alone(monkeypatch):
    """`forward_rows` over two prefills and a recompute of scattered rows (a bf16 Qwen2, head width 32): each
    request's segment of several rows goes to the kernel at its own positions over its own cache (a single-row
    segment does not), and every request's logits and cache equal `forward_at` run on it alone, to bf16
    rounding of the batched products."""
    from cacheclip_rag.stages.decode.batching import RowsRequest, forward_rows

    torch.manual_seed(0)
    model = small_bf16_qwen2()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 250, (90,), generator=g)
    loaded = BlendedCache.empty(2, 1, 2, 96, 32, dtype=torch.bfloat16, device="cpu")
    forward_at(model, loaded, prompt[None], torch.arange(90)[None])
    scattered = torch.cat([torch.randperm(80, generator=g)[:20].sort().values, torch.arange(80, 90)])

    def requests() -> list[RowsRequest]:
        return [RowsRequest(BlendedCache.empty(2, 1, 2, 70, 32, dtype=torch.bfloat16, device="cpu"),
                            torch.randint(5, 250, (70,), generator=torch.Generator().manual_seed(4)), torch.arange(70)),
                RowsRequest(loaded.copy(), prompt[scattered], scattered),
                RowsRequest(BlendedCache.empty(2, 1, 2, 33, 32, dtype=torch.bfloat16, device="cpu"),
                            torch.randint(5, 250, (33,), generator=torch.Generator().manual_seed(5)), torch.arange(33)),
                RowsRequest(loaded.copy(), prompt[89:90], torch.tensor([89]))]

    calls = []
    real = cpu_kernels.positioned_attention
    monkeypatch.setattr(cpu_kernels, "positioned_attention",
                        lambda *a: calls.append((a[1].tolist(), a[2].shape[2])) or real(*a))
    monkeypatch.setattr(cpu_kernels, "torch_attention_is_faster", lambda: False)  # the kernel's path, on any CPU
    batch = requests()
    got = forward_rows(model, batch)
    per_layer = [(list(range(70)), 70), (scattered.tolist(), 90), (list(range(33)), 33)]  # keys: each cache's own
    assert calls == per_layer * 2  # both layers; the one-row segment kept its own path
    alone = requests()
    for r, logits in zip(alone, got):
        want = forward_at(model, r.cache, r.input_ids[None], r.positions[None])[0, -1].float()
        assert (logits.float() - want).abs().max() <= 0.03 * want.abs().max()
    for r, s in zip(batch, alone):
        assert (r.cache.key_buffer.float() - s.cache.key_buffer.float()).abs().max() <= 0.03 * s.cache.key_buffer.float().abs().max()


@needs_kernels
@pytest.mark.parametrize("amx", [True, False])
def test_prefill_and_recompute_rows_keep_torch_attention_on_amx(monkeypatch, amx):
    """Where AMX tiles run torch's attention faster (`torch_attention_is_faster`), neither a causal prefill nor
    recompute rows at scattered positions call the kernel, and the logits are torch's; without AMX both call
    it."""
    torch.manual_seed(0)
    model = small_bf16_qwen2()
    ids = torch.randint(5, 250, (1, 96), generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([3, 17, 40, 41, 42, 90, 95])
    calls = []
    real = cpu_kernels.positioned_attention
    monkeypatch.setattr(cpu_kernels, "positioned_attention", lambda *a: calls.append(a[1].numel()) or real(*a))
    monkeypatch.setattr(cpu_kernels, "torch_attention_is_faster", lambda: amx)

    def run() -> torch.Tensor:
        cache = BlendedCache.empty(2, 1, 2, 96, 32, dtype=torch.bfloat16, device="cpu")
        forward_at(model, cache, ids, torch.arange(96)[None])
        return forward_at(model, cache, ids[:, rows], rows[None])[0, -1].float()

    logits = run()
    assert calls == ([] if amx else [96, 96, 7, 7])
    cpu_kernels.set_enabled(False)
    try:
        plain = run()
    finally:
        cpu_kernels.set_enabled(True)
    if amx:
        assert torch.equal(logits, plain)  # torch's paths exactly
    else:
        assert (logits - plain).abs().max() <= 0.05 * plain.abs().max()


def test_the_amx_probe_reads_torch():
    assert cpu_kernels.torch_attention_is_faster() == bool(torch.cpu._is_amx_tile_supported())


# ---- inputs the kernels must refuse, or handle, without crashing or hanging (issue 70) -------------------------


@needs_kernels
def test_rows_at_or_past_the_last_key_see_the_keys_that_exist_and_no_padding():
    """The last 16-key tile is padded with zero keys; a row at position >= N must not attend to them (each would
    add exp(0 - max) of a zero value to its softmax)."""
    torch.manual_seed(7)
    keys, heads, kv_heads, dim = 37, 4, 2, 64
    key = torch.randn(1, kv_heads, keys, dim).to(torch.bfloat16)
    value = (torch.randn(1, kv_heads, keys, dim) + 3).to(torch.bfloat16)  # far from the padding's zeros
    # one query in four rows (small scores: the padding's 0 would weigh)
    query = (0.1 * torch.randn(1, heads, 1, dim)).expand(1, heads, 4, dim).contiguous().to(torch.bfloat16)
    positions = torch.tensor([keys - 1, keys, keys + 5, keys + 40])
    got = cpu_kernels.positioned_attention(query, positions, key, value, dim ** -0.5)
    expected = _positioned_reference(query, positions.clamp(max=keys - 1), key, value, dim ** -0.5)
    assert (got.double() - expected).abs().max() <= 0.02 * expected.abs().max()
    assert torch.equal(got[0, 1:], got[0, :1].expand(3, -1, -1))  # every such row sees exactly the N keys


REFUSALS = """
import torch
from cacheclip_rag.models import cpu_kernels
assert cpu_kernels.available(), cpu_kernels._state
bf = dict(dtype=torch.bfloat16)
ops = torch.ops.cacheclip_cpu
cases = {
    "positioned, no kv heads": lambda: ops.positioned_attention(torch.zeros(4, 3, 64, **bf), torch.arange(3),
                                                                torch.zeros(0, 8, 64, **bf), torch.zeros(0, 8, 64, **bf), 1.0),
    "positioned, no heads": lambda: ops.positioned_attention(torch.zeros(0, 3, 64, **bf), torch.arange(3),
                                                             torch.zeros(2, 8, 64, **bf), torch.zeros(2, 8, 64, **bf), 1.0),
    "positioned, rank 1 query": lambda: ops.positioned_attention(torch.zeros(64, **bf), torch.arange(1),
                                                                 torch.zeros(2, 8, 64, **bf), torch.zeros(2, 8, 64, **bf), 1.0),
    "one row, no kv heads": lambda: ops.one_row_attention(torch.zeros(4, 64, **bf), torch.zeros(0, 8, 64, **bf),
                                                          torch.zeros(0, 8, 64, **bf), 1.0),
    "one row, no heads": lambda: ops.one_row_attention(torch.zeros(0, 64, **bf), torch.zeros(2, 8, 64, **bf),
                                                       torch.zeros(2, 8, 64, **bf), 1.0),
    "positioned, not on the CPU": lambda: ops.positioned_attention(
        torch.zeros(4, 3, 64, device="meta", **bf), torch.arange(3, device="meta"),
        torch.zeros(2, 8, 64, device="meta", **bf), torch.zeros(2, 8, 64, device="meta", **bf), 1.0),
    "one row, not on the CPU": lambda: ops.one_row_attention(torch.zeros(4, 64, **bf),
                                                             torch.zeros(2, 8, 64, device="meta", **bf),
                                                             torch.zeros(2, 8, 64, device="meta", **bf), 1.0),
    "gemv, not on the CPU": lambda: ops.packed_gemv(torch.zeros(1, 64, device="meta", **bf), 1, 64, 64, None),
}
for name, call in cases.items():
    try:
        call()
        print(name, "| ran")
    except RuntimeError as error:
        print(name, "| refused:", str(error).splitlines()[0])
"""


@needs_kernels
def test_bad_shapes_and_devices_are_refused_with_an_error_not_a_crash(tmp_path):
    """A zero head count once reached `% kv_heads` (SIGFPE: the process died, no exception); a tensor on
    another device was read as host memory. Run in a child: a crash there fails this test, not the suite."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stdout.splitlines() if "|" in line]
    assert len(lines) == 8, done.stdout
    for line in lines:
        assert "| refused:" in line, line
        if "not on the CPU" in line:
            assert "CPU tensors" in line, line
        else:
            assert "shape" in line, line


@needs_kernels
def test_packed_gemv_refuses_the_wrong_width_and_takes_an_empty_batch():
    linear = nn.Linear(96, 200).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.gemv_address is not None
    with pytest.raises(RuntimeError, match="width 98 for a weight of width 96"):
        cpu_kernels.packed_gemv(torch.zeros(1, 98, dtype=torch.bfloat16), packed.gemv_address, 96, 200, None)
    empty = cpu_kernels.packed_gemv(torch.zeros(0, 96, dtype=torch.bfloat16), packed.gemv_address, 96, 200, None)
    assert empty.shape == (0, 200)
    assert packed(torch.zeros(1, 0, 96, dtype=torch.bfloat16)).shape == (1, 0, 200)  # as nn.Linear


def test_a_dead_builds_lock_is_removed_and_a_live_ones_wait_is_bounded(tmp_path):
    import os
    import time

    from cacheclip_rag.models import kernel_build

    lock = tmp_path / "lock"
    assert kernel_build.lock_cleared(lock, wait_s=0.0)  # no lock
    lock.touch()
    old = time.time() - 2 * kernel_build.STALE_LOCK_S
    os.utime(lock, (old, old))
    assert kernel_build.lock_cleared(lock, wait_s=0.0) and not lock.exists()  # a dead build's: removed
    lock.touch()  # a live build's
    started = time.monotonic()
    assert not kernel_build.lock_cleared(lock, wait_s=0.3, poll_s=0.05)
    assert time.monotonic() - started < 5 and lock.exists()  # bounded, and left to its owner


def test_a_lost_speed_up_is_logged_at_warning(monkeypatch, tmp_path, caplog):
    """Where the CPU could run the kernels, not building them loses their speed-up: said at WARNING, once."""
    from torch.utils import cpp_extension

    saved = dict(cpu_kernels._state)
    monkeypatch.setattr(cpu_kernels, "_why_not", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_build_lock", lambda name=cpu_kernels.NAME: tmp_path / "lock")

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'cacheclip_cpu_kernels'")

    monkeypatch.setattr(cpp_extension, "load", broken)
    cpu_kernels._state.clear()
    try:
        with caplog.at_level("INFO", logger=cpu_kernels.__name__):
            assert not cpu_kernels.available() and not cpu_kernels.available()
        said = [r for r in caplog.records if "not used" in r.getMessage()]
        assert len(said) == 1 and "the build failed" in said[0].getMessage()
        assert said[0].levelname == ("WARNING" if cpu_kernels._could_run() else "INFO")
    finally:
        cpu_kernels._state.clear()
        cpu_kernels._state.update(saved)
