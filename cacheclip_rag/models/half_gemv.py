"""A float32 model's decode steps on an AVX2 CPU, over float16 copies of its linears' weights.

Where the CPU has no native bf16 (AVX2 servers: AMD before Zen 4, Intel before Cooper Lake), "auto" runs a model
in float32 (`loading.resolve_dtype`). Prefill's many rows are compute-bound there and MKL's float32 products
run them near the cores' peak; a decode step's one row per request reads every weight once and runs at the
memory's speed, so it is the weights' bytes that set its time: float32's are twice 16-bit's. `half_gemv`
(`csrc/half_gemv.cpp`, AVX2 + FMA + F16C) reads a float16 copy of each weight, widens it in registers and sums
in float32; prefill keeps the float32 weight. The copy costs half the weights' bytes again in memory.

float16 keeps 11 significant bits (bf16 8): a weight's rounding error is at most 2^-11 of it, and a product's
sum is float32's. A weight above float16's range (65,504) keeps its linear on float32 (`attach_half_weights`
skips it). A copy is remade when its weight changes in place (its version counter), so a loaded state dict or
an edited weight is never read stale.

Built on first use (`kernel_build`); where the CPU lacks AVX2/FMA/F16C, torch is capped below AVX2, no
compiler is found or `CACHECLIP_CPU_KERNELS=0`, `available()` is False (the reason logged once) and every
linear keeps `nn.Linear`'s forward.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from . import cpu_features, kernel_build

log = logging.getLogger(__name__)

NAME = "cacheclip_half_gemv"
SOURCE = Path(__file__).parents[1] / "csrc" / "half_gemv.cpp"
FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
GEMV_MAX_ROWS = 8  # more rows (prefill, a question pass) keep MKL's float32 product, compute-bound and fast
FLOAT16_MAX = 65504.0

SWITCHED_OFF = kernel_build.SWITCHED_OFF
NO_AVX2 = "this process has no AVX2 with FMA and F16C (the CPU lacks them, or torch is capped below AVX2)"


def _why_not() -> str | None:
    """None where the kernel may be built here; else the reason it is not."""
    if kernel_build.switched_off():
        return SWITCHED_OFF
    if not cpu_features.has_avx2_f16c():
        return NO_AVX2
    return None


_kernels = kernel_build.LazyKernels(
    NAME, SOURCE, FLAGS, why_not=lambda: _why_not(), lost=lambda reason: reason not in (SWITCHED_OFF, NO_AVX2),
    lock=lambda: kernel_build.build_lock(NAME), logger=log,
    fallback="a float32 model's decode steps read its float32 weights")


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call); why not is logged once."""
    return _kernels.available()


def enabled() -> bool:
    """`available()` unless switched off in this process by `set_enabled(False)`."""
    return _kernels.enabled()


def set_enabled(on: bool) -> None:
    """Use the kernel where it applies (True, the default) or keep `nn.Linear`'s forward (False)."""
    _kernels.set_enabled(on)


def half_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, I] float32 (contiguous) times `weight` [O, I] float16 (contiguous), transposed, plus `bias` [O]
    float32 -> [M, O] float32; M may be 0. The shapes, dtypes and device are checked (a clear RuntimeError)."""
    return torch.ops.cacheclip_half.half_gemv(x, weight, bias)


class HalfWeightLinear(nn.Linear):
    """An `nn.Linear` (float32, CPU) whose few-row products read a float16 copy of its weight (`half_gemv`);
    its parameters, state dict and other rows are the linear's own. Made by `attach_half_weights`."""

    half_weight: torch.Tensor
    _copied_version: int

    def refresh_half_weight(self) -> None:
        """Copy the weight to float16 again (done in `forward` whenever the weight changed in place)."""
        with torch.no_grad():
            self.half_weight = self.weight.detach().to(torch.float16).contiguous()
        self._copied_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == self.in_features
                and x.numel() <= GEMV_MAX_ROWS * self.in_features and enabled()):
            if self.weight._version != self._copied_version:
                self.refresh_half_weight()
            rows = x.reshape(-1, self.in_features)
            bias = None if self.bias is None else self.bias.detach()
            out = half_gemv(rows if rows.is_contiguous() else rows.contiguous(), self.half_weight, bias)
            return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


def fits_float16(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is finite and within float16's range."""
    if weight.numel() == 0:
        return True
    return bool(torch.isfinite(weight).all()) and float(weight.abs().max()) <= FLOAT16_MAX


def attach_half_weights(model: nn.Module) -> int:
    """Give every float32 CPU `nn.Linear` of `model` whose weight fits float16 a float16 copy that its decode
    rows read (`HalfWeightLinear`, in place: the module keeps its parameters and names); returns how many. A
    no-op (0) where the kernel is not available."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and (m.bias is None or m.bias.dtype == torch.float32)]
    if not linears or not available():
        return 0
    attached = 0
    for linear in linears:
        if fits_float16(linear.weight.detach()):
            linear.__class__ = HalfWeightLinear
            linear.refresh_half_weight()
            attached += 1
    return attached


def detach_half_weights(model: nn.Module) -> int:
    """Undo `attach_half_weights`: plain `nn.Linear`s again, their float16 copies freed; returns how many."""
    swapped = [m for m in model.modules() if type(m) is HalfWeightLinear]
    for linear in swapped:
        linear.__class__ = nn.Linear
        del linear.half_weight, linear._copied_version
    return len(swapped)
