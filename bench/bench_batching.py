"""Does batching pay for the server's waiting requests? (the serve issue: "where requests wait together,
batch their question/recompute forwards if it pays (measure)").

On the serve benchmark's shape (the default primary, a `--context`-token cache per request, `--rows`
rows recomputed or read), B requests' forwards run one after another and then as one batch of B,
alternating, `--repeats` times, in one run: a prefill-like forward of `--rows` new rows over the cached
context (CacheClip's recompute and question pass), and one decode step. The gain is
time(B singles) / time(one batch of B); > 1 means batching pays. Those two kinds batch requests of
one length in one transformers cache (the upper bound). The kinds `ragged_decode` and `ragged_prefill`
measure what the server runs: `batching.forward_rows` over B blended caches of different lengths
(`--context` x 0.5 .. 1.5) and, for the prefill, different row counts (`--rows` x 0.5 .. 1.5), against
`forward_at` one request after another. Writes bench/results/batching.json:
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

from cacheclip_rag.stages.recompute.attention import use_cacheclip_attention  # noqa: E402
from cacheclip_rag.stages.decode.batching import RowsRequest, forward_rows  # noqa: E402
from cacheclip_rag.stages.load.ingest import new_cache  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402


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


def spread(value: int, batch: int) -> list[int]:
    """`batch` sizes from 0.5x to 1.5x `value` (ragged, as the server's requests are)."""
    return [max(1, round(value * (0.5 + i / max(1, batch - 1)))) for i in range(batch)]


@torch.inference_mode()
def measure_ragged(lm, kind: str, batch: int, context: int, rows: int, repeats: int) -> dict:
    """forward_rows over B blended caches of different lengths against forward_at request by request."""
    use_cacheclip_attention(lm.model)
    contexts = spread(context, batch)
    counts = spread(rows, batch) if kind == "ragged_prefill" else [1] * batch
    g = torch.Generator().manual_seed(0)
    requests = []
    for n, t in zip(contexts, counts):
        cache = new_cache(lm, n + t)
        forward_at(lm.model, cache, torch.randint(100, 20000, (1, n), generator=g), torch.arange(n)[None])
        requests.append(RowsRequest(cache, torch.randint(100, 20000, (t,), generator=g), torch.arange(n, n + t)))
    single_times, batch_times = [], []
    for _ in range(repeats):  # each forward rewrites the same rows: the caches stay the same size
        t0 = time.perf_counter()
        for r in requests:
            forward_at(lm.model, r.cache, r.input_ids[None], r.positions[None])
        single_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        forward_rows(lm.model, requests)
        batch_times.append(time.perf_counter() - t0)
    s, b = statistics.median(single_times), statistics.median(batch_times)
    return {"kind": kind, "batch": batch, "context": context, "rows": rows if kind == "ragged_prefill" else 1,
            "singles_s": s, "batched_s": b, "gain": s / b, "repeats": repeats,
            "date": datetime.date.today().isoformat()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--rows", type=int, default=150, help="rows per request in the prefill-like forward")
    p.add_argument("--batches", default="2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default="prefill,decode,ragged_prefill,ragged_decode")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "batching.json"))
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    known = ("prefill", "decode", "ragged_prefill", "ragged_decode")
    if any(k not in known for k in args.kinds.split(",")):
        p.error(f"--kinds must name some of {', '.join(known)}")
    if args.context < 1 or args.rows < 1 or args.repeats < 1 or min(batches) < 2:
        p.error("--context, --rows and --repeats must be >= 1, every batch >= 2")
    lm = load_model(args.model)
    model = lm.model
    out = []
    for batch in batches:
        for kind in args.kinds.split(","):
            rows = 1 if kind.endswith("decode") else args.rows
            if kind.startswith("ragged"):
                row = measure_ragged(lm, kind, batch, args.context, rows, args.repeats)
            else:
                row = measure(model, kind, batch, args.context, rows, args.repeats)
            print(f"{kind:14s} B={batch} ctx={args.context} rows={rows}: {batch} singles {row['singles_s']:.3f}s"
                  f"  batch {row['batched_s']:.3f}s  gain {row['gain']:.2f}x", flush=True)
            out.append(row)
    Path(args.json).write_text(json.dumps({"rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
