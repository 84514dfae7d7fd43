"""Whether this process may use the CPU's AVX-512 BF16: the CPU's flags, less what the operator capped.

torch's own kernels can be held to a lower instruction set (`ATEN_CPU_CAPABILITY=avx2`, read at import), and
oneDNN's linears too (`ONEDNN_MAX_CPU_ISA=AVX2`, or its older name `DNNL_MAX_CPU_ISA`). Under such a cap a
bf16 model's products are emulated (slower than float32), and this package's AVX-512 kernels would run
instructions the operator asked not to: so a cap below AVX-512 BF16 counts as no native bf16. It is also how
an AVX2-only server is reproduced on a newer host (`bench/anchors/run_anchors.py --isa avx2`).
"""

from __future__ import annotations

import os

import torch

# oneDNN's instruction sets without bf16 dot products (its names, upper case); "ALL", "DEFAULT" and anything
# from AVX512_CORE_BF16 up keep them
ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
ONEDNN_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# torch's capabilities below AVX-512 (`torch.backends.cpu.get_cpu_capability()`)
TORCH_BELOW_AVX512 = frozenset({"DEFAULT", "NO AVX", "AVX2"})


def isa_cap() -> str | None:
    """The setting that holds this process below AVX-512 BF16 ("NAME=value"; torch's own capability where
    no variable set it), or None where none does."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.upper() in TORCH_BELOW_AVX512:
        variable = os.environ.get("ATEN_CPU_CAPABILITY")
        return f"ATEN_CPU_CAPABILITY={variable}" if variable else f"torch's CPU capability {capability}"
    for name in ONEDNN_CAP_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.upper() in ONEDNN_BELOW_BF16:
            return f"{name}={value}"
    return None


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU itself has AVX-512 BF16 (its flags; caps aside)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return probe is not None and bool(probe())


def has_avx512_bf16() -> bool:
    """Whether the CPU has AVX-512 BF16 and nothing here caps it (`isa_cap`)."""
    return cpu_has_avx512_bf16() and isa_cap() is None


def has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX tiles), uncapped (`isa_cap`)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(probe()) for probe in probes if probe is not None) and isa_cap() is None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_avx2_f16c() -> bool:
    """Whether this process may run AVX2 with FMA and F16C: the CPU has them, and torch's capability (which
    `ATEN_CPU_CAPABILITY` can cap) is AVX2 or above."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return capability in ("AVX2", "AVX512") and {"avx2", "fma", "f16c"} <= cpu_flags()
