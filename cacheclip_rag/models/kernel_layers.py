"""A bf16 model's RMSNorms and gated MLPs on the CPU kernels' one-pass forms.

transformers' Qwen2/Llama RMSNorm runs six elementwise ops over the rows (to float32, pow, mean, rsqrt, a product,
back to bf16, the weight's product), and the gated MLP two between its products (silu, then times up), each a pass
over memory: at a 2K prompt of Qwen2.5-0.5B they took ~0.3 s of a 1.3 s prefill on 2 cores. `cpu_kernels.rms_norm`
and `silu_mul` do each in one pass, rounding to bf16 where torch's ops round, so they agree with the modules' own
forwards to the order of a row's sum (tests/test_kernel_layers.py).

`use_kernel_layers` gives each such module of a bf16 CPU model a subclass whose forward calls the kernel, and its
own forward for any other input (float32 rows, kernels switched off): the module keeps its class (by inheritance),
parameters and names. Only the classes in NORMS and MLPS, whose forwards are the form above, are changed.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import cpu_kernels

NORMS = frozenset({"Qwen2RMSNorm", "LlamaRMSNorm"})
MLPS = frozenset({"Qwen2MLP", "LlamaMLP"})
SILU = frozenset({"SiLU", "SiLUActivation"})


def _on_kernels(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous() and cpu_kernels.enabled()


class _RMSNormOnKernels:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _on_kernels(hidden_states) and self.weight.dtype == torch.bfloat16:
            return cpu_kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class _GatedMLPOnKernels:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on_kernels(x):
            gate, up = self.gate_proj(x), self.up_proj(x)
            if _on_kernels(gate) and _on_kernels(up):
                return self.down_proj(cpu_kernels.silu_mul(gate, up))
            return self.down_proj(self.act_fn(gate) * up)
        return super().forward(x)


@functools.cache
def _subclass(cls: type, mixin: type) -> type:
    return type(f"{cls.__name__}OnCPUKernels", (mixin, cls), {"__module__": cls.__module__})


def _takes(module: nn.Module) -> type | None:
    """The mixin for `module`, None where it keeps its forward."""
    name = type(module).__name__
    if name in NORMS and getattr(module, "weight", None) is not None and hasattr(module, "variance_epsilon"):
        return _RMSNormOnKernels
    if name in MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU and all(
            hasattr(module, part) for part in ("gate_proj", "up_proj", "down_proj")):
        return _GatedMLPOnKernels
    return None


def use_kernel_layers(model: nn.Module, on: bool = True) -> int:
    """Put `model`'s RMSNorms and gated MLPs (NORMS, MLPS) on the CPU kernels in place (`on`), or give them their
    own forwards back (not `on`: benchmarks compare both); returns how many changed. Putting them on is a no-op (0)
    where the kernels are not available or the model is not bf16 on the CPU."""
    if not on:
        changed = [m for m in model.modules() if issubclass(type(m), (_RMSNormOnKernels, _GatedMLPOnKernels))]
        for module in changed:
            module.__class__ = type(module).__mro__[2]  # (subclass, mixin, the module's own class, ...)
        return len(changed)
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.dtype != torch.bfloat16 or parameter.device.type != "cpu" \
            or not cpu_kernels.available():
        return 0
    changed = 0
    for module in model.modules():
        mixin = _takes(module)
        if mixin is not None:
            module.__class__ = _subclass(type(module), mixin)
            changed += 1
    return changed
