"""Does batching pay for the server's waiting requests? (the serve issue: "where requests wait together,
batch their question/recompute forwards if it pays (measure)").

On the serve benchmark's shape (the default primary, a `--context`-token cache per request, `--rows`
rows recomputed or read), B requests' forwards run one after another and then as one batch of B,
alternating, `--repeats` times, in one run: a prefill-like forward of `--rows` new rows over the cached
context (CacheClip's recompute and question pass), and one decode step. The gain is
time(B singles) / time(one batch of B); > 1 means batching pays. Writes bench/results/batching.json:
    {"rows": [{"kind", "batch", "context", "rows", "singles_s", "batched_s", "gain", "repeats", "date"}]}

    python bench/bench_batching.py [--model qwen2.5-coder-0.5b] [--context 600] [--rows 150] [--batches 2,4]
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
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.models import load_model  # noqa: E402


@torch.inference_mode()
def cached(model, batch: int, context: int, seed: int) -> DynamicCache:
    """A `context`-token cache for each of `batch` requests (random tokens: the cost does not depend on them)."""
    ids = torch.randint(100, 20000, (batch, context), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def forward_time(model, cache: DynamicCache, batch: int, context: int, rows: int) -> float:
    """One forward of `rows` new tokens per request over its cache; the rows are cropped off again after."""
    ids = torch.randint(100, 20000, (batch, rows))
    positions = torch.arange(context, context + rows).expand(batch, rows)
    t0 = time.perf_counter()
    model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    elapsed = time.perf_counter() - t0
    cache.crop(-rows)  # remove the rows again (negative: "remove this many", in every transformers version)
    return elapsed


def measure(model, kind: str, batch: int, context: int, rows: int, repeats: int) -> dict:
    singles = [cached(model, 1, context, seed) for seed in range(batch)]
    together = cached(model, batch, context, 0)
    single_times, batch_times = [], []
    for _ in range(repeats):
        single_times.append(sum(forward_time(model, c, 1, context, rows) for c in singles))
        batch_times.append(forward_time(model, together, batch, context, rows))
    s, b = statistics.median(single_times), statistics.median(batch_times)
    return {"kind": kind, "batch": batch, "context": context, "rows": rows, "singles_s": s, "batched_s": b,
            "gain": s / b, "repeats": repeats, "date": datetime.date.today().isoformat()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--rows", type=int, default=150, help="rows per request in the prefill-like forward")
    p.add_argument("--batches", default="2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "batching.json"))
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.context < 1 or args.rows < 1 or args.repeats < 1 or min(batches) < 2:
        p.error("--context, --rows and --repeats must be >= 1, every batch >= 2")
    model = load_model(args.model).model
    out = []
    for batch in batches:
        for kind, rows in (("prefill", args.rows), ("decode", 1)):
            row = measure(model, kind, batch, args.context, rows, args.repeats)
            print(f"{kind:8s} B={batch} ctx={args.context} rows={rows}: {batch} singles {row['singles_s']:.3f}s"
                  f"  batch {row['batched_s']:.3f}s  gain {row['gain']:.2f}x", flush=True)
            out.append(row)
    Path(args.json).write_text(json.dumps({"rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
