"""Every method at one ratio on real models, at several context lengths: TTFT against `full`, the
recompute budget each actually spent, and first-token fidelity; CacheClip with the float aux and with
its int8 dynamic-quantized copy (and how much of the float selection the int8 one keeps).

Gemma 3 270M primary, SmolLM2-135M aux (cross-family), RULER prose samples (single2) chunked as the
evaluation chunks them, CPU. Usage:
    python bench/bench_methods.py [--lengths 2048,4096] [--ratio 0.2] [--samples 3] [--json bench/results/methods.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation import ruler
from cacheclip_rag.evaluation.fidelity import first_token_kl
from cacheclip_rag.evaluation.runner import token_counter
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.stages.select.selection import aux_attention
from cacheclip_rag.store import LMDBStore

VARIANTS = {  # label -> (engine, request options besides the ratio)
    "full": ("float", dict(method="full")),
    "shared_prefix": ("float", dict(method="shared_prefix")),
    "ape": ("float", dict(method="ape")),
    "cacheblend": ("float", dict(method="cacheblend")),
    "cacheclip": ("float", dict(method="cacheclip", selection="aux")),  # the paper's aux selection
    "cacheclip, int8 aux": ("int8", dict(method="cacheclip", selection="aux")),
    "cacheclip_requery": ("float", dict(method="cacheclip", selection="question")),  # the default selection since 2026-12-03
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--samples", type=int, default=3, help="prose samples (questions) per length")
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.manual_seed(0)
    primary, aux = load_model("gemma3-270m"), load_model("smollm2-135m")
    path = tempfile.mkdtemp(prefix="cacheclip-bench-")
    config = EngineConfig(store_path=path)
    engines = {"float": Engine(primary=primary, store=LMDBStore(path), config=config, aux=aux)}
    engines["int8"] = Engine(primary=primary, store=engines["float"].store, aux=aux,
                             config=replace(config, aux_quantization="int8"))
    count = token_counter(engines["float"])
    rows, overlaps = [], {}
    for length in lengths:
        samples = [ruler.generate("single2", length, seed, count) for seed in range(args.samples)]
        stats: dict[str, dict[str, list[float]]] = {k: {} for k in VARIANTS}
        overlaps[length] = []
        for i, sample in enumerate(samples):
            chunks = ruler.sample_chunks(sample, count)
            engines["float"].ingest(chunks, progress=False, direct=False)
            base = dict(ratio=args.ratio, max_new_tokens=1, answer_prefix=sample.answer_prefix)
            if i == 0:  # warm-up at this length
                for which in ("float", "int8"):
                    engines[which].generate(sample.question, chunks, RequestOptions(method="cacheclip", selection="aux", **base))
            full = None
            for label, (which, extra) in VARIANTS.items():
                engine = engines[which]
                answer = engine.generate(sample.question, chunks, RequestOptions(**base, **extra))
                full = answer if label == "full" else full
                plan = engine.plan(sample.question, chunks, RequestOptions(**base, **extra))
                chunk_tokens = plan.question_start - plan.prefix_len
                t = answer.timings
                row = stats[label]
                for key, value in (("ttft", t.ttft_s), ("select", t.select_s), ("recompute", t.recompute_s),
                                   ("load", t.load_s),
                                   ("share", 1.0 if label == "full" else answer.recomputed_tokens / chunk_tokens),
                                   ("kl", first_token_kl(full.first_logits, answer.first_logits))):
                    row.setdefault(key, []).append(value)
            options = RequestOptions(method="cacheclip", selection="aux", **base)
            plan = engines["float"].plan(sample.question, chunks, options)
            fp32 = set(aux_attention(engines["float"].parts, plan, options).positions(plan).tolist())
            int8 = set(aux_attention(engines["int8"].parts, plan, options).positions(plan).tolist())
            overlaps[length].append(len(fp32 & int8) / max(1, len(fp32 | int8)))
        full_ttft = statistics.mean(stats["full"]["ttft"])
        for label, row in stats.items():
            m = {k: statistics.mean(v) for k, v in row.items()}
            rows.append({"length": length, "method": label, "n": len(samples), **m, "speedup": full_ttft / m["ttft"]})
    print(f"primary=gemma3-270m aux=smollm2-135m ratio={args.ratio} samples/length={args.samples} "
          f"threads={torch.get_num_threads()} (means over samples; recomputed = share of chunk tokens)")
    print("| length | method | recomputed | load s | select s | recompute s | TTFT s | speedup vs full | first-token KL |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['length']} | {r['method']} | {100 * r['share']:.1f}% | {r['load']:.3f} | {r['select']:.3f} | "
              f"{r['recompute']:.3f} | {r['ttft']:.3f} | {r['speedup']:.2f}x | {r['kl']:.3f} |")
    for length, values in overlaps.items():
        print(f"int8 vs float aux selection at {length}: Jaccard {statistics.mean(values):.3f} "
              f"(min {min(values):.3f}, n={len(values)})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"ratio": args.ratio, "rows": rows,
                                               "int8_selection_jaccard": overlaps}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
