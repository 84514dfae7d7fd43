"""`cacheclip serve` under a stream of RAG requests, on loopback: chunks of Zipf popularity in random
orders (every request a new ordering, the case where prefix caches stop helping), pasted into a RAG
framework's system message as LangChain's RAG prompt does; 1, 4 and 16 concurrent clients; `cacheclip`
and `full` in the same run (alternating per concurrency level). TTFT (first streamed token) p50/p99,
requests/s, the share of prompt tokens read from stored caches over time, and the chunk lookup's share
of TTFT. Bounded: `--requests` per (method, concurrency), `--limit-s` in all. Also the lookup's cost
with 10^5 stored chunks. Prints one table; writes bench/results/serve.json.

    python bench/bench_serve.py [--requests 16] [--concurrency 1,4,16] [--chunks 32] [--per-request 4]
    python bench/bench_serve.py --tiny --requests 4     # the same code on tiny random models (a smoke run)
    python bench/bench_serve.py --methods cacheclip --concurrency 4 --max-tokens 32 --max-batch 8,1 \
        --json bench/results/serve_batching.json        # decode batching on and off, one server each, same stream
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from cacheclip_rag.cli import demo_chunks  # noqa: E402
from cacheclip_rag.config import EngineConfig  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.engine.recognize import ChunkIndex  # noqa: E402

SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
          "answer the question.\n\n")
QUESTIONS = ("How many pistons support the mirror?", "Who directs the observatory?", "When was the planet found?",
             "What is the archive server called?", "How far is the hospital?")


def corpus(count: int, chars: int = 600) -> list[str]:
    sections = demo_chunks()
    return [f"Record {i}. " + (sections[i % len(sections)] * 4)[:chars] for i in range(count)]


def zipf_pick(rng: random.Random, n: int, k: int, s: float = 1.1) -> list[int]:
    weights = [1 / (i + 1) ** s for i in range(n)]
    picked: list[int] = []
    while len(picked) < k:
        i = rng.choices(range(n), weights)[0]
        if i not in picked:
            picked.append(i)
    rng.shuffle(picked)  # a new order each time
    return picked


def start_server(engine: Engine, port: int, max_batch: int = 8):
    import uvicorn

    from cacheclip_rag.serve import ServerSettings, create_app

    app = create_app(engine, ServerSettings(max_queue=64, timeout_s=3600, max_batch=max_batch))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread


async def one_request(http: httpx.AsyncClient, url: str, chunks: list[str], question: str, method: str,
                      max_tokens: int) -> dict:
    body = {"model": "cacheclip", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM + "\n\n".join(chunks)}, {"role": "user", "content": question}],
            "cacheclip": {"method": method, "ratio": 0.2}}
    t0, ttft, usage = time.perf_counter(), None, None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {await reply.aread()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "latency": time.perf_counter() - t0,
            "usage": usage}


async def run_level(url: str, texts: list[str], method: str, clients: int, requests: int, per_request: int,
                    max_tokens: int, seed: int, deadline: float) -> list[dict]:
    rng = random.Random(seed)
    jobs = [(zipf_pick(rng, len(texts), per_request), rng.choice(QUESTIONS)) for _ in range(requests)]
    results: list[dict] = []
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            picked, question = queue.get_nowait()
            result = await one_request(http, url, [texts[i] for i in picked], question, method, max_tokens)
            result["done_at"] = time.monotonic()
            results.append(result)

    async with httpx.AsyncClient(timeout=3600) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.monotonic() - started
    for r in results:
        r["elapsed"] = elapsed
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def by_quarter(values: list[float], summary) -> list[float]:
    """`summary` of each contiguous quarter of the stream, in completion order (decay shows as a trend)."""
    n = len(values)
    cuts = [round(i * n / 4) for i in range(5)]
    return [summary(values[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]


def lookup_cost(stored: int = 100_000, found: int = 16) -> dict:
    """ChunkIndex over `stored` texts of ~800 characters; one ~16K-token prompt holding `found` of them."""
    rng = random.Random(0)
    words = "harbour lamp ferry tide ledger mirror piston archive planet survey dawn island bakery".split()
    texts = [f"Document {i}: " + " ".join(rng.choice(words) for _ in range(130)) for i in range(stored)]
    t0 = time.perf_counter()
    index = ChunkIndex(texts)
    build = time.perf_counter() - t0
    prompt = SYSTEM + "\n\n".join(rng.sample(texts, found)) + "\n\nQuestion: what does the ledger say?"
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        matches = index.find(prompt)
        times.append(time.perf_counter() - t0)
    assert len(matches) == found
    return {"stored_chunks": stored, "prompt_chars": len(prompt), "found": len(matches), "build_s": build,
            "find_s": statistics.median(times)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cold", action="store_true", help="ingest behind the engine's own prompt, not the clients'")
    p.add_argument("--requests", type=int, default=16, help="per method and concurrency level")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--per-request", type=int, default=4)
    p.add_argument("--chunk-chars", type=int, default=600, help="characters per chunk (~4 per token)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--limit-s", type=float, default=3600)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--methods", default="cacheclip,full")
    p.add_argument("--max-batch", default="8", help="the server's --max-batch; several: one server each, in turn")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = p.parse_args()
    path = tempfile.mkdtemp(prefix="cacheclip-bench-serve-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # a scratch store (~0.7 GB): not left behind
    if args.tiny:
        from cacheclip_rag.store import LMDBStore
        from cacheclip_rag.testing import tiny_model

        lm = tiny_model("llama")
        lm.config.max_position_embeddings = 8192  # the tiny tokenizer spends ~3x the real ones' tokens
        engine = Engine(primary=lm, aux=lm, store=LMDBStore(path), config=EngineConfig(store_path=path))
    else:
        engine = Engine.from_config(EngineConfig(store_path=path))
    texts = corpus(args.chunks, args.chunk_chars)
    deadline = time.monotonic() + args.limit_s
    # behind the start the clients' prompts will have (their system message up to the chunks), as a RAG app
    # deploying the server does; `--cold` leaves them to be computed on first sight instead
    ingest = {"documents": texts} if args.cold else {"documents": texts, "system": SYSTEM}
    rows, timeline = [], []
    for max_batch in (int(b) for b in args.max_batch.split(",")):
        port = args.port + len(rows)  # a fresh port for each server
        server, thread = start_server(engine, port, max_batch)
        url = f"http://127.0.0.1:{port}"
        httpx.post(url + "/v1/ingest", json=ingest, timeout=3600).raise_for_status()  # a no-op once stored
        for clients in (int(c) for c in args.concurrency.split(",")):
            for method in args.methods.split(","):
                results = asyncio.run(run_level(url, texts, method, clients, args.requests, args.per_request,
                                                args.max_tokens, seed=clients, deadline=deadline))
                if not results:
                    continue
                ttfts = [r["ttft"] for r in results]
                reused = [r["usage"]["prompt_tokens_details"]["cached_tokens"] / r["usage"]["prompt_tokens"]
                          for r in results if r["usage"]]
                lookup = [r["usage"]["cacheclip"]["recognise_s"] / r["ttft"] for r in results if r["usage"]]
                latency = [r["latency"] for r in results]
                rows.append({"method": method, "clients": clients, "max_batch": max_batch, "requests": len(results),
                             "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
                             "latency_p50_s": percentile(latency, 0.5),
                             "requests_per_s": len(results) / results[0]["elapsed"],
                             "reused_share_mean": statistics.mean(reused) if reused else 0.0,
                             "reused_share_by_quarter": by_quarter(reused, statistics.mean),
                             "ttft_p50_by_quarter_s": by_quarter(ttfts, statistics.median),
                             "lookup_share_of_ttft_max": max(lookup) if lookup else 0.0,
                             "max_tokens": args.max_tokens, "date": datetime.date.today().isoformat()})
                timeline += [{"method": method, "clients": clients, "max_batch": max_batch, "i": i, "reused": x}
                             for i, x in enumerate(reused)]
                print(rows[-1], flush=True)
        server.should_exit = True
        thread.join(timeout=30)
    lookup = lookup_cost(10_000 if args.tiny else 100_000)
    print(f"\nprimary {engine.primary.name}, aux {engine.aux.name if engine.aux else None}, {args.chunks} chunks "
          f"(Zipf s=1.1, {args.per_request} a request, new order each), {args.max_tokens} tokens decoded")
    print("| clients | method | max batch | requests | TTFT p50 s | TTFT p99 s | latency p50 s | req/s | "
          "share of prompt read from cache | lookup / TTFT (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['method']} | {r['max_batch']} | {r['requests']} | {r['ttft_p50_s']:.2f} | "
              f"{r['ttft_p99_s']:.2f} | {r['latency_p50_s']:.2f} | "
              f"{r['requests_per_s']:.3f} | {r['reused_share_mean']:.2f} | {100 * r['lookup_share_of_ttft_max']:.2f}% |")
    for clients, max_batch in sorted({(r["clients"], r["max_batch"]) for r in rows}):
        pair = {r["method"]: r for r in rows if r["clients"] == clients and r["max_batch"] == max_batch}
        if {"full", "cacheclip"} <= set(pair):
            print(f"{clients} clients: full p50 / cacheclip p50 = {pair['full']['ttft_p50_s'] / pair['cacheclip']['ttft_p50_s']:.2f}x")
    print(f"lookup with {lookup['stored_chunks']:,} stored chunks: {1e3 * lookup['find_s']:.1f} ms for a "
          f"{lookup['prompt_chars']:,}-character prompt ({lookup['found']} found); index built in {lookup['build_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "lookup": lookup, "timeline": timeline}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
