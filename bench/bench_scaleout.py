"""Beyond one machine (issue 69). This part: the cold tier on S3-compatible object storage, against a real S3
server process on loopback (moto's standalone server, `cacheclip_rag.object_server`).

`--part read`: a request's stored chunks read from each tier into the request's cache slots, entries shaped as
the default primary's (Qwen2.5-Coder-0.5B: 24 layers x 2 KV heads x 64, bfloat16, 256-token chunks), 8 and 16
chunks (2K and 4K tokens): the hot tier (`LMDBStore.read_into`, page cache warm) and the cold tier
(`S3Store.read_into`: concurrent GETs, each entry's checksum and values verified on arrival). MB/s, median of
`--repeats`, both timed in the same repeat.

`--part ttft`: time to first token on the default primary and request defaults, topical single-fact requests
(`evaluation.deployed`, ~2K and ~4K tokens, known answers), per request in one run:
- `full`: no store (everything recomputed: the baseline a cache must beat);
- `miss`: cacheclip with nothing stored (the chunks computed on the miss, then the recompute);
- `cold`: cacheclip with the chunks only in the bucket (a fresh replica: an empty local tier);
- `hot`: the same replica's next request (promoted into its local tier on the cold read).
Each row's answers stand beside its times: right (strict) and equal to `full`'s.

`--part routers`: 4 replicas on a local Ray Serve (`serve.replicas`, tiny random models: this part measures
routing, not a model), each with a bounded host-memory fast tier (`--fast-share` of the corpus's caches, a third by default) in front of its
local LMDB, over one S3 bucket. The corpus (160 chunks of everyday prose) is ingested once through `/v1/ingest`
behind the clients' system text. Requests come from 4 concurrent clients, behind varied questions, as JSON on
`/v1/chat/completions`. Three workloads (`zipf_requests`): `independent` (3-6 chunks drawn by Zipf popularity,
s = 1.1, each on its own, shuffled), `topical` (a topic drawn by Zipf popularity, 3-5 of its 5 chunks, shuffled:
chunks retrieved together, as a document's sections are) and `topical-prefix` (the same in the document's order,
so requests share prompt prefixes: the prefix router's best case). Routers side by side in one run: Serve's default
(power of two choices), prefix affinity (the policy of today's LLM routers), and chunk affinity (ours). Per
router: the share of chunk entries served from a replica's memory (the `host` tier; the first 10% of requests
warm up and are not counted), from its local disk (LMDB) and from the bucket, p50/p95 TTFT (the server's), requests/s, and load spread (max/min requests per
replica).

    python bench/bench_scaleout.py --part read --json bench/results/scaleout.json
    python bench/bench_scaleout.py --part ttft --cases 8 --json bench/results/scaleout.json
    python bench/bench_scaleout.py --part routers --requests 240 --json bench/results/scaleout.json

moto keeps objects in Python memory and answers from one Python process: it is a slow S3 (a real object store
on a LAN or in-region serves several times faster per connection). The rows say what this machine measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation.deployed import WORDS_FOR, case, strict_score  # noqa: E402
from cacheclip_rag.evaluation.stats import wilson_interval  # noqa: E402
from cacheclip_rag.object_server import S3Server  # noqa: E402
from cacheclip_rag.store import ChunkEntry, LMDBStore, entry_key  # noqa: E402
from cacheclip_rag.store.factory import open_store  # noqa: E402
from cacheclip_rag.store.s3_store import S3Store  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 24, 2, 64, 256


def qwen_entry(i: int) -> ChunkEntry:
    g = torch.Generator().manual_seed(i)
    shape = (LAYERS, KV_HEADS, CHUNK, HEAD_DIM)
    return ChunkEntry(keys=torch.randn(*shape, generator=g).bfloat16(), values=torch.randn(*shape, generator=g).bfloat16(),
                      token_ids=tuple(range(CHUNK)), offsets=tuple((j, j + 1) for j in range(CHUNK)))


def read_rows(server: S3Server, repeats: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="scaleout-read-"))
    rows = []
    try:
        lmdb = LMDBStore(work / "hot")
        s3 = S3Store(server.bucket("read") + "/bench")
        for chunks in (8, 16):
            keys = [entry_key("bench", (), f"chunk {chunks}/{i}", "shared") for i in range(chunks)]
            items = [(k, "bench", qwen_entry(i)) for i, k in enumerate(keys)]
            lmdb.put_many(items)
            s3.put_many(items)
            nbytes = sum(e.keys.numel() * 2 * 2 for _, _, e in items)
            slots = [(torch.empty(LAYERS, KV_HEADS, CHUNK, HEAD_DIM, dtype=torch.bfloat16),
                      torch.empty(LAYERS, KV_HEADS, CHUNK, HEAD_DIM, dtype=torch.bfloat16)) for _ in keys]
            times: dict[str, list[float]] = {"hot (LMDB)": [], "cold (S3)": []}
            lmdb.read_into(keys, "bench", slots)  # warm the page cache and the once-per-process verification
            for _ in tqdm(range(repeats), desc=f"read {chunks} chunks"):
                for name, store in (("hot (LMDB)", lmdb), ("cold (S3)", s3)):
                    started = time.perf_counter()
                    found = store.read_into(keys, "bench", slots)
                    times[name].append(time.perf_counter() - started)
                    assert all(f is not None for f in found)
            for name, seconds in times.items():
                median = statistics.median(seconds)
                rows.append({"part": "read", "tier": name, "chunks": chunks, "tokens": chunks * CHUNK, "bytes": nbytes,
                             "median_s": median, "mb_per_s": nbytes / median / 1e6, "repeats": repeats})
        s3.close()
        lmdb.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def ttft_rows(server: S3Server, cases_per_length: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="scaleout-ttft-"))
    bucket = server.bucket("ttft") + "/corpus"
    options = RequestOptions(max_new_tokens=24)
    records = []
    try:
        config = EngineConfig(store_path=work / "writer", shared_store=bucket, aux=None)
        writer = Engine.from_config(config)
        lm = writer.primary
        for length in (2048, 4096):
            for seed in tqdm(range(cases_per_length), desc=f"ttft {length}"):
                c = case("topical", WORDS_FOR[length], 1000 + seed)  # not the families' reported seeds
                row: dict = {"length": length, "seed": seed, "conditions": {}}

                def ask(engine: Engine, name: str, method: str = "cacheclip") -> None:
                    answer = engine.generate(c.question, c.chunks, replace(options, method=method))
                    row["conditions"][name] = {"ttft_s": answer.timings.ttft_s, "output": answer.text,
                                               "right": strict_score(answer.text, c)}

                nothing = Engine(primary=lm, store=open_store(work / f"none-{length}-{seed}"), config=config)
                ask(nothing, "full", "full")
                ask(nothing, "miss")
                writer.ingest(list(c.chunks), progress=False)  # into the bucket (and the writer's local tier)
                replica = Engine(primary=lm, store=open_store(work / f"replica-{length}-{seed}", bucket), config=config)
                ask(replica, "cold")
                ask(replica, "hot")
                row["cold_tier_hits"] = replica.store.remote_hits
                full = row["conditions"]["full"]["output"]
                for cond in row["conditions"].values():
                    cond["equal_full"] = cond["output"] == full
                records.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for length in (2048, 4096):
        mine = [r for r in records if r["length"] == length]
        for name in ("full", "miss", "cold", "hot"):
            got = [r["conditions"][name] for r in mine]
            right = sum(g["right"] for g in got)
            rows.append({"part": "ttft", "length": length, "condition": name, "n": len(got),
                         "median_ttft_s": statistics.median(g["ttft_s"] for g in got),
                         "right": right, "right_ci": asdict(wilson_interval(right, len(got))),
                         "equal_full": sum(g["equal_full"] for g in got)})
    return rows + [{"part": "ttft_requests", "records": records}]


CLIENT_SYSTEM = "Use the context to answer.\n\n"
_SUBJECTS = ("the harbour office", "the north ferry", "the old mill", "the library annex", "the tide station",
             "the night market", "the hill school", "the river clinic", "the glass works", "the ring road")
_VERBS = ("opens", "closes", "moves", "reopens", "changes its hours", "holds a meeting", "gets a new roof")


def corpus(n: int = 160) -> list[str]:
    import random

    rng = random.Random(69)
    chunks = []
    for i in range(n):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        sentences = [f"Notice {i}: {subject} {rng.choice(_VERBS)} on day {rng.randint(1, 28)} of month {rng.randint(1, 12)}."]
        sentences += [f"People who use {rng.choice(_SUBJECTS)} should plan for {rng.choice(_VERBS)} later in the season, "
                      f"and the council will post details at {rng.choice(_SUBJECTS)}." for _ in range(2)]
        chunks.append(" ".join(sentences))
    return chunks


TOPICS = 32  # the topical workloads: the corpus in 32 topics of 5 chunks (a document's sections)


def zipf_requests(n: int, chunks: list[str], workload: str, seed: int) -> list[list[str]]:
    """`independent`: 3-6 distinct chunks drawn by Zipf popularity (s = 1.1), shuffled. `topical`: a topic drawn by
    Zipf popularity, then 3-5 of its chunks, shuffled (what a retriever returns: the sections of the document a
    question is about, in its order of scores). `topical-prefix`: the same, in the document's order (requests about
    one topic then share prompt prefixes: the prefix router's best case)."""
    import random

    rng = random.Random(seed)
    requests = []
    per = len(chunks) // TOPICS
    for _ in range(n):
        if workload == "independent":
            weights = [1 / (rank + 1) ** 1.1 for rank in range(len(chunks))]
            picked: set[int] = set()
            want = rng.randint(3, 6)
            while len(picked) < want:
                picked.add(rng.choices(range(len(chunks)), weights)[0])
            order = list(picked)
        else:
            topic = rng.choices(range(TOPICS), [1 / (rank + 1) ** 1.1 for rank in range(TOPICS)])[0]
            order = sorted(rng.sample(range(topic * per, (topic + 1) * per), rng.randint(3, per)))
        if workload != "topical-prefix":
            rng.shuffle(order)
        requests.append([chunks[i] for i in order])
    return requests


def replica_builder(model: str, folder: Path, bucket: str, keys: dict, environment: dict, fast_bytes: int):
    """Each replica's engine: the tiny test model (`TinyReplica`), or the default model as `cacheclip serve
    --replicas` builds it (`ConfiguredReplica`: Qwen2.5-Coder-0.5B-Instruct, the engine's defaults)."""
    from cacheclip_rag.serve.app import ServerSettings
    from cacheclip_rag.serve.replicas import ConfiguredReplica
    from cacheclip_rag.testing import TinyReplica

    if model == "tiny":
        return TinyReplica(str(folder), bucket, keys, environment, host_bytes=fast_bytes)
    config = EngineConfig(store_path=str(folder), shared_store=bucket, host_cache_bytes=fast_bytes)
    return ConfiguredReplica(config, ServerSettings(tenant_keys=dict(keys), index_refresh_s=0.2))


def router_rows(server: S3Server, requests_per_run: int, fast_share: float, workloads: list[str], routers: list[str],
                load_bound: float | None = None, model: str = "tiny") -> list[dict]:
    import os
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import ray
    from ray import serve as ray_serve

    from cacheclip_rag.object_server import free_port
    from cacheclip_rag.serve.keys import OPERATOR
    from cacheclip_rag.serve.replicas import application
    key = "sk-bench-" + "x" * 16
    chunks = corpus()
    environment = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    # the default model: one thread a replica (four replicas' thread pools on 2 cores spin against each other)
    threads = {"OMP_NUM_THREADS": "1"} if model != "tiny" else {}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {**environment, **threads}}, log_to_driver=False)
    port = free_port()
    ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    rows = []
    work = Path(tempfile.mkdtemp(prefix="scaleout-routers-"))
    try:
        for workload in workloads:
            for router in routers:
                bucket = server.bucket(f"routers-{workload}-{router}") + "/corpus"
                entry_bytes = ENTRY_BYTES if model == "tiny" else LAYERS * KV_HEADS * HEAD_DIM * 2 * 2 * 270
                build = replica_builder(model, work / f"{workload}-{router}", bucket, {key: OPERATOR}, environment,
                                        int(entry_bytes * len(chunks) * fast_share))
                ray_serve.run(application(build, bucket, 4, {key: OPERATOR}, router=router, stats_period_s=0.5,
                                          replica_cpus=0, **({"load_bound": load_bound} if load_bound else {})),
                              name="cacheclip", route_prefix="/")
                ingest = httpx.post(url + "/v1/ingest", json={"documents": chunks, "system": CLIENT_SYSTEM},
                                    headers=headers, timeout=3600)
                assert ingest.status_code == 200, ingest.text
                time.sleep(2.0)  # the front's index reads the texts

                def ask(i_chunks):
                    i, picked = i_chunks
                    body = {"model": "cacheclip", "max_tokens": 2, "messages": [
                        {"role": "system", "content": CLIENT_SYSTEM + "\n\n".join(picked)},
                        {"role": "user", "content": f"What happens at notice number {i}?"}]}
                    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
                    assert answer.status_code == 200, answer.text
                    usage = answer.json()["usage"]["cacheclip"]
                    return answer.headers["x-cacheclip-replica"], usage

                requests = zipf_requests(requests_per_run, chunks, workload, seed=7)
                started = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    results = list(tqdm(pool.map(ask, enumerate(requests)), total=len(requests),
                                        desc=f"{workload}/{router}"))
                elapsed = time.perf_counter() - started
                counted = results[len(results) // 10:]
                host_hits = sum(max(0, u["timings"]["store"].get("host_hits", 0) - 1) for _, u in counted)
                lmdb_hits = sum(u["timings"]["store"].get("lmdb_hits", 0) for _, u in counted)
                s3_hits = sum(u["timings"]["store"].get("s3_hits", 0) for _, u in counted)
                entries = sum(u["chunks_recognised"] for _, u in counted)
                ttfts = sorted(u["timings"]["ttft_s"] for _, u in counted)
                per_replica: dict[str, int] = {}  # replicas that got nothing count too (spread: null)
                for name, _ in results:
                    per_replica[name] = per_replica.get(name, 0) + 1
                rows.append({"part": "routers", "model": model, "workload": workload, "router": router, "fast_share": fast_share,
                             "requests": len(results),
                             "counted": len(counted), "memory_hit_rate": host_hits / max(1, entries),
                             "local_disk_rate": lmdb_hits / max(1, entries), "bucket_rate": s3_hits / max(1, entries),
                             "recognised_per_request": entries / max(1, len(counted)),
                             "p50_ttft_s": ttfts[len(ttfts) // 2], "p95_ttft_s": ttfts[int(len(ttfts) * 0.95)],
                             "requests_per_s": len(results) / elapsed,
                             "load_spread": (max(per_replica.values()) / min(per_replica.values())
                                             if len(per_replica) == 4 else None),
                             "per_replica": sorted(per_replica.values()),
                             # per counted request, in the same order for every router (paired comparisons)
                             "ttft_each_s": [u["timings"]["ttft_s"] for _, u in counted],
                             "memory_hits_each": [max(0, u["timings"]["store"].get("host_hits", 0) - 1) for _, u in counted]})
                print({k: v for k, v in rows[-1].items() if not k.endswith("_each") and not k.endswith("_each_s")})
                ray_serve.delete("cacheclip")
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return rows + comparisons(rows)


def comparisons(rows: list[dict]) -> list[dict]:
    """Ours against each other router on the same requests: memory hit rate and p50 TTFT as ratios, with paired
    bootstrap 95% intervals (requests resampled)."""
    import numpy as np

    from cacheclip_rag.evaluation.stats import ratio_of_means

    out = []
    for ours in (r for r in rows if r["router"] == "affinity"):
        for peer in (r for r in rows if r["workload"] == ours["workload"] and r["router"] != "affinity"):
            a, b = np.array(ours["ttft_each_s"]), np.array(peer["ttft_each_s"])
            idx = np.random.default_rng(0).integers(0, len(a), size=(10_000, len(a)))
            ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
            out.append({"part": "routers_vs", "workload": ours["workload"], "against": peer["router"],
                        "memory_hit_ratio": ratio_of_means(list(zip(ours["memory_hits_each"], peer["memory_hits_each"]))),
                        "p50_ttft_ratio": {"mean": float(np.median(a) / np.median(b)),
                                           "low": float(np.quantile(ratios, 0.025)),
                                           "high": float(np.quantile(ratios, 0.975)), "n": int(len(a))}})
    return out


ENTRY_BYTES = 3 * 2 * 2 * 16 * 4 * 270  # the tiny model's cache of a ~270-token chunk (float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("read", "ttft", "routers"), required=True)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--workloads", default="independent,topical,topical-prefix")
    parser.add_argument("--routers", default="pow2,prefix,affinity")
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny",
                        help="the replicas' model: the tiny test model, or the default (Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--load-bound", type=float, default=None, help="the affinity router's load bound (default: its own)")
    parser.add_argument("--fast-share", type=float, default=1 / 3, help="a replica's memory tier: this share of the corpus")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--json", default="bench/results/scaleout.json")
    args = parser.parse_args()
    server = S3Server()
    try:
        with server.environment():
            if args.part == "read":
                rows = read_rows(server, args.repeats)
            elif args.part == "ttft":
                rows = ttft_rows(server, args.cases)
            else:
                rows = router_rows(server, args.requests, args.fast_share, args.workloads.split(","), args.routers.split(","),
                                   args.load_bound, args.model)
    finally:
        server.stop()
    for row in rows:
        if row["part"] == "read":
            print(f"{row['tier']:>11} {row['chunks']:>2} chunks ({row['bytes'] / 1e6:.0f} MB): "
                  f"{row['median_s'] * 1e3:8.1f} ms  {row['mb_per_s']:8.0f} MB/s")
        elif row["part"] == "routers_vs":
            hit, ttft = row["memory_hit_ratio"], row["p50_ttft_ratio"]
            print(f"{row['workload']:>14} affinity vs {row['against']:>6}: memory hits {hit['mean']:.2f}x "
                  f"[{hit['low']:.2f}, {hit['high']:.2f}], p50 TTFT {ttft['mean']:.2f}x [{ttft['low']:.2f}, {ttft['high']:.2f}]")
        elif row["part"] == "ttft":
            print(f"{row['length']} {row['condition']:>5}: n={row['n']} median TTFT {row['median_ttft_s']:.2f} s, "
                  f"right {row['right']}/{row['n']}, equal to full {row['equal_full']}/{row['n']}")
    out = Path(args.json)
    results = json.loads(out.read_text()) if out.exists() else {}
    name = f"routers_{args.fast_share:.3f}" if args.part == "routers" else f"cold_{args.part}"
    if args.part == "routers" and args.model != "tiny":
        name += f"_{args.model}"
    results[name] = {"date": datetime.date.today().isoformat(), "machine": _machine(), "rows": rows}
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _machine() -> str:
    import os
    import platform

    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor() or platform.machine())
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    raise SystemExit(main())
