"""TTFT of `shared_prefix` (stored chunk KV reused) vs `full` prefill, real SmolLM2-135M, CPU.

Usage: python bench/bench_reuse.py [--chunks 4] [--sections 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import QUESTIONS, engine_with, handbook_chunks, median_of  # noqa: E402

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.models.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--sections", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model)
    engine = engine_with(lm, None)
    chunks = handbook_chunks(args.chunks, args.sections)
    engine.ingest(chunks, progress=False)
    question = QUESTIONS[0]
    rows = []
    for method in ("full", "direct", "shared_prefix"):
        opts = RequestOptions(method=method, max_new_tokens=1)
        engine.generate(question, chunks, opts)  # warm-up
        ttft = median_of(lambda: engine.generate(question, chunks, opts).timings.ttft_s, args.repeats)
        answer = engine.generate(question, chunks, opts)
        rows.append((method, answer.prompt_tokens, ttft, answer.timings.load_s))
    full = rows[0][2]
    print(f"model={args.model} threads={torch.get_num_threads()} chunks={args.chunks} repeats={args.repeats} (median)")
    print("| method | prompt tokens | TTFT (s) | load (s) | speedup vs full |")
    print("| --- | --- | --- | --- | --- |")
    for method, tokens, ttft, load in rows:
        print(f"| {method} | {tokens} | {ttft:.3f} | {load:.3f} | {full / ttft:.2f}x |")


if __name__ == "__main__":
    main()
