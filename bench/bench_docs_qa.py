"""Real-docs QA (issue 35 #7): the project descriptions of packages this machine has installed (Faiss, tqdm,
xxhash, safetensors: real documentation, not generated text), split to MiniLM's window, indexed through the
LlamaIndex hook, and eleven questions answered by `full`, by `cacheclip` (its default selection) and by `cacheclip` with the paper's
aux selection, with the embedded default primary.
A question counts only when its expected answer occurs in the corpus (so every counted question is
answerable from the documents). Writes bench/results/docs_qa.json:
    {"rows": [{"question", "expected", "method", "answer", "right", "ttft_s"}], "summary": {...}}
    python bench/bench_docs_qa.py [--primary qwen2.5-coder-0.5b] [--ratio 0.2]"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import date
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOCS = ("faiss-cpu", "tqdm", "xxhash", "safetensors")
VARIANTS = {  # label -> RequestOptions besides the ratio
    "full": {"method": "full"},
    "cacheclip": {"method": "cacheclip"},  # the default selection (the question's attention)
    "cacheclip_paper": {"method": "cacheclip", "selection": "aux"},  # the paper's aux selection
}
MAX_CHARS = 6000  # each description's opening: the prose part, before the long API references
QUESTIONS = (
    ("Which research group at Meta primarily develops Faiss?", "Fundamental AI Research"),
    ("Besides optional GPU support, what is the only dependency of the Faiss library?", "BLAS"),
    ("Who implemented all of the GPU Faiss?", "Jeff Johnson"),
    ("Which build system does Faiss compile with?", "cmake"),
    ("Which GPU index can replace IndexFlatL2 as a drop-in replacement?", "GpuIndexFlatL2"),
    ("From which language's word does the name tqdm derive?", "Arabic"),
    ("What is tqdm's overhead per iteration, in nanoseconds?", "60"),
    ("Which shortcut can be used instead of tqdm(range(N))?", "trange"),
    ("What per-iteration overhead does ProgressBar have?", "800"),
    ("Who is the author of the xxHash library that python-xxhash binds?", "Yann Collet"),
    ("Which safetensors function loads tensors back from a file?", "load_file"),
)


def corpus() -> list[tuple[str, str]]:
    """(package, description text) for each installed package of DOCS: markup links and badges dropped."""
    out = []
    for name in DOCS:
        try:
            text = metadata.metadata(name).get_payload() or ""
        except metadata.PackageNotFoundError:
            continue
        text = re.sub(r"^\.\. (image|_).*$|^\s+:(target|alt):.*$|\|[A-Za-z-]+\|", "", text, flags=re.M)
        text = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text)  # markdown links -> their words
        out.append((name, re.sub(r"\n{3,}", "\n\n", text).strip()[:MAX_CHARS]))
    return out


def right(expected: str, answer: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(expected.lower())}(?!\d)", answer.lower()) is not None  # 60 is not 600


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primary", default=None, help="default: the engine's default primary")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--out", default="bench/results/docs_qa.json")
    args = parser.parse_args()

    from llama_index.core import Document, StorageContext, VectorStoreIndex

    from cacheclip_rag import Engine, EngineConfig, RequestOptions
    from cacheclip_rag.integrations.llamaindex import (CacheClipSynthesizer, CacheClipVectorStore, MiniLMEmbedding,
                                                       faiss_similarity_store, minilm_splitter)

    docs = corpus()
    text = "\n".join(t for _, t in docs)
    questions = [(q, a) for q, a in QUESTIONS if right(a, text)]
    print(f"corpus: {', '.join(n for n, _ in docs)} ({len(text)} chars); {len(questions)} answerable questions")
    if not questions:
        print("none of the packages' descriptions are installed", file=sys.stderr)
        return 1
    engine = Engine.from_config(EngineConfig(**({"primary": args.primary} if args.primary else {})))
    embed = MiniLMEmbedding()
    index = VectorStoreIndex.from_documents(
        [Document(text=t, metadata={"package": n}) for n, t in docs],
        storage_context=StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_similarity_store(), engine)),
        embed_model=embed, transformations=[minilm_splitter()])
    rows = []
    for question, expected in questions:
        for method, kw in VARIANTS.items():
            synth = CacheClipSynthesizer(engine, RequestOptions(ratio=args.ratio, max_new_tokens=32, **kw))
            response = synth.as_query_engine(index, similarity_top_k=args.top_k).query(question)
            answer = response.response.strip()
            info = response.metadata["cacheclip"]
            rows.append({"question": question, "expected": expected, "method": method, "answer": answer,
                         "right": right(expected, answer), "ttft_s": info["timings"]["ttft_s"],
                         "retrieved_has_answer": any(right(expected, n.node.get_content()) for n in response.source_nodes)})
            mark = "+" if rows[-1]["right"] else "-"
            print(f"{method:>15} {mark} {info['timings']['ttft_s']:5.2f}s {question[:50]!r} -> {answer[:60]!r}")
    summary = {m: {"right": sum(r["right"] for r in rows if r["method"] == m), "n": len(questions)} for m in VARIANTS}
    summary["retrieved_has_answer"] = sum(r["retrieved_has_answer"] for r in rows if r["method"] == "full")
    by = {(r["question"], r["method"]): r["right"] for r in rows}
    for m in VARIANTS:  # the questions `full` and this method both get right, and those they differ on
        if m != "full":
            summary[m]["both_right"] = sum(by[q, "full"] and by[q, m] for q, _ in questions)
            summary[m]["differs_from_full"] = sum(by[q, "full"] != by[q, m] for q, _ in questions)
    summary.update(primary=engine.primary.name, aux=engine.aux.name if engine.aux else None, ratio=args.ratio,
                   top_k=args.top_k, corpus=[n for n, _ in docs], date=date.today().isoformat())
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
