"""Selected-rows attention kernel vs its pure-torch reference on fresh random inputs.

On a CPU machine the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest),
so shapes are small; on CUDA the same tests run compiled. Tolerances: fp32 1e-4 (same math,
another summation order, online softmax rescaling); fp16 3e-3 absolute on outputs of magnitude
<= 1 (fp16 has 11 bits of mantissa: ~5e-4 per rounding, a few roundings in P@V).
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from cacheclip_rag.kernels.selected_attention import selected_attention, selected_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def on_device(lm):
    """The tiny model where the kernel runs: compiled on CUDA (a CPU model under a CUDA kernel fails
    as "cpu tensor?", which says nothing about the kernel), interpreted on a CPU machine."""
    lm.model.to(DEVICE)
    return lm


def sorted_positions(batch, rows, length, generator):
    return torch.stack([torch.randperm(length, generator=generator)[:rows].sort().values for _ in range(batch)])


def run_case(dtype, heads=4, kv_heads=2, dim=32, length=37, rows=13, softcap=None, window=None, positions=None, seed=0,
             tiles=(16, 16), splits=None, tol=None):
    g = torch.Generator().manual_seed(seed)
    b = 2
    q = torch.randn(b, heads, rows, dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(b, kv_heads, length, dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(b, kv_heads, length, dim, generator=g).to(dtype).to(DEVICE)
    pos = (sorted_positions(b, rows, length, g) if positions is None else positions).to(DEVICE)
    scale = dim ** -0.5
    got = selected_attention(q, k, v, pos, scale, softcap, window, block_m=tiles[0], block_n=tiles[1], num_splits=splits)
    ref = selected_attention_reference(q, k, v, pos, scale, softcap, window)
    assert got.shape == ref.shape == (b, rows, heads, dim)
    err = (got.float() - ref.float()).abs().max().item() if rows else 0.0
    assert err < (tol or TOL[dtype]), err
    return got, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scattered_rows_with_gqa_and_ragged_length(dtype):
    run_case(dtype)


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (6, 2, 64), (2, 1, 128)])
def test_head_layouts(dtype, heads, kv_heads, dim):
    run_case(dtype, heads=heads, kv_heads=kv_heads, dim=dim, length=29, rows=9)


def test_empty_selection():
    got, _ = run_case(torch.float32, rows=0)
    assert got.numel() == 0


def test_all_rows_selected_is_causal_attention():
    length = 33
    pos = torch.arange(length).expand(2, -1)
    got, _ = run_case(torch.float32, length=length, rows=length, positions=pos)
    # and equals torch's own causal sdpa
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, length, 32, generator=g)
    k = torch.randn(2, 2, length, 32, generator=g)
    v = torch.randn(2, 2, length, 32, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert (got.cpu() - sdpa.transpose(1, 2)).abs().max() < 1e-4


def test_query_whose_window_holds_one_key():
    got, ref = run_case(torch.float32, window=1)
    # with window 1 every row sees only its own key: output = that key's value
    g = torch.Generator().manual_seed(0)
    torch.randn(2, 4, 13, 32, generator=g)
    k = torch.randn(2, 2, 37, 32, generator=g)
    v = torch.randn(2, 2, 37, 32, generator=g)
    pos = sorted_positions(2, 13, 37, g)
    own = torch.stack([v[b, :, pos[b]] for b in range(2)]).repeat_interleave(2, 1).transpose(1, 2)
    assert (got.cpu() - own).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window(dtype):
    run_case(dtype, window=5, length=70, rows=20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap(dtype):
    got, _ = run_case(dtype, softcap=2.0, seed=3)
    ref_uncapped = run_case(dtype, seed=3)[1]
    assert (got.float() - ref_uncapped.float()).abs().max() > 1e-2  # the cap changes the result


def test_contiguous_runs_like_grouping_output():
    runs = torch.cat([torch.arange(s, s + 8) for s in (3, 20, 21 + 8, 50)])
    pos = runs.unique().sort().values.expand(2, -1)
    run_case(torch.float32, length=64, rows=pos.shape[1], positions=pos)


@pytest.mark.parametrize("heads,kv_heads", [(5, 1), (10, 2)])
def test_five_query_heads_per_kv_head_pack_into_one_tile(heads, kv_heads):
    """GQA packing: (row, head) pairs of a kv head share a tile; 5 is not a power of two, so tiles end
    mid-row and rows straddle tiles."""
    run_case(torch.float32, heads=heads, kv_heads=kv_heads, length=45, rows=11)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_keys_merge_to_the_same_output(splits):
    """Question-only forwards split the keys across programs; the partials must merge exactly, also
    for rows that see nothing in some splits (causal and window edges)."""
    run_case(torch.float32, length=70, rows=6, splits=splits)
    run_case(torch.float32, length=70, rows=9, splits=splits, window=9, softcap=3.0, heads=5, kv_heads=1)


def test_bulk_blocks_below_the_first_row_use_the_unmasked_path():
    """Rows late in a long context: most key blocks lie wholly below every row (the unmasked bulk
    loop), the rest are masked edges; the default tile table is used (one tile covers all rows)."""
    pos = torch.arange(150, 200, 3).expand(2, -1)
    run_case(torch.float32, length=200, rows=pos.shape[1], positions=pos, tiles=(None, None))
    run_case(torch.float32, length=200, rows=pos.shape[1], positions=pos, tiles=(16, 16), window=40)


def test_window_and_softcap_together():
    run_case(torch.float32, window=6, softcap=1.5, length=60, rows=17, heads=6, kv_heads=2)


def test_head_dim_256():
    run_case(torch.float32, heads=2, kv_heads=1, dim=256, length=21, rows=5, tiles=(16, 16))


def test_unsorted_or_out_of_range_positions_are_rejected():
    q, k = torch.randn(1, 2, 3, 32, device=DEVICE), torch.randn(1, 1, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="sorted"):
        selected_attention(q, k, k, torch.tensor([[5, 2, 6]], device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="within"):
        selected_attention(q, k, k, torch.tensor([[1, 2, 8]], device=DEVICE), 1.0)


def test_bad_shapes_are_rejected():
    q = torch.randn(1, 3, 4, 32)
    k = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        selected_attention(q, k, k, torch.zeros(1, 4, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="positions"):
        selected_attention(torch.randn(1, 2, 4, 32), k, k, torch.zeros(1, 3, dtype=torch.long), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled bf16 needs CUDA (the interpreter's bf16 dot is wrong)")
@pytest.mark.parametrize("tiles", [(64, 64), (None, None)], ids=["64x64", "tuned"])
@pytest.mark.parametrize("dim,window,softcap", [(128, None, None), (256, None, None), (128, 300, 30.0), (256, 300, 30.0)])
def test_bf16_compiled_matches_the_reference(tiles, dim, window, softcap):
    """bf16 on the GPU, 5 query heads per kv head, a context of several key tiles with grouped runs.
    Tolerance 2e-2: bf16 has 8 bits of mantissa (~4e-3 per rounding); P is rounded to bf16 before P@V."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randperm(1400 // 8, generator=g)[:40].sort().values * 8
    pos = torch.cat([torch.arange(s, s + 8) for s in starts.tolist()] + [torch.arange(1400, 1432)])
    run_case(torch.bfloat16, heads=10, kv_heads=2, dim=dim, length=1432, rows=pos.numel(), positions=pos.expand(2, -1),
             window=window, softcap=softcap, tiles=tiles, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_question_only_rows_split_the_keys():
    pos = torch.arange(4000, 4032).expand(1, -1)
    run_case(torch.bfloat16, heads=40, kv_heads=8, dim=128, length=4032, rows=32, positions=pos.expand(2, -1),
             tiles=(None, None), tol=2e-2)


def test_no_position_mask_is_built_under_the_kernel(make_engine, monkeypatch):
    """The kernel masks by position: the recompute forward must not build a [Tq, N] mask."""
    from cacheclip_rag.stages.recompute import forward as recompute
    from cacheclip_rag.config import RequestOptions
    from cacheclip_rag.testing import tiny_model
    from tests.conftest import CHUNKS, QUESTION

    engine = make_engine(on_device(tiny_model("llama")))
    calls = []
    engine.kernel = lambda *a, **k: calls.append(1) or selected_attention(*a, **k)
    engine.ingest(CHUNKS, progress=False)
    built = []
    original = recompute.position_masks
    monkeypatch.setattr(recompute, "position_masks", lambda *a, **k: built.append(1) or original(*a, **k))
    engine.generate(QUESTION, CHUNKS, RequestOptions(method="shared_prefix", max_new_tokens=1))
    assert len(calls) == engine.primary.config.num_hidden_layers and built == []


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kernel_in_the_recompute_path_matches_sdpa(arch, make_engine):
    """Plugged in through the attention function, the kernel gives the engine's sdpa answer."""
    from cacheclip_rag.config import RequestOptions
    from cacheclip_rag.testing import tiny_model
    from tests.conftest import CHUNKS, QUESTION

    engine = make_engine(on_device(tiny_model(arch)))
    opts = RequestOptions(method="cacheclip", ratio=0.4, max_new_tokens=1)
    plain = engine.generate(QUESTION, CHUNKS, opts)
    engine.kernel = selected_attention
    fused = engine.generate(QUESTION, CHUNKS, opts)
    assert fused.recomputed_tokens == plain.recomputed_tokens > 0
    assert (fused.first_logits - plain.first_logits).abs().max() < 1e-4


def test_cuda_without_triton_warns_and_falls_back(monkeypatch):
    """An engine on CUDA without Triton would silently take the slow masked path: it must say so."""
    from types import SimpleNamespace

    from cacheclip_rag.engine.core import default_kernel
    from cacheclip_rag.kernels import selected_attention as module

    monkeypatch.setattr(module, "triton", None)
    with pytest.warns(RuntimeWarning, match="Triton is not installed"):
        assert default_kernel(SimpleNamespace(device=torch.device("cuda"))) is None
    assert default_kernel(SimpleNamespace(device=torch.device("cpu"))) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tier_stages_through_reused_pinned_buffers(tmp_path):
    from cacheclip_rag.store import ChunkEntry, LMDBStore
    from cacheclip_rag.store.tiers import DeviceTier

    entries = [ChunkEntry(torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16), tuple(range(n)),
                          tuple((i, i + 1) for i in range(n))) for n in (5, 40, 7, 33, 12, 9)]
    with LMDBStore(tmp_path) as store:
        for i, e in enumerate(entries):
            store.put(bytes([i]) * 32, "m", e)
        tier = DeviceTier(store, "cuda", 1 << 30)
        got = tier.get_many([bytes([i]) * 32 for i in range(len(entries))], "m")
        torch.cuda.synchronize()
        for e, g in zip(entries, got):
            assert g.keys.is_cuda and torch.equal(g.keys.cpu(), e.keys) and torch.equal(g.values.cpu(), e.values)
