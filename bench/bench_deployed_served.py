"""The deployed families through the server's routes and the frameworks' own RAG templates (issue 67): each
case's chunks ingested through `/v1/ingest`, then asked as a framework asks: LlamaIndex's default text-QA
template (`DEFAULT_TEXT_QA_PROMPT_TMPL`) through `/v1/completions`, and a LangChain `ChatPromptTemplate` RAG
prompt (system: the context, user: the question) through `/v1/chat/completions`. The server finds the
stored chunks inside those prompts and reuses them. Per route, the same request with `cacheclip.method`
"full", the default, and the default without the short-prompt floor; strict scores, the ratio the server
ran at, and each request's time to first token (streamed). Resumable: one JSON line per case.

    python bench/bench_deployed_served.py --family short --cases 52 --out bench/results/deployed_served.jsonl
    python bench/bench_deployed_served.py --report bench/results/deployed_served.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn
from langchain_core.prompts import ChatPromptTemplate
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT_TMPL
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import EngineConfig  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation.deployed import FAMILIES, WORDS_FOR, case, strict_score  # noqa: E402
from cacheclip_rag.evaluation.stats import wilson_interval  # noqa: E402
from cacheclip_rag.object_server import free_port  # noqa: E402
from cacheclip_rag.serve import ServerSettings, create_app, uvicorn_config  # noqa: E402

LANGCHAIN_RAG = ChatPromptTemplate.from_messages([
    ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
               "to answer the question. If you don't know the answer, say that you don't know. Keep the answer "
               "concise.\n\n{context}"),
    ("human", "{question}")])
VARIANTS = {"full": {"method": "full"}, "default": {}, "before": {"min_recompute_tokens": 0}}
MAX_TOKENS = 40


def streamed(create, **request) -> tuple[str, float, dict]:
    """The answer, its time to first token (first content piece) and the usage, from a streamed request."""
    started, first, text, usage = time.perf_counter(), None, "", {}
    for piece in create(stream=True, stream_options={"include_usage": True}, **request):
        if piece.usage is not None:
            usage = piece.usage.model_dump()
        for choice in piece.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            if delta:
                first = first or time.perf_counter() - started
                text += delta
    return text, first or time.perf_counter() - started, usage


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    done = {(json.loads(line)["case"]["family"], json.loads(line)["case"]["seed"]) for line in
            out.read_text().splitlines()} if out.exists() else set()
    words = 0 if args.family == "short" else WORDS_FOR[args.length]
    with tempfile.TemporaryDirectory() as store:
        engine = Engine.from_config(EngineConfig(aux=None, store_path=store))
        settings = ServerSettings(max_queue=4)
        app = create_app(engine, settings)
        port = free_port()
        server = uvicorn.Server(uvicorn_config(app, settings, "127.0.0.1", port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        try:
            for seed in tqdm([s for s in range(args.cases) if (args.family, s) not in done], desc=f"served {args.family}"):
                c = case(args.family, words, seed)
                httpx.post(url + "/v1/ingest", json={"documents": list(c.chunks)}, timeout=600).raise_for_status()
                context = "\n\n".join(c.chunks)
                completion = DEFAULT_TEXT_QA_PROMPT_TMPL.format(context_str=context, query_str=c.question)
                messages = [{"role": {"human": "user"}.get(m.type, m.type), "content": m.content}
                            for m in LANGCHAIN_RAG.format_messages(context=context, question=c.question)]
                rows = {}
                for route in ("completions", "chat"):
                    for name, ours in VARIANTS.items():
                        if route == "completions":
                            text, ttft, usage = streamed(client.completions.create, model="cacheclip", prompt=completion,
                                                         max_tokens=MAX_TOKENS, extra_body={"cacheclip": ours})
                        else:
                            text, ttft, usage = streamed(client.chat.completions.create, model="cacheclip",
                                                         messages=messages, max_tokens=MAX_TOKENS,
                                                         extra_body={"cacheclip": ours})
                        ours_usage = usage.get("cacheclip", {})
                        rows[f"{route}/{name}"] = {"output": text, "right": strict_score(text, c), "ttft_s": ttft,
                                                   "ratio": ours_usage.get("ratio"),
                                                   "recognised": ours_usage.get("chunks_recognised")}
                with open(out, "a") as f:
                    f.write(json.dumps({"case": {"family": c.family, "seed": c.seed, "chunks": len(c.chunks)},
                                        "rows": rows}) + "\n")
        finally:
            server.should_exit = True
            thread.join(timeout=60)


def report(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    table = []
    for route in ("completions", "chat"):
        solved = [r for r in rows if r["rows"][f"{route}/full"]["right"]]
        for name in VARIANTS:
            key = f"{route}/{name}"
            kept = sum(r["rows"][key]["right"] for r in solved)
            ttft = sorted(r["rows"][key]["ttft_s"] for r in rows)
            est = wilson_interval(kept, len(solved))
            table.append({"route": route, "method": name, "cases": len(rows), "full_right": len(solved), "kept": kept,
                          "strict_retention": {"mean": est.mean, "low": est.low, "high": est.high},
                          "median_ttft_s": ttft[len(ttft) // 2],
                          "recognised_all": sum(r["rows"][key]["recognised"] == r["case"]["chunks"] for r in rows),
                          "ratio_1": sum((r["rows"][key]["ratio"] or 0) >= 1.0 for r in rows)})
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="short")
    parser.add_argument("--length", type=int, default=2048, choices=tuple(WORDS_FOR))
    parser.add_argument("--cases", type=int, default=52)
    parser.add_argument("--out", default="bench/results/deployed_served.jsonl")
    parser.add_argument("--report")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.report:
        table = report(Path(args.report))
        for row in table:
            ret = row["strict_retention"]
            print(f"{row['route']:11} {row['method']:8} full right {row['full_right']:2}/{row['cases']} kept {row['kept']:2} "
                  f"{ret['mean']:.2f} [{ret['low']:.2f}, {ret['high']:.2f}] ttft {row['median_ttft_s']:.2f}s "
                  f"all chunks found {row['recognised_all']}/{row['cases']} ratio 1 {row['ratio_1']}")
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
