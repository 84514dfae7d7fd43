"""The project runs where it cannot be installed (the GPU machine: no package index) and on every
transformers release from 5.17 (that machine's) to the newest."""

import subprocess
import sys
from pathlib import Path

import pytest

from cacheclip_rag.recompute import cache_argument

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_and_integrations_import_from_a_plain_checkout(tmp_path):
    """No install, only PYTHONPATH: the kernels and integrations still resolve under cacheclip_rag,
    to the checkout's own files (not an installed copy)."""
    code = (
        "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()];"
        "import cacheclip_rag.kernels.selected_attention as k, cacheclip_rag.integrations.common as c;"
        "print(k.__file__); print(c.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(ROOT / "kernels" / "selected_attention.py"), str(ROOT / "integrations" / "common.py")]


def test_gpu_scripts_parse():
    for script in ("bench/gpu_check.sh", "scripts/gpu_wheels.sh", "scripts/test_loop.sh", "scripts/test_transformers_min.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


class _NewForward:
    def forward(self, input_ids=None, cache=None, use_cache=None): ...


class _OldForward:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...


class _NoCache:
    def forward(self, input_ids=None): ...


def test_the_cache_argument_follows_the_forward_signature():
    """transformers 5.24 renamed past_key_values to cache, and each release silently drops the name it
    does not know; the name must come from the signature."""
    assert cache_argument(_NewForward) == "cache"
    assert cache_argument(_OldForward) == "past_key_values"
    with pytest.raises(TypeError, match="neither"):
        cache_argument(_NoCache)
