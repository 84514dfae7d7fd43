"""The GPU path: what can be pinned on the CPU (the kernel's compiled variants per request shape, the
one-shot GPU script's dry run, the end-to-end benchmark's code path on tiny models), and the CUDA checks
that bench/gpu_check.sh runs on the GPU machine (marked `gpu`)."""

import inspect
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cacheclip_rag.kernels import selected_attention as kernel_module
from cacheclip_rag.kernels.selected_attention import DO_NOT_SPECIALIZE, launch_plan

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def request_shapes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """(selected rows, context) of a stream of requests of different lengths: 2K-16K tokens, 10-30%."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        context = rng.randrange(2048, 16385)
        shapes.append((int(rng.choice((0.1, 0.2, 0.3)) * context) + rng.randrange(16, 80), context))
    return shapes


def test_twenty_request_shapes_launch_at_most_three_compiled_variants():
    """Triton compiles one variant per distinct constexprs (+ warps, stages) and per specialisation of
    each integer argument not in DO_NOT_SPECIALIZE; with every per-request integer exempted, the
    variants are the launch plans' own: 7 compiles over 12 shapes before."""
    variants = {launch_plan(1, 40, 8, rows, context, 128, torch.bfloat16, False, False, multiprocessors=132).variant
                for rows, context in request_shapes(20)}
    assert len(variants) <= 3, variants
    decode = {launch_plan(1, 40, 8, 1, context, 128, torch.bfloat16, False, False, 132).variant
              for _, context in request_shapes(20)}
    assert len(decode) == 1  # one decode step's row: one variant whatever the context


def test_every_integer_that_changes_per_request_is_exempt_from_specialisation():
    fn = getattr(kernel_module._selected_attention_fwd, "fn", kernel_module._selected_attention_fwd)
    params = inspect.signature(fn).parameters
    pointers = {"Q", "K", "V", "Pos", "Out", "Acc", "Max", "Sum"}
    floats = {"qk_scale", "cap_scale", "cap_out"}
    constexprs = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    assert set(params) - pointers - floats - constexprs == set(DO_NOT_SPECIALIZE)


def test_gpu_check_dry_run_on_a_cpu_skips_gpu_steps_and_returns_at_most_six_files(tmp_path):
    if CUDA:
        pytest.skip("a dry run is for machines without CUDA")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "60"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 6, files
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"kernel_16k", "e2e_16k", "gpu_tests", "kernel_grid", "e2e_grid"}
    assert all(step["skipped"] == "no CUDA" for step in summary.values())
    log = (out / "log.txt").read_text()
    assert "python" in log and "skipped, no CUDA" in log


def test_e2e_benchmark_runs_every_tier_on_tiny_models_and_writes_its_rows(tmp_path):
    """The GPU run's end-to-end step, on tiny models on the CPU: the same code, so a mistake in it costs
    no device time."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu_e2e.py"), "--tiny", "--device", "cpu",
                           "--lengths", "256", "--repeats", "1", "--aux", "both", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["tier"] for r in rows} == {"-", "device", "host", "lmdb"}
    assert {"cacheclip (aux GPU)", "cacheclip (aux CPU)", "cacheclip (default: requery)", "cacheblend", "shared_prefix",
            "full"} <= {r["method"] for r in rows}
    for r in rows:
        assert r["ttft_s"] > 0 and r["other_s"] >= 0 and r["speedup_vs_full"] > 0


# ---- on the GPU machine ----------------------------------------------------------------------


def compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in fn.cache.values())


@pytest.mark.gpu
@gpu
def test_no_recompile_after_warm_up_over_twenty_request_lengths():
    from cacheclip_rag.kernels.selected_attention import selected_attention

    g = torch.Generator(device="cuda").manual_seed(0)

    def launch(rows: int, context: int) -> None:
        q = torch.randn(1, 40, rows, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 8, context, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        pos = torch.sort(torch.randperm(context, device="cuda", generator=g)[:rows]).values[None]
        selected_attention(q, k, k, pos, 128 ** -0.5)

    shapes = request_shapes(21, seed=1)
    launch(*shapes[0])
    torch.cuda.synchronize()
    warm = compiled_variants(kernel_module._selected_attention_fwd)
    for shape in shapes[1:]:
        launch(*shape)
    torch.cuda.synchronize()
    assert compiled_variants(kernel_module._selected_attention_fwd) == warm


@pytest.mark.gpu
@gpu
def test_read_into_cuda_slots_through_the_pinned_staging_ring(tmp_path):
    from cacheclip_rag.store import FP8, ChunkEntry, LMDBStore, as_stored

    entries = [ChunkEntry(torch.randn(2, 2, n, 16), torch.randn(2, 2, n, 16), tuple(range(n)),
                          tuple((i, i + 1) for i in range(n))) for n in (5, 40, 7, 33, 12, 9)]
    with LMDBStore(tmp_path) as store:
        for i, e in enumerate(entries):
            store.put(bytes([i]) * 32, "m", as_stored(e, FP8 if i % 3 == 2 else torch.bfloat16))
        buffers = torch.zeros(2, 1, 2, 200, 16, device="cuda", dtype=torch.bfloat16), \
            torch.zeros(2, 1, 2, 200, 16, device="cuda", dtype=torch.bfloat16)
        slots, at = [], 0
        for e in entries:
            n = e.num_tokens
            slots.append((buffers[0][:, 0, :, at:at + n], buffers[1][:, 0, :, at:at + n]))
            at += n
        keys = [bytes([i]) * 32 for i in range(len(entries))]
        got = store.read_into(keys, "m", slots)
        torch.cuda.synchronize()
        cpu = store.get_many(keys, "m")
        for g, c, slot in zip(got, cpu, slots):
            assert g is not None and torch.equal(slot[0].cpu(), c.keys.to(torch.bfloat16))
            assert torch.equal(slot[1].cpu(), c.values.to(torch.bfloat16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["shared_prefix", "cacheclip", "cacheblend"])
def test_layerwise_loading_on_cuda_gives_the_plain_loads_answer(tmp_path, method):
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.store import LMDBStore
    from cacheclip_rag.testing import tiny_model
    from cacheclip_rag.store.tiers import HostTier
    from tests.conftest import CHUNKS, QUESTION

    lm = tiny_model("gemma3")
    lm.model.to("cuda")
    config = EngineConfig(store_path=tmp_path / "a", system_prompt="Be brief.", device="cuda", store_dtype="float32")
    plain = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path / "a"), config=config, kernel=None)
    layered = Engine(primary=lm, aux=lm, store=HostTier(LMDBStore(tmp_path / "b"), 1 << 30, pin=True), config=config,
                     kernel=None)
    options = RequestOptions(method=method, ratio=0.3, max_new_tokens=4)
    for _ in range(2):  # computed on a miss, then held in pinned memory
        want, got = plain.generate(QUESTION, CHUNKS, options), layered.generate(QUESTION, CHUNKS, options)
        assert got.token_ids == want.token_ids
        assert (got.first_logits.float() - want.first_logits.float()).abs().max() < 1e-4


@pytest.mark.gpu
@gpu
def test_host_tier_pins_what_it_holds(tmp_path):
    from cacheclip_rag.store import ChunkEntry, LMDBStore
    from cacheclip_rag.store.tiers import HostTier

    with LMDBStore(tmp_path) as store:
        store.put(b"k" * 32, "m", ChunkEntry(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), tuple(range(5)), ()))
        tier = HostTier(store, 1 << 20)
        assert tier.pin and tier.get_many([b"k" * 32], "m")[0].keys.is_pinned()


def test_kernel_steps_need_no_lmdb():
    """The GPU machine has no lmdb wheel unless one travels: the kernel benchmark and the engine's
    imports must not need it (only opening a store does)."""
    code = ("import sys; sys.modules['lmdb'] = None\n"
            "import cacheclip_rag.kernels.selected_attention, cacheclip_rag.engine.core, cacheclip_rag.store.tiers\n"
            "import runpy; sys.argv = ['bench_kernel.py', '--help']\n"
            "try:\n    runpy.run_path('bench/bench_kernel.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('imported without lmdb')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported without lmdb" in proc.stdout, proc.stderr[-2000:]
