"""Linears over oneDNN-prepacked bf16 weights, for a bf16 model on the CPU.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which oneDNN reorders into its
blocked layout on every call. For the one-row matmuls of a decode step that reorder costs more than the
product: measured here, a 4864x896 bf16 linear for one row takes 0.41 ms through `F.linear` and 0.08 ms
over a weight reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`, the op torch's own
inductor uses when it freezes a CPU graph); Qwen2.5's 272 MB output head 31.6 ms and 16.0 ms. Prefill's
many-row matmuls gain less: 10-40% an op in that test, 4-11% of a whole Qwen2.5-0.5B prefill. The layout
depends on the row count the weight is packed for (ROWS_HINTS): it is packed for many rows, which on AMX CPUs
made a 2K prefill 9% faster and a 400-row recompute's linears up to 1.6x, and `cpu_kernels.packed_gemv` reads
either layout for decode. The results agree with `F.linear`'s to bf16 rounding (the same oneDNN kernels; the
order of a sum can differ in its last bit).

`pack_linears` swaps each bf16 `nn.Linear` for a `PackedLinear` that holds only the packed weight (no
second copy; a tied output head keeps its embedding). `unpack_linears` gives plain linears back, for a
copy that needs dense weights (the int8 scorer).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from . import cpu_kernels

# oneDNN keeps a primitive for every input shape a bf16 linear or matmul has seen (its own primitive cache, and
# ideep's cache of computation parameters above it; 1,024 entries each by default), holding memory that grows
# with the shape's rows. Prompts of ever new lengths then grow a process without end: here ~100 MB a 4K RULER
# sample (an evaluation at 7 GB after 40 samples, 10 GB after 80), ~1.6 GB over 600 linears of random row
# counts. 16 entries each hold every shape a decode step repeats; measured there: growth stops at ~0.3 GB.
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_CAPACITY = 16

# The row count oneDNN packs a weight for. For one row (a decode step) it lays a weight out in blocks of 64 outputs;
# for 16 rows or more, on AMX, in blocks of 32, and a many-row product over the one-row layout reorders the weight
# on every call: measured here (Xeon with AMX, 2 threads), a 4864x896 linear over 400 rows took 2.12 ms on the
# one-row layout and 1.29-1.36 ms on the many-row one, 8.46 and 7.61 ms over 2,048 rows, the same 0.27 ms for one
# row. So a weight is packed for many rows (prefill and recompute), and for one row only where `packed_gemv`
# cannot read the many-row layout (decode keeps its kernel either way).
ROWS_HINTS = (64, 1)
GEMV_BLOCKS = (32, 64)  # the output blocks `packed_gemv` reads


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Cap both caches (see ONEDNN_CACHES) unless the environment sets them; returns the settings in force.
    oneDNN reads them when it first runs a primitive: call this before a bf16 model's first forward."""
    for name in ONEDNN_CACHES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in ONEDNN_CACHES}


def packing_available() -> bool:
    """Whether this torch has oneDNN and the reorder/linear ops its CPU inductor uses, and this CPU runs
    oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU the reorder raises,
    and a bf16 model stays on plain linears)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    ) and bool(ops._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight reordered once into oneDNN's blocked layout (bf16, CPU).

    `weight` is the dense weight unpacked on demand (a copy; for readers, not for the forward). The
    module holds no dense weight parameter, so `state_dict` lists only `bias`."""

    def __init__(self, linear: nn.Linear, rows_hints: tuple[int, ...] = ROWS_HINTS):
        super().__init__()
        if linear.weight.dtype != torch.bfloat16 or linear.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear takes a bf16 CPU linear, got {linear.weight.dtype} on "
                             f"{linear.weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.gemv_address, self.gemv_block = None, GEMV_BLOCKS[-1]
        readable = self.in_features % 2 == 0 and cpu_kernels.available()  # else oneDNN runs every row
        for rows_hint in rows_hints:  # the prefill layout, unless only the decode layout lets the kernel read it
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
            self.rows_hint = rows_hint
            if not readable or self._find_gemv_layout():
                break

    def _find_gemv_layout(self) -> bool:
        """Set `gemv_address` and `gemv_block` where `cpu_kernels.packed_gemv` reads the packed weight right:
        its byte size is a layout's ([ceil(O/B)][I/2][B][2] bf16, B in GEMV_BLOCKS) and its product for a
        random row equals oneDNN's to bf16 rounding. Else (another layout) `gemv_address` stays None."""
        address = torch.ops.mkldnn.data_ptr(self.packed)
        generator = torch.Generator().manual_seed(self.in_features * 7919 + self.out_features)
        x = torch.randn(1, self.in_features, generator=generator).to(torch.bfloat16)
        with torch.no_grad():
            theirs = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "").float()
            for block in GEMV_BLOCKS:
                if torch.ops.mkldnn._nbytes(self.packed) != -(-self.out_features // block) * block * self.in_features * 2:
                    continue
                ours = cpu_kernels.packed_gemv(x, address, self.in_features, self.out_features,
                                               self._bias_for_kernel(), block).float()
                if bool((ours - theirs).abs().max() <= 2e-2 * theirs.abs().max().clamp_min(1e-6)):
                    self.gemv_address, self.gemv_block = address, block
                    return True
        return False

    def _bias_for_kernel(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias.detach() if self.bias.dtype == torch.bfloat16 and self.bias.is_contiguous() else \
            self.bias.detach().to(torch.bfloat16).contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"PackedLinear takes bf16 input, got {x.dtype}")
        if (self.gemv_address is not None and x.numel() <= cpu_kernels.GEMV_MAX_ROWS * self.in_features
                and cpu_kernels.enabled()):
            rows = x.reshape(-1, self.in_features)  # a decode step's few rows: the memory-speed kernel
            out = cpu_kernels.packed_gemv(rows if rows.is_contiguous() else rows.contiguous(), self.gemv_address,
                                          self.in_features, self.out_features, self._bias_for_kernel(),
                                          self.gemv_block)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense(self) -> nn.Linear:
        """A plain `nn.Linear` with this one's weight (unpacked) and bias (shared)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta", dtype=torch.bfloat16)
        linear.weight = nn.Parameter(self.weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy packed anew from the dense weight (oneDNN's opaque tensors have no storage to copy)."""
        copied = PackedLinear(self.dense(), (self.rows_hint,))
        copied.bias = copy.deepcopy(self.bias, memo)
        memo[id(self)] = copied
        return copied

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _swap(model: nn.Module, kind: type, make) -> int:
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is kind]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


def pack_linears(model: nn.Module, rows_hints: tuple[int, ...] = ROWS_HINTS) -> int:
    """Swap every bf16 CPU `nn.Linear` in `model` for a `PackedLinear` (packed for `rows_hints`' rows, see
    ROWS_HINTS) in place; returns how many. A no-op (0) where oneDNN's ops are missing, the model is not bf16,
    or it is not on the CPU."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears or not packing_available() or any(
            m.weight.dtype != torch.bfloat16 or m.weight.device.type != "cpu" for m in linears):
        return 0
    with torch.no_grad():
        return _swap(model, nn.Linear, lambda linear: PackedLinear(linear, rows_hints))


def unpack_linears(model: nn.Module) -> int:
    """Swap every `PackedLinear` back for a plain `nn.Linear` with the same weights; returns how many."""

    with torch.no_grad():
        return _swap(model, PackedLinear, PackedLinear.dense)
