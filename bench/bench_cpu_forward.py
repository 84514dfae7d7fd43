"""How fast the base forward runs on this CPU: the engine's full prefill (the path every method's forward
takes) at 1K/2K/4K tokens in float32, bfloat16 (linears over oneDNN-prepacked weights, as `load_model`
leaves a bf16 CPU model), `bfloat16-onerow` (packed for one row only, the layout used before 2026-12-07),
`bfloat16-torchlayers` (norms and MLPs on torch's ops, not `kernel_layers`) and `bfloat16-dense` (plain linears), as effective GFLOP/s against the
best GEMM the cores reach in the same run, and one decode step at the same context. Prints one table;
`--json` writes the rows.

FLOPs are counted, not measured: 2 per weight of every decoder linear per token, the head on the last token
only (`logits_to_keep=1`), and 4 * heads * head_dim per causal query-key pair (scores and values). The
peak is the best of a few large GEMMs in each dtype (oneDNN; AVX-512 BF16 doubles bf16's rate where present).

    python bench/bench_cpu_forward.py [--model qwen2.5-coder-0.5b] [--lengths 1024,2048,4096] [--repeats 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.stages.load.ingest import kv_layout, new_cache  # noqa: E402
from cacheclip_rag.models.loading import LoadedModel, cpu_has_native_bf16, load_model, text_config  # noqa: E402
from cacheclip_rag.models.kernel_layers import use_kernel_layers  # noqa: E402
from cacheclip_rag.models.packed_linear import PackedLinear, pack_linears  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402

LINEARS = (torch.nn.Linear, PackedLinear)

GEMM_SHAPES = ((2048, 2048, 2048), (2048, 896, 4864), (4096, 4864, 896))


def gemm_peak(dtype: torch.dtype, repeats: int = 5) -> float:
    """Best GFLOP/s of `GEMM_SHAPES` (m, k, n) in `dtype`."""
    best = 0.0
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9)
    return best


def prefill_gflop(lm: LoadedModel, tokens: int) -> float:
    """Counted FLOPs (in G) of a full prefill of `tokens` tokens with the head on the last one."""
    config = text_config(lm.model)
    head_dim = kv_layout(lm)[2]
    layers = lm.model.model.layers
    linear = sum(m.in_features * m.out_features for m in layers.modules() if isinstance(m, LINEARS))
    head = lm.model.get_output_embeddings()
    head = head.in_features * head.out_features
    pairs = tokens * (tokens + 1) // 2
    attention = 4 * config.num_attention_heads * head_dim * pairs * len(layers)
    return (2 * linear * tokens + 2 * head + attention) / 1e9


def time_prefill(lm: LoadedModel, ids: torch.Tensor, decode_steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step milliseconds) of the path `full` takes: one forward over the
    prompt into a fresh cache, then single-token steps on the rows after it."""
    length = ids.shape[1]
    cache = new_cache(lm, length + decode_steps)
    start = time.perf_counter()
    forward_at(lm.model, cache, ids, torch.arange(length)[None])
    prefill = time.perf_counter() - start
    steps = []
    for i in range(decode_steps):
        start = time.perf_counter()
        forward_at(lm.model, cache, ids[:, i:i + 1], torch.tensor([[length + i]]))
        steps.append(time.perf_counter() - start)
    return prefill, 1e3 * statistics.median(steps)


def base_dtype(variant: str) -> str:
    return variant.split("-")[0]


def load_variant(model: str, variant: str) -> LoadedModel:
    """`variant`: a dtype, with "-dense" (linears left unpacked), "-onerow" (packed for one row only, the layout
    before `ROWS_HINTS`) or "-torchlayers" (norms and MLPs on torch's ops, not `kernel_layers`), so each gain is
    measured beside the default."""
    lm = load_model(model, dtype=base_dtype(variant), prepack=not variant.endswith(("-dense", "-onerow")))
    if variant.endswith("-onerow"):
        pack_linears(lm.model, (1,))
    if variant.endswith("-torchlayers"):
        use_kernel_layers(lm.model, on=False)
    return lm


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--dtypes", default="float32,bfloat16,bfloat16-dense")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtypes = args.dtypes.split(",")  # a dtype's name, or a variant of it (load_variant)
    models = {d: load_variant(args.model, d) for d in dtypes}
    peaks = {d: gemm_peak(getattr(torch, base_dtype(d))) for d in dtypes}
    vocab = models[dtypes[0]].config.vocab_size
    lengths = [int(x) for x in args.lengths.split(",")]
    gflops = {length: prefill_gflop(models[dtypes[0]], length) for length in lengths}
    rows = []
    for length in lengths:
        ids = torch.randint(1000, min(vocab, 100_000), (1, length), generator=torch.Generator().manual_seed(length))
        for dtype in dtypes:
            time_prefill(models[dtype], ids[:, :64], 1)  # warm
        runs: dict[str, list[tuple[float, float]]] = {dtype: [] for dtype in dtypes}
        for r in range(args.repeats):  # alternating, so load on the machine hits every dtype
            for dtype in (dtypes if r % 2 == 0 else dtypes[::-1]):
                runs[dtype].append(time_prefill(models[dtype], ids, args.decode_steps))
        for dtype in dtypes:
            prefill = statistics.median(t for t, _ in runs[dtype])
            gflop = gflops[length]
            rows.append({"model": args.model, "dtype": dtype, "tokens": length,
                         "prefill_s": prefill, "prefill_s_runs": [t for t, _ in runs[dtype]], "gflop": gflop,
                         "gflop_per_s": gflop / prefill, "peak_gemm_gflop_per_s": peaks[dtype],
                         "share_of_peak": gflop / prefill / peaks[dtype],
                         "decode_step_ms": statistics.median(d for _, d in runs[dtype]),
                         "threads": torch.get_num_threads(), "native_bf16": cpu_has_native_bf16(),
                         "repeats": args.repeats, "date": datetime.date.today().isoformat()})
    base = {(r["tokens"]): r for r in rows if r["dtype"] == "float32"}
    print(f"\n{args.model}, {torch.get_num_threads()} threads, native bf16: {cpu_has_native_bf16()}; "
          f"peak GEMM {', '.join(f'{d} {v:.0f} GFLOP/s' for d, v in peaks.items())}; median of {args.repeats}")
    print("| tokens | dtype | prefill s | GFLOP/s | of peak GEMM | prefill speed-up vs float32 | decode step ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        speedup = base[r["tokens"]]["prefill_s"] / r["prefill_s"] if r["tokens"] in base else float("nan")
        print(f"| {r['tokens']} | {r['dtype']} | {r['prefill_s']:.2f} | {r['gflop_per_s']:.0f} | "
              f"{r['share_of_peak']:.2f} | {speedup:.2f}x | {r['decode_step_ms']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
