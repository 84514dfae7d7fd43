"""bench/anchors/run_anchors.py's AVX2 mode: refusals before any work, and the caps it hands its engines."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench/anchors/run_anchors.py"


def test_avx2_mode_refuses_vllm_before_starting_anything(tmp_path):
    rows = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), "--isa", "avx2", "--engines", "cacheclip,vllm-1core",
                           "--rows", str(rows)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--isa avx2: vLLM's CPU wheel is built for AVX-512, so vllm-1core cannot run" in done.stderr
    assert not rows.exists()


def test_avx2_mode_names_every_cap_its_engines_inherit(monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import run_anchors
    finally:
        sys.path.remove(str(SCRIPT.parent))
    for name in run_anchors.AVX2_ENV:
        monkeypatch.delenv(name, raising=False)
    assert run_anchors.isa_settings() == {}
    for name, value in run_anchors.AVX2_ENV.items():
        monkeypatch.setenv(name, value)
    assert run_anchors.isa_settings() == run_anchors.AVX2_ENV
    # what each engine is held to: torch, MKL and oneDNN at AVX2, llama.cpp built for it
    assert run_anchors.AVX2_ENV == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                    "ONEDNN_MAX_CPU_ISA": "AVX2", "LLAMA_CPP_ISA": "avx2"}


def _row(engine: str, ttfts: list[float], answers: list[str]) -> dict:
    return {"engine": engine, "workload": "fresh", "prompt": "2k", "clients": 1, "ttfts": ttfts,
            "questions": ["When was the planet found?"] * len(ttfts), "answers": answers}


def test_each_engine_is_compared_with_the_fastest_peer_that_ran_in_its_cell():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import run_anchors
    finally:
        sys.path.remove(str(SCRIPT.parent))
    ours = _row("cacheclip", [1.0, 1.1, 0.9, 1.0], ["x"] * 4)
    slow_vllm, llama = _row("vllm-1core", [8.0, 8.2, 7.9, 8.1], ["x"] * 4), _row("llamacpp", [4.0, 4.1, 3.9, 4.0], ["x"] * 4)
    (mine,) = run_anchors.comparisons([ours, slow_vllm, llama])
    assert mine["vs"] == "llamacpp" and abs(mine["p50_over_peer"] - 0.25) < 1e-9
    fast_vllm = _row("vllm", [2.0, 2.1, 1.9, 2.0], ["x"] * 4)
    (mine,) = run_anchors.comparisons([ours, slow_vllm, llama, fast_vllm])
    assert mine["vs"] == "vllm" and abs(mine["p50_over_peer"] - 0.5) < 1e-9
    (alone,) = run_anchors.comparisons([ours])
    assert "vs" not in alone  # no peer ran: no ratio


def test_a_row_names_the_cpu_it_ran_on(monkeypatch):
    """The same table from two machines must not be read as one: each row says its CPU and best instructions."""
    monkeypatch.syspath_prepend(str(ROOT / "bench/anchors"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import run_anchors
    from cacheclip_rag.models import cpu_features

    host = run_anchors.host_cpu()
    flags = cpu_features.cpu_flags()
    expected = next((n for n in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if n in flags), "no AVX2")
    assert host.endswith(f"CPUs, {expected}") and not host.startswith(",")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    assert run_anchors.host_cpu().endswith("avx2")
