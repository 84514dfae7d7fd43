"""An operator's cap on the instruction set counts: no bf16 by "auto", no AVX-512 kernels, and a reason."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from cacheclip_rag.models import cpu_features, cpu_kernels
from cacheclip_rag.models.loading import cpu_has_native_bf16, resolve_dtype


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU with AVX-512 BF16 and AMX, whatever this one has, and no cap from the environment."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for name in (*cpu_features.ONEDNN_CAP_VARIABLES, "CACHECLIP_CPU_KERNELS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", cpu_features.ONEDNN_CAP_VARIABLES)
@pytest.mark.parametrize("value", ["AVX2", "avx512_core", "AVX2_VNNI_2"])
def test_a_onednn_cap_below_bf16_turns_bf16_and_the_kernels_off(bf16_cpu, monkeypatch, name, value):
    assert cpu_features.isa_cap() is None and cpu_has_native_bf16()
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv(name, value)
    assert cpu_features.isa_cap() == f"{name}={value}"
    assert not cpu_has_native_bf16() and not cpu_features.has_avx512_bf16()
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert cpu_kernels._why_not() == f"{name}={value} holds this process below AVX-512 BF16"
    assert not cpu_kernels._could_run()  # the operator's choice: logged at INFO, not as a lost speed-up


@pytest.mark.parametrize("value", ["AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL", "DEFAULT", ""])
def test_a_onednn_cap_that_keeps_bf16_changes_nothing(bf16_cpu, monkeypatch, value):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", value)
    assert cpu_features.isa_cap() is None
    assert cpu_has_native_bf16() and resolve_dtype("auto", "cpu") == torch.bfloat16


def test_torch_below_avx512_is_a_cap_and_names_where_it_came_from(bf16_cpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert cpu_features.isa_cap() == "torch's CPU capability AVX2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_features.isa_cap() == "ATEN_CPU_CAPABILITY=avx2"
    assert not cpu_has_native_bf16()


def test_a_cpu_without_the_flag_says_so_before_any_cap(bf16_cpu, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_kernels._why_not() == cpu_kernels.NO_BF16


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is an x86 capability")
def test_aten_cpu_capability_set_before_import_holds_a_fresh_process_to_float32(tmp_path):
    """The variable is read when torch loads: a new process, as `run_anchors.py --isa avx2` starts its servers."""
    probe = ("import json, torch\n"
             "from cacheclip_rag.models import cpu_features, cpu_kernels\n"
             "from cacheclip_rag.models.loading import resolve_dtype\n"
             "print(json.dumps([torch.backends.cpu.get_cpu_capability(), cpu_features.isa_cap(),\n"
             "                  str(resolve_dtype('auto', 'cpu')), cpu_kernels.available()]))\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "CACHECLIP_CPU_KERNELS": "1",
           "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    capability, cap, dtype, kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert capability == "AVX2" and cap == "ATEN_CPU_CAPABILITY=avx2"
    assert dtype == "torch.float32" and kernels is False
