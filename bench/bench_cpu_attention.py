"""One layer's attention on the CPU, bf16: `cpu_kernels.positioned_attention` against the torch paths it
replaces, side by side in one run (rotating, median of `--repeats`): a causal prefill (sdpa's causal path)
and CacheClip's scattered recompute rows (the row blocks of `blocked_attention`; sdpa over every key with the
position mask). Shapes of Qwen2.5-Coder-0.5B (14 heads, 2 KV heads, width 64) and 1.5B (12/2/128).
Effective GFLOP/s count the visible scores only (4·D a score: q·k and p·v). Prints one table; `--json`
writes the rows.

    python bench/bench_cpu_attention.py [--lengths 1024,2048,4096] [--ratio 0.2] [--repeats 5] [--json PATH]
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

from cacheclip_rag.models import cpu_kernels  # noqa: E402
from cacheclip_rag.stages.recompute.blocked_attention import blocked_attention, row_blocks  # noqa: E402

SHAPES = {"qwen2.5-coder-0.5b": (14, 2, 64), "qwen2.5-coder-1.5b": (12, 2, 128)}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(model: str, keys: int, rows: int, repeats: int, generator: torch.Generator) -> dict:
    heads, kv_heads, dim = SHAPES[model]
    query = torch.randn(1, heads, rows, dim, generator=generator).to(torch.bfloat16)
    key = torch.randn(1, kv_heads, keys, dim, generator=generator).to(torch.bfloat16)
    value = torch.randn(1, kv_heads, keys, dim, generator=generator).to(torch.bfloat16)
    scaling = dim ** -0.5
    if rows == keys:
        kind, positions = "causal prefill", torch.arange(keys)
        repeated = (key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1))
        torch_path = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            query, *repeated, is_causal=True, scale=scaling)
        torch_name = "sdpa causal"
    else:
        kind = "recompute rows"
        positions = torch.randperm(keys, generator=generator)[:rows].sort().values
        mask = (torch.arange(keys)[None, :] <= positions[:, None])[None, None]  # the default mask, boolean
        blocks = row_blocks(positions, group=heads // kv_heads)
        if blocks is not None:
            torch_path = lambda: blocked_attention(query, key, value, mask, blocks, scaling=scaling)  # noqa: E731
            torch_name = "row blocks"
        else:  # too few rows for two blocks: sdpa over every key, as forward_at does then
            repeated = (key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1))
            torch_path = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                query, *repeated, attn_mask=mask, scale=scaling)
            torch_name = "sdpa, masked"
    ours = lambda: cpu_kernels.positioned_attention(query, positions, key, value, scaling)  # noqa: E731
    runs: dict[str, list[float]] = {"kernel": [], "torch": []}
    ours(), torch_path()  # warm: the kernels' build, oneDNN's primitives
    for r in range(repeats):
        order = (("kernel", ours), ("torch", torch_path)) if r % 2 == 0 else (("torch", torch_path), ("kernel", ours))
        for name, fn in order:
            runs[name].append(seconds(fn))
    visible = float((positions + 1).clamp(max=keys).sum())
    flops = 4 * dim * heads * visible
    kernel_s, torch_s = statistics.median(runs["kernel"]), statistics.median(runs["torch"])
    return {"model": model, "case": kind, "keys": keys, "rows": rows, "torch_path": torch_name,
            "kernel_ms": kernel_s * 1e3, "torch_ms": torch_s * 1e3, "speedup": torch_s / kernel_s,
            "kernel_gflops": flops / kernel_s / 1e9, "torch_gflops": flops / torch_s / 1e9,
            "repeats": repeats, "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--ratio", type=float, default=0.2, help="recomputed rows' share of the keys")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not cpu_kernels.available():
        print(f"the CPU kernels are not available here: {cpu_kernels._state.get('reason')}")
        return 1
    generator = torch.Generator().manual_seed(0)
    rows = []
    for model in SHAPES:
        for keys in (int(x) for x in args.lengths.split(",")):
            for count in (keys, round(args.ratio * keys)):
                rows.append(case(model, keys, count, args.repeats, generator))
                r = rows[-1]
                print(f"{model} {r['case']} {keys}: kernel {r['kernel_ms']:.1f} ms, {r['torch_path']} "
                      f"{r['torch_ms']:.1f} ms", flush=True)
    print(f"\nbf16, {torch.get_num_threads()} threads, median of {args.repeats}, one layer")
    print("| model | case | keys | rows | kernel ms (GFLOP/s) | torch ms (GFLOP/s) | torch path | kernel speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['case']} | {r['keys']} | {r['rows']} | {r['kernel_ms']:.1f} "
              f"({r['kernel_gflops']:.0f}) | {r['torch_ms']:.1f} ({r['torch_gflops']:.0f}) | {r['torch_path']} | "
              f"{r['speedup']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
