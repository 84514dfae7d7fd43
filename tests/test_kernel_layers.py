"""The RMSNorm and gated-MLP kernels (`cpu_kernels.rms_norm`, `silu_mul`) against the torch ops they replace, and
`kernel_layers.use_kernel_layers` in a bf16 model: the same logits, its own forwards back on request."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from cacheclip_rag.models import cpu_kernels
from cacheclip_rag.models.kernel_layers import use_kernel_layers
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.testing import tiny_model

BF16_CPU = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
needs_kernels = pytest.mark.skipif(not (BF16_CPU and cpu_kernels.available()),
                                   reason=f"CPU kernels not available: {cpu_kernels._state.get('reason')}")


def agree_to_bf16_rounding(got: torch.Tensor, expected: torch.Tensor, exact_share: float) -> None:
    """Equal but for a few elements at most two bf16 steps apart (the order of a row's sum, exp's last float bits,
    each moving a rounding that a second rounding can carry one step further)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.bfloat16
    step = 2 * torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)
    assert bool(((got.float() - expected.float()).abs() <= step).all())
    assert (got == expected).float().mean().item() >= exact_share


@needs_kernels
@pytest.mark.parametrize("shape", [(1,), (15,), (17,), (3, 4864), (1, 7, 896)])
def test_silu_mul_is_torchs_silu_then_product(shape):
    torch.manual_seed(len(shape) + shape[-1])
    gate = (torch.randn(shape) * 6).to(torch.bfloat16)  # well into both tails of the sigmoid
    up = torch.randn(shape).to(torch.bfloat16)
    agree_to_bf16_rounding(cpu_kernels.silu_mul(gate, up), nn.functional.silu(gate) * up, 0.99)


@needs_kernels
def test_silu_mul_of_extremes():
    gate = torch.tensor([-1e4, -100.0, -0.0, 0.0, 1e-30, 100.0, 1e4, 3.0e38], dtype=torch.bfloat16)
    up = torch.full_like(gate, 2.0)
    expected = nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gate, up)
    assert torch.equal(got.isfinite(), expected.isfinite())
    agree_to_bf16_rounding(got[expected.isfinite()], expected[expected.isfinite()], 1.0)


@needs_kernels
@pytest.mark.parametrize("rows,width", [(1, 896), (5, 896), (3, 33), (2048, 64)])
def test_rms_norm_is_the_modules_forward(rows, width):
    torch.manual_seed(rows * width)
    norm = Qwen2RMSNorm(width, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = (1 + torch.randn(width) / 4).to(torch.bfloat16)
    x = (torch.randn(1, rows, width) * 3).to(torch.bfloat16)
    with torch.no_grad():
        agree_to_bf16_rounding(cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), 0.98)


@needs_kernels
def test_bad_input_is_refused_with_an_error():
    bf = torch.bfloat16
    with pytest.raises(RuntimeError, match="contiguous bf16 CPU"):
        cpu_kernels.silu_mul(torch.zeros(4), torch.zeros(4))
    with pytest.raises(RuntimeError, match="one shape"):
        cpu_kernels.silu_mul(torch.zeros(4, dtype=bf), torch.zeros(5, dtype=bf))
    with pytest.raises(RuntimeError, match="contiguous bf16 CPU"):
        cpu_kernels.silu_mul(torch.zeros(4, 6, dtype=bf).t(), torch.zeros(6, 4, dtype=bf))
    with pytest.raises(RuntimeError, match="weight of the rows' width 8"):
        cpu_kernels.rms_norm(torch.zeros(2, 8, dtype=bf), torch.ones(9, dtype=bf), 1e-6)
    assert cpu_kernels.silu_mul(torch.zeros(0, dtype=bf), torch.zeros(0, dtype=bf)).shape == (0,)


def small_bf16_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


@needs_kernels
def test_a_model_on_kernel_layers_gives_its_own_logits_and_gets_its_forwards_back():
    model = small_bf16_qwen2()
    ids = (torch.arange(40) * 7 % 251)[None]
    with torch.no_grad():
        before = model(ids).logits
        assert use_kernel_layers(model) == 2 * 2 + 1 + 2  # two norms a layer, the final norm, two MLPs
        norms = [m for m in model.modules() if isinstance(m, Qwen2RMSNorm)]
        mlps = [m for m in model.modules() if isinstance(m, Qwen2MLP)]
        assert all(type(m) is not Qwen2RMSNorm for m in norms) and all(type(m) is not Qwen2MLP for m in mlps)
        on = model(ids).logits
        copied = copy.deepcopy(model)
        assert type(copied.model.norm) is type(model.model.norm)
        assert torch.equal(copied(ids).logits, on)
        cpu_kernels.set_enabled(False)  # switched off: each module's own forward
        try:
            off = model(ids).logits
        finally:
            cpu_kernels.set_enabled(True)
        assert use_kernel_layers(model, on=False) == 7
        assert all(type(m) is Qwen2RMSNorm for m in norms) and all(type(m) is Qwen2MLP for m in mlps)
        again = model(ids).logits
    assert torch.equal(off, before) and torch.equal(again, before)
    scale = before.float().abs().max()
    assert (on.float() - before.float()).abs().max() <= 0.05 * scale  # bf16 rounding through two layers
    assert (on.argmax(-1) == before.argmax(-1)).float().mean() >= 0.95


def test_float32_models_and_other_modules_are_left_alone():
    model = small_bf16_qwen2().float()
    assert use_kernel_layers(model) == 0
    assert all(type(m) in (Qwen2RMSNorm, Qwen2MLP) for m in model.modules() if isinstance(m, (Qwen2RMSNorm, Qwen2MLP)))
    layer_norm = nn.Sequential(nn.LayerNorm(8)).to(torch.bfloat16)
    assert use_kernel_layers(layer_norm) == 0


@needs_kernels
def test_load_model_puts_a_bf16_models_layers_on_the_kernels(tmp_path):
    small_bf16_qwen2().save_pretrained(tmp_path)
    tiny_model("qwen2").tokenizer.save_pretrained(tmp_path)
    bf16, fp32 = load_model(tmp_path, dtype="bfloat16"), load_model(tmp_path, dtype="float32")
    on = [m for m in bf16.model.modules() if isinstance(m, (Qwen2RMSNorm, Qwen2MLP))]
    assert len(on) == 7 and all(type(m) not in (Qwen2RMSNorm, Qwen2MLP) for m in on)
    assert all(type(m) in (Qwen2RMSNorm, Qwen2MLP) for m in fp32.model.modules() if isinstance(m, (Qwen2RMSNorm, Qwen2MLP)))
