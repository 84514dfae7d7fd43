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


def sorted_positions(batch, rows, length, generator):
    return torch.stack([torch.randperm(length, generator=generator)[:rows].sort().values for _ in range(batch)])


def run_case(dtype, heads=4, kv_heads=2, dim=32, length=37, rows=13, softcap=None, window=None, positions=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 2
    q = torch.randn(b, heads, rows, dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(b, kv_heads, length, dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(b, kv_heads, length, dim, generator=g).to(dtype).to(DEVICE)
    pos = (sorted_positions(b, rows, length, g) if positions is None else positions).to(DEVICE)
    scale = dim ** -0.5
    got = selected_attention(q, k, v, pos, scale, softcap, window, block_m=16, block_n=16)
    ref = selected_attention_reference(q, k, v, pos, scale, softcap, window)
    assert got.shape == ref.shape == (b, rows, heads, dim)
    err = (got.float() - ref.float()).abs().max().item() if rows else 0.0
    assert err < TOL[dtype], err
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


def test_bad_shapes_are_rejected():
    q = torch.randn(1, 3, 4, 32)
    k = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        selected_attention(q, k, k, torch.zeros(1, 4, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="positions"):
        selected_attention(torch.randn(1, 2, 4, 32), k, k, torch.zeros(1, 3, dtype=torch.long), 1.0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kernel_in_the_recompute_path_matches_sdpa(arch, make_engine):
    """Plugged in through the attention function, the kernel gives the engine's sdpa answer."""
    from cacheclip_rag.config import RequestOptions
    from cacheclip_rag.testing import tiny_model
    from tests.conftest import CHUNKS, QUESTION

    engine = make_engine(tiny_model(arch))
    opts = RequestOptions(method="cacheclip", ratio=0.4, max_new_tokens=1)
    plain = engine.generate(QUESTION, CHUNKS, opts)
    engine.kernel = selected_attention
    fused = engine.generate(QUESTION, CHUNKS, opts)
    assert fused.recomputed_tokens == plain.recomputed_tokens > 0
    assert (fused.first_logits - plain.first_logits).abs().max() < 1e-4
