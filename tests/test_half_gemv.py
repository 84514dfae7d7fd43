"""The float16-weight decode product for float32 models on AVX2 CPUs (half_gemv.py, csrc/half_gemv.cpp): the
kernel against its reference (F.linear over the weight rounded to float16), its refusals, and the linears and
models that read it. On a CPU with AVX2, FMA and F16C and a compiler it must build; elsewhere these are skipped
and `available()` must say why."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cacheclip_rag.models import cpu_features, half_gemv
from cacheclip_rag.models.half_gemv import HalfWeightLinear, attach_half_weights, detach_half_weights
from cacheclip_rag.testing import tiny_model

needs_kernel = pytest.mark.skipif(not half_gemv.available(),
                                  reason=f"half_gemv not available: {half_gemv._kernels.state.get('reason')}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What half_gemv computes, in float64: x times the weight rounded to float16, plus the bias."""
    out = x.double() @ weight.half().double().T
    return (out + bias.double() if bias is not None else out).float()


def test_builds_where_it_can():
    """Where the CPU has AVX2, FMA and F16C and a compiler is on PATH, the build must succeed: a silent fallback
    would hide a broken kernel behind float32's slower decode."""
    if not cpu_features.has_avx2_f16c():
        assert not half_gemv.available()
        pytest.skip("no AVX2 with FMA and F16C here")
    if shutil.which("c++") is None:
        pytest.skip("no compiler here")
    assert half_gemv.available(), half_gemv._kernels.state.get("reason")


def test_switched_off_or_capped(monkeypatch):
    monkeypatch.setenv("CACHECLIP_CPU_KERNELS", "0")
    assert half_gemv._why_not() == half_gemv.SWITCHED_OFF
    monkeypatch.delenv("CACHECLIP_CPU_KERNELS")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # ATEN_CPU_CAPABILITY=default
    assert not cpu_features.has_avx2_f16c() and half_gemv._why_not() == half_gemv.NO_AVX2


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (7, 13), (5, 8), (130, 96), (1, 3), (4, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_its_reference(rows, out_features, in_features, with_bias):
    """Every output group (4 at a time, then the last 1-3), every row pairing (2, then 1) and every input tail
    (past a multiple of 8) against float64 over the same float16 weights."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = half_gemv.half_gemv(x, weight.half(), bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_zero_width_gives_the_bias():
    bias = torch.arange(3.0)
    assert torch.equal(half_gemv.half_gemv(torch.zeros(2, 0), torch.zeros(3, 0, dtype=torch.float16), bias),
                       bias.expand(2, 3))
    assert torch.equal(half_gemv.half_gemv(torch.zeros(2, 0), torch.zeros(3, 0, dtype=torch.float16), None),
                       torch.zeros(2, 3))


@needs_kernel
@pytest.mark.parametrize("x,weight,bias,message", [
    (torch.zeros(1, 98), torch.zeros(200, 96, dtype=torch.float16), None, "width 98 for a weight of width 96"),
    (torch.zeros(1, 96, dtype=torch.bfloat16), torch.zeros(2, 96, dtype=torch.float16), None, "float32 rows"),
    (torch.zeros(96), torch.zeros(2, 96, dtype=torch.float16), None, "float32 rows"),
    (torch.zeros(96, 2).T, torch.zeros(2, 2, dtype=torch.float16), None, "contiguous float32 rows"),
    (torch.zeros(1, 96), torch.zeros(2, 96), None, "float16 weight"),
    (torch.zeros(1, 96), torch.zeros(96, 2, dtype=torch.float16).T, None, "contiguous float16 weight"),
    (torch.zeros(1, 96), torch.zeros(2, 96, dtype=torch.float16), torch.zeros(3), "bias must be float32"),
    (torch.zeros(1, 96), torch.zeros(2, 96, dtype=torch.float16), torch.zeros(2, dtype=torch.float64), "bias"),
    (torch.zeros(1, 96, device="meta"), torch.zeros(2, 96, dtype=torch.float16), None, "CPU tensors"),
    (torch.zeros(1, 96), torch.zeros(2, 96, dtype=torch.float16, device="meta"), None, "CPU tensors"),
])
def test_bad_input_is_refused_with_a_reason(x, weight, bias, message):
    with pytest.raises(RuntimeError, match=message):
        half_gemv.half_gemv(x, weight, bias)


def linear_pair(in_features: int = 96, out_features: int = 72, bias: bool = True) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(in_features + out_features)
    plain = nn.Linear(in_features, out_features, bias=bias)
    halved = copy.deepcopy(plain)
    assert attach_half_weights(halved) == 1 and type(halved) is HalfWeightLinear
    return plain, halved


@needs_kernel
def test_a_linear_reads_its_copy_for_few_rows_and_its_weight_for_many():
    plain, halved = linear_pair()
    few = torch.randn(2, 4, 96)  # 8 rows: the decode path
    with torch.no_grad():
        torch.testing.assert_close(halved(few), reference(few.reshape(8, 96), plain.weight, plain.bias).view(2, 4, 72),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.equal(halved(few), plain(few))  # the copy is float16's, not the weight
        many = torch.randn(9, 96)
        assert torch.equal(halved(many), plain(many))  # prefill rows: nn.Linear's own product
        with pytest.raises(RuntimeError, match="same dtype"):  # another dtype: nn.Linear's own answer
            halved(few.double())
        half_gemv.set_enabled(False)
        try:
            assert torch.equal(halved(few), plain(few))
        finally:
            half_gemv.set_enabled(True)
    assert list(halved.state_dict()) == list(plain.state_dict())  # the copy is not saved


@needs_kernel
def test_a_weight_changed_in_place_is_never_read_stale():
    plain, halved = linear_pair(bias=False)
    x = torch.randn(1, 96)
    with torch.no_grad():
        before = halved(x)
        new = {"weight": torch.randn(72, 96)}
        plain.load_state_dict(new)
        halved.load_state_dict(new)
        assert not torch.allclose(halved(x), before)
        torch.testing.assert_close(halved(x), reference(x, plain.weight, None), rtol=1e-5, atol=1e-5)
        halved.weight.mul_(2.0)
        torch.testing.assert_close(halved(x), reference(x, 2.0 * plain.weight, None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_weights_beyond_float16_keep_float32_and_detach_restores():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8).double())
    with torch.no_grad():
        model[1].weight[0, 0] = 70000.0  # past float16's 65,504
    assert attach_half_weights(model) == 1
    assert [type(m) for m in model] == [HalfWeightLinear, nn.Linear, nn.Linear]
    assert detach_half_weights(model) == 1 and type(model[0]) is nn.Linear and not hasattr(model[0], "half_weight")


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_models_decode_step_equals_its_float16_rounded_twin(arch):
    """A model with float16 decode copies gives, for a one-token step over a cache, the logits of a copy whose
    linear weights were rounded to float16 (float32 products): the copy is the only change. Its prefill rows
    (more than 8) are the float32 model's own, exactly."""
    loaded = tiny_model(arch)
    model = loaded.model.eval()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for module in twin.modules():
            if type(module) is nn.Linear:
                module.weight.copy_(module.weight.half().float())
    plain = copy.deepcopy(model)
    assert attach_half_weights(model) == sum(type(m) is nn.Linear for m in plain.modules())
    prompt = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(prompt, use_cache=True), plain(prompt, use_cache=True)
        assert torch.equal(ours.logits, theirs.logits)  # 24 rows: the float32 weights
        step = torch.tensor([[17]])
        ours_step = model(step, past_key_values=ours.past_key_values).logits
        twin_step = twin(step, past_key_values=theirs.past_key_values).logits
        torch.testing.assert_close(ours_step, twin_step, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_model_with_copies_still_gets_an_int8_scorer():
    from cacheclip_rag.models.loading import int8_scorer

    model = tiny_model("qwen2").model.eval()
    attach_half_weights(model)
    scorer = int8_scorer(model)
    assert not any(isinstance(m, HalfWeightLinear) for m in scorer.model.modules())
    assert any(type(m).__name__ == "Linear" and "quantized" in type(m).__module__ for m in scorer.model.modules())


def test_a_failed_build_is_said_once_at_warning_and_leaves_nn_linear(monkeypatch, caplog):
    """Where the CPU could run the kernel, a failed build loses its speed-up: said at WARNING, once; the linears
    keep their own forward."""
    from cacheclip_rag.models import kernel_build

    saved = dict(half_gemv._kernels.state)
    monkeypatch.setattr(half_gemv, "_why_not", lambda: None)
    monkeypatch.setattr(kernel_build, "build", lambda *args, **kwargs: "the build failed: no space left on device")
    half_gemv._kernels.state.clear()
    try:
        with caplog.at_level("INFO", logger=half_gemv.__name__):
            assert not half_gemv.available() and not half_gemv.available()
            assert attach_half_weights(nn.Sequential(nn.Linear(8, 8))) == 0
        said = [r for r in caplog.records if "not used" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING" and "no space left" in said[0].getMessage()
    finally:
        half_gemv._kernels.state.clear()
        half_gemv._kernels.state.update(saved)
