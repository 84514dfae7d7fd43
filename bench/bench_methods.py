"""Every method at one ratio on real models: TTFT vs `full`, and fidelity of the first answer token.

Gemma 3 270M primary, SmolLM2-135M aux (cross-family), ~2K-token prompts of 4 chunks, CPU.
Agreement: the method's greedy first answer token equals full attention's; KL(full || method) of
the first-token distribution. Usage: python bench/bench_methods.py [--ratio 0.2] [--questions 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import QUESTIONS, engine_with, handbook_chunks  # noqa: E402

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.models import load_model

VARIANTS = {  # label -> request options besides the ratio
    "full": dict(method="full"),
    "direct": dict(method="direct"),
    "shared_prefix": dict(method="shared_prefix"),
    "cacheblend": dict(method="cacheblend"),
    "cacheclip": dict(method="cacheclip"),
    "cacheclip (no grouping)": dict(method="cacheclip", grouping=False),
    "oracle": dict(method="oracle"),
}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--primary", default="gemma3-270m")
    ap.add_argument("--aux", default="smollm2-135m")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--sections", type=int, default=3)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    args = ap.parse_args()
    torch.manual_seed(0)
    primary = load_model(args.primary)
    aux = primary if args.aux == args.primary else load_model(args.aux)
    engine = engine_with(primary, aux)
    chunks = handbook_chunks(args.chunks, args.sections)
    engine.ingest(chunks, progress=False)
    questions = QUESTIONS[: args.questions]
    engine.generate(questions[0], chunks, RequestOptions(method="cacheclip", max_new_tokens=1))  # warm-up
    stats: dict[str, dict[str, list[float]]] = {k: {} for k in VARIANTS}
    for question in questions:
        reference = None
        for label, extra in VARIANTS.items():
            answer = engine.generate(question, chunks, RequestOptions(ratio=args.ratio, max_new_tokens=1, **extra))
            reference = answer if label == "full" else reference
            t = answer.timings
            row = stats[label]
            for key, value in (("ttft", t.ttft_s), ("select", t.select_s), ("recompute", t.recompute_s),
                               ("load", t.load_s), ("recomp", answer.recompute_fraction),
                               ("agree", float(answer.token_ids[0] == reference.token_ids[0])),
                               ("kl", kl(reference.first_logits, answer.first_logits))):
                row.setdefault(key, []).append(value)
    full_ttft = statistics.mean(stats["full"]["ttft"])
    print(f"primary={args.primary} aux={args.aux} ratio={args.ratio} prompt~{engine.plan(questions[0], chunks, RequestOptions()).length} "
          f"tokens, {len(questions)} questions, threads={torch.get_num_threads()} (means)")
    print("| method | recomputed | load s | select s | recompute s | TTFT s | speedup | first-token agreement | KL(full‖m) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, row in stats.items():
        m = {k: statistics.mean(v) for k, v in row.items()}
        print(f"| {label} | {100 * m['recomp']:.1f}% | {m['load']:.3f} | {m['select']:.3f} | {m['recompute']:.3f} | "
              f"{m['ttft']:.3f} | {full_ttft / m['ttft']:.2f}x | {100 * m['agree']:.0f}% | {m['kl']:.3f} |")


if __name__ == "__main__":
    main()
