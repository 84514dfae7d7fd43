"""Attention and one-row kernels for bf16 models on CPUs with AVX-512 BF16: built once, checked, or not used.

A decode step reads every weight once for one row, so it runs at the memory's speed, and oneDNN's bf16
product for one row reached ~20-29 GB/s here where the weights stream at ~30-50 GB/s; one query row's
attention through torch's `mm`s cost ~0.2-0.3 ms a layer over a 2K-4K cache, for 1 MB of keys and values.
`csrc/cpu_kernels.cpp` holds two kernels for that step, and one for prefill:

- `packed_gemv`: a decode step's few rows (up to `GEMV_MAX_ROWS`: one a request the server batches) through
  a linear whose weight oneDNN already prepacked (`packed_linear`), reading that packed layout in place: no
  second copy of any weight. Measured 1.1-3x oneDNN's speed from 1 to 8 rows on cold weights; more rows
  (prefill) keep oneDNN, which is compute-bound there and fast.
- `one_row_attention`: one query row of each head over a bf16 cache, the query heads of a KV head together,
  key ranges split over the threads and merged by log-sum-exp.
- `silu_mul`, `rms_norm`: a gated MLP's silu(gate) * up and an RMSNorm, each in one pass over the rows
  (`kernel_layers` puts them in a bf16 model's layers).
- `positioned_attention`: many query rows at given positions, each over the keys up to its position: a
  causal prefill, or CacheClip's scattered recompute rows. torch's CPU flash kernel ran ~120-140 GFLOP/s
  here; this one ~210-270 (scores and p V both on `vdpbf16ps`, the heads of a KV head sharing each key load).

Both accumulate in float32 and round once to bf16, as oneDNN and torch's paths do; only the order of the
sums differs (results agree to bf16 rounding, tests/test_cpu_kernels.py). They are built on first use with
torch's own extension builder (g++ and ninja, ~10 s; cached under `TORCH_EXTENSIONS_DIR`), with OpenMP so
they run on torch's own thread pool (the same libgomp). Where the CPU lacks AVX-512 BF16, no compiler is
found, the build fails, `CACHECLIP_CPU_KERNELS=0` is set or the operator capped the instruction set below
AVX-512 BF16 (`cpu_features.isa_cap`), `available()` is False, the reason is logged
once, and every caller keeps its torch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from . import cpu_features, kernel_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "csrc" / "cpu_kernels.cpp"
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
ATTENTION_DIMS = frozenset({32, 64, 128})
GEMV_MAX_ROWS = 8

SWITCHED_OFF = kernel_build.SWITCHED_OFF
NO_BF16 = "this CPU has no AVX-512 BF16"
CAPPED = "holds this process below AVX-512 BF16"  # after the setting that does (`cpu_features.isa_cap`)


def _why_not() -> str | None:
    """None where the kernels may be built here; else the reason they are not."""
    if kernel_build.switched_off():
        return SWITCHED_OFF
    if not cpu_features.cpu_has_avx512_bf16():
        return NO_BF16
    cap = cpu_features.isa_cap()
    if cap is not None:
        return f"{cap} {CAPPED}"
    return None


def _could_run() -> bool:
    """Whether this CPU could run the kernels and they were not switched off: where not using them loses
    their speed-up."""
    reason = _why_not()
    return reason not in (SWITCHED_OFF, NO_BF16) and not (reason or "").endswith(CAPPED)


NAME = "cacheclip_cpu_kernels"


def _build_lock(name: str = NAME) -> Path:
    return kernel_build.build_lock(name)


_kernels = kernel_build.LazyKernels(
    NAME, SOURCE, FLAGS, why_not=lambda: _why_not(), lost=lambda reason: _could_run(), lock=lambda: _build_lock(),
    logger=log, fallback="attention and one-row products run on torch's paths")
_state = _kernels.state


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call); logs why not, once: at
    WARNING where the CPU could run them (the speed-up is lost), at INFO where it cannot or they were
    switched off."""
    return _kernels.available()


def enabled() -> bool:
    """`available()` unless switched off in this process by `set_enabled(False)` (benchmarks compare both)."""
    return _kernels.enabled()


def set_enabled(on: bool) -> None:
    """Use the kernels where they apply (True, the default) or keep torch's paths everywhere (False)."""
    _kernels.set_enabled(on)


def packed_gemv(x: torch.Tensor, weight_address: int, in_features: int, out_features: int,
                bias: torch.Tensor | None, block: int = 64) -> torch.Tensor:
    """[M, out] bf16 = x [M, in] (bf16, contiguous, even width `in_features`, which x must have) times the
    oneDNN-packed weight at `weight_address` laid out in blocks of `block` (32 or 64) outputs (see
    `packed_linear.PackedLinear`), plus `bias`; M may be 0."""
    return torch.ops.cacheclip_cpu.packed_gemv(x, weight_address, in_features, out_features, bias, block)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous bf16 CPU tensors of one shape, each op rounded to bf16 as torch rounds it."""
    return torch.ops.cacheclip_cpu.silu_mul(gate, up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2/Llama RMSNorm of contiguous bf16 CPU rows x [..., W] with a bf16 weight [W]."""
    return torch.ops.cacheclip_cpu.rms_norm(x, weight, float(eps))


def _over_a_bf16_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """What both attention kernels take: one sequence of bf16 CPU tensors, a head width of 32/64/128, whole
    groups of query heads a KV head, keys and values of one shape with dense rows (a cache's slice may stride
    its heads)."""
    return (query.dtype == key.dtype == value.dtype == torch.bfloat16 and query.device.type == "cpu"
            and query.shape[0] == 1 and query.shape[-1] in ATTENTION_DIMS and key.shape == value.shape
            and key.shape[-1] == query.shape[-1] and key.shape[2] > 0 and query.shape[1] % key.shape[1] == 0
            and key.stride(3) == 1 and value.stride(3) == 1 and key.stride(2) == key.shape[-1]
            and value.stride(2) == value.shape[-1])


def attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `one_row_attention` takes these: one query row over a bf16 cache (`_over_a_bf16_cache`)."""
    return query.shape[2] == 1 and _over_a_bf16_cache(query, key, value) and enabled()


def one_row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [1, H, 1, D], key/value [1, KV, N, D] -> [1, 1, H, D]: softmax(q k^T * scaling) v for each head;
    check `attention_applies` first."""
    heads, dim = query.shape[1], query.shape[3]
    out = torch.ops.cacheclip_cpu.one_row_attention(query.reshape(heads, dim).contiguous(), key[0], value[0],
                                                   float(scaling))
    return out.reshape(1, 1, heads, dim)


@functools.cache
def torch_attention_is_faster() -> bool:
    """Whether rows of a prefill or a recompute should keep torch's attention (its flash path, or sdpa by blocks
    of rows under the position mask): on CPUs with AMX tiles its block products run on AMX. On an Intel Xeon
    (2 cores, Qwen2.5-0.5B's heads) a causal layer took 17 against this kernel's 47 ms at 2K rows, 57 against
    184 at 4K; the whole `full` prefill 1.71 against 2.64 s at ~2K, CacheClip's recompute forward 0.47 against
    0.58 s (bench/bench_attention_path.py, issue 70). One decode row keeps `one_row_attention` everywhere."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def positioned_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `positioned_attention` takes these: rows over a bf16 cache (`_over_a_bf16_cache`), at most 32
    query heads a KV head."""
    return (_over_a_bf16_cache(query, key, value) and query.shape[1] // key.shape[1] <= 32 and enabled())


def positioned_used(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the engine sends these rows to `positioned_attention`: it takes them (`positioned_applies`) and
    torch's attention is not the faster here (`torch_attention_is_faster`)."""
    return positioned_applies(query, key, value) and not torch_attention_is_faster()


def positioned_attention(query: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """query [1, H, T, D] at `positions` [T] over key/value [1, KV, N, D] -> [1, T, H, D]: row t attends to keys
    0..positions[t] (keys past N do not exist; a row whose position is below 0 sees none and gives zeros).
    Check `positioned_applies` first."""
    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    out = torch.ops.cacheclip_cpu.positioned_attention(query[0].contiguous(), positions.to(torch.long).contiguous(),
                                                      key[0], value[0], float(scaling))
    return out.reshape(1, rows, heads, dim)
