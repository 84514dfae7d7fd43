"""Decode served against decode in the engine: what a token (and the first token) costs through `cacheclip serve` (the server's
worker thread, and the client's view through the real `openai` client) against the engine's own decode
on the main thread, same model, same prompt (~2K tokens from the bundled handbook), in one run with
rounds alternating. With `--baseline-tree PATH` (a checkout of an older commit) that tree's server runs in
alternate rounds too, for a before/after.

The gap it was written for: in-engine decode steps took 57-60 ms and served ones ~70 ms (bf16, issue 50).
The cause was libgomp's throttled spin-wait once more OpenMP pools live than CPUs (`openmp_pools`).

    python bench/bench_served_decode.py [--rounds 2] [--requests 3] [--tokens 64] [--baseline-tree /tmp/old] \
        [--json bench/results/served_decode.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "anchors"))

import httpx  # noqa: E402
import openai  # noqa: E402

from bench_serve import SYSTEM, corpus  # noqa: E402
from run_anchors import external  # noqa: E402

QUESTION = "Describe everything these records say, in full detail."
# an older checkout's server: its tree ahead of this one's editable install (which a `-m` run from here finds)
LAUNCH_TREE = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
               "sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'cacheclip'; "
               "runpy.run_module('cacheclip_rag.cli', run_name='__main__')")


def served(tree: str | None, store: str, pool: list[str], requests: int, tokens: int, port: int) -> list[dict]:
    """ms a token after the first, as the worker timed it and as the client saw it, per request."""
    url = f"http://127.0.0.1:{port}"
    launch = ["-c", LAUNCH_TREE, tree] if tree else ["-m", "cacheclip_rag.cli"]
    command = [sys.executable, *launch, "serve", "--store", store, "--port", str(port), "--max-queue", "8"]
    messages = [{"role": "system", "content": SYSTEM + "\n\n".join(pool)}, {"role": "user", "content": QUESTION}]
    out = []
    with external(command, {}, url, Path(tempfile.gettempdir()) / "cacheclip-served-decode.log"):
        httpx.post(url + "/v1/ingest", json={"documents": pool, "system": SYSTEM}, timeout=3600).raise_for_status()
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        for i in range(requests + 1):  # the first warms up
            first = last = usage = None
            started = time.perf_counter()
            for event in client.chat.completions.create(model="cacheclip", messages=messages, max_tokens=tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                now = time.perf_counter()
                if event.choices and event.choices[0].delta.content:
                    first, last = first or now, now
                usage = event.usage or usage
            worker = usage.model_extra["cacheclip"]["timings"]["decode_tokens_per_s"]
            if i and usage.completion_tokens > 1:
                out.append({"worker_ms": 1e3 / worker,
                            "client_ms": 1e3 * (last - first) / (usage.completion_tokens - 1),
                            "ttft_ms": 1e3 * (first - started), "tokens": usage.completion_tokens})
    return out


def engine_alone(store: str, pool: list[str], requests: int, tokens: int) -> list[dict]:
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.models.loading import load_model
    from cacheclip_rag.store import LMDBStore

    engine = Engine(primary=load_model("qwen2.5-coder-0.5b"), aux=None, store=LMDBStore(store),
                    config=EngineConfig(store_path=store, aux=None, system_prompt=SYSTEM))
    engine.ingest(pool, progress=False)
    options = RequestOptions(max_new_tokens=tokens, prompt_stops=False)
    out = []
    for i in range(requests + 1):
        answer = engine.generate(QUESTION, pool, options)
        if i:
            out.append({"engine_ms": 1e3 / answer.timings.decode_tokens_per_s, "ttft_ms": 1e3 * answer.timings.ttft_s})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=3, help="per server start or engine run, after a warm-up")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--baseline-tree", default=None)
    p.add_argument("--port", type=int, default=8797)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    store, pool = tempfile.mkdtemp(prefix="cacheclip-served-decode-"), corpus(7, chars=1200)
    kinds = {"served": None} | ({"served_baseline": args.baseline_tree} if args.baseline_tree else {})
    rows: dict[str, list] = {name: [] for name in [*kinds, "engine"]}
    for _ in range(args.rounds):
        for name, tree in kinds.items():
            rows[name] += served(tree, store, pool, args.requests, args.tokens, args.port)
        rows["engine"] += json.loads(subprocess.check_output([sys.executable, __file__, "--engine-run", store,
                                                              str(args.requests), str(args.tokens)]))
    table = {name: {key: statistics.median(r[key] for r in got) for key in got[0] if key.endswith("_ms")} | {"n": len(got)}
             for name, got in rows.items()}
    print(f"\ndecode ms a token, median (n requests); {args.tokens} tokens, ~2K context, 1 client")
    print("| run | decode: worker (engine: its own) | decode: client | TTFT | n |")
    print("|---|---|---|---|---|")
    for name, t in table.items():
        print(f"| {name} | {t.get('worker_ms', t.get('engine_ms')):.1f} | {t.get('client_ms', float('nan')):.1f} | "
              f"{t['ttft_ms']:.0f} | {t['n']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "rows": rows, "tokens": args.tokens,
                                               "baseline_tree": args.baseline_tree,
                                               "date": datetime.date.today().isoformat()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--engine-run":  # a process of its own: the main thread, one pool
        print(json.dumps(engine_alone(sys.argv[2], corpus(7, chars=1200), int(sys.argv[3]), int(sys.argv[4]))))
        raise SystemExit(0)
    raise SystemExit(main())
