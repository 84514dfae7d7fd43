"""Would prefilling requests that arrive together in one forward get their first tokens sooner? (issue 70)

Four requests arrive at once. One after another (the worker today), request i's first token comes after the
prefills of requests 1..i: times T1, T1+T2, ... In one batched forward (`batching.forward_rows`: the rows of all
four packed into one sequence, each attending over its own cache by the CPU kernel), all four come at the batch's
time B. Batching wins the median only where B < the median of the cumulative times, i.e. where one forward over
4x the rows runs much faster per row than four forwards: on a GPU a single 2K prefill leaves most of the chip
idle, on a CPU its linears already run near the peak.

Measured for `full` (every prompt row) and for CacheClip's recompute forward (0.2 of the chunk rows, scattered,
plus the question's rows, over a loaded cache), at ~2K and ~4K tokens, on the default model as it is served
(bf16 with prepacked linears where the CPU has native bf16). Sequential and batched alternate, median of
`--repeats`.

    python bench/bench_batched_prefill.py --lengths 2048,4096 --requests 4 --repeats 3 --json bench/results/batched_prefill.json
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
sys.path.insert(0, str(ROOT / "bench"))

from common import recompute_rows  # noqa: E402
from cacheclip_rag.models.loading import LoadedModel, cpu_has_native_bf16, load_model  # noqa: E402
from cacheclip_rag.stages.decode.batching import RowsRequest, forward_rows  # noqa: E402
from cacheclip_rag.stages.load.ingest import new_cache  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402

def workload(lm: LoadedModel, kind: str, length: int, count: int, seed: int) -> list[RowsRequest]:
    """`count` requests of `length` tokens: a whole prompt into an empty cache (`full`), or 0.2 of the chunk rows
    (scattered) and the question's rows over a cache already holding the prompt (`recompute`)."""
    vocab = min(lm.config.vocab_size, 100_000)
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 100 + i)
        ids = torch.randint(1000, vocab, (length,), generator=g)
        cache = new_cache(lm, length + 8)
        if kind == "full":
            out.append(RowsRequest(cache, ids, torch.arange(length)))
            continue
        forward_at(lm.model, cache, ids[None], torch.arange(length)[None])  # the loaded caches' stand-in
        rows = recompute_rows(length, g)
        out.append(RowsRequest(cache, ids[rows], rows))
    return out


def sequential(lm: LoadedModel, requests: list[RowsRequest]) -> list[float]:
    """Each request's first-token time when they run one after another (cumulative)."""
    done, start = [], time.perf_counter()
    for r in requests:
        forward_at(lm.model, r.cache, r.input_ids[None], r.positions[None])
        done.append(time.perf_counter() - start)
    return done


def batched(lm: LoadedModel, requests: list[RowsRequest]) -> float:
    start = time.perf_counter()
    forward_rows(lm.model, requests)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--kinds", default="full,recompute")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm = load_model(args.model, dtype="auto")
    sequential(lm, workload(lm, "full", 64, 1, 0))  # warm: kernels built, pools up
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for kind in args.kinds.split(","):
            one_by_one, together = [], []
            for r in range(args.repeats):  # alternating, so load on the machine hits both
                for mode in (("seq", "batch") if r % 2 == 0 else ("batch", "seq")):
                    requests = workload(lm, kind, length, args.requests, seed=r)
                    if mode == "seq":
                        one_by_one.append(sequential(lm, requests))
                    else:
                        together.append(batched(lm, requests))
            cumulative = [statistics.median(run[i] for run in one_by_one) for i in range(args.requests)]
            batch = statistics.median(together)
            row = {"model": args.model, "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."), "kind": kind,
                   "tokens": length, "requests": args.requests, "rows_each": len(requests[0].input_ids),
                   "sequential_first_tokens_s": cumulative, "sequential_total_s": cumulative[-1],
                   "batched_s": batch, "batched_runs_s": together, "throughput_gain": cumulative[-1] / batch,
                   "p50_sequential_s": statistics.median(cumulative), "p50_batched_s": batch,
                   "threads": torch.get_num_threads(), "native_bf16": cpu_has_native_bf16(),
                   "repeats": args.repeats, "date": datetime.date.today().isoformat()}
            rows.append(row)
            print(f"{kind} ~{length} x{args.requests}: one by one {cumulative[-1]:.2f} s in all (p50 first token "
                  f"{row['p50_sequential_s']:.2f} s), batched {batch:.2f} s", flush=True)
    print(f"\n{args.model} ({rows[0]['dtype']}), {torch.get_num_threads()} threads, {args.requests} requests at once, "
          f"median of {args.repeats}")
    print("| forward | tokens | rows a request | one by one: all done s | batched s | throughput gain "
          "| p50 first token: one by one | batched |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['tokens']} | {r['rows_each']} | {r['sequential_total_s']:.2f} | {r['batched_s']:.2f} | "
              f"{r['throughput_gain']:.2f}x | {r['p50_sequential_s']:.2f} | {r['p50_batched_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
