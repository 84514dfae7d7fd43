"""What storing chunk caches in half precision costs: bytes per token and fidelity, side by side.

For each storage dtype (float32, float16, bfloat16, float8 e4m3 with a scale per channel) the same RULER samples are ingested into a store
of their own and answered by `shared_prefix` and `cacheclip`; the table gives the stored bytes per
token of each model, and the first-token KL of each method against the same method over float32
storage (the storage cost alone) and against `full` (the method's total), with bootstrap 95%
intervals over the samples. Gemma 3 270M primary, SmolLM2-135M aux, CPU. Usage:
    python bench/bench_store_dtype.py [--length 1024] [--samples 16] [--json bench/results/store_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation import ruler
from cacheclip_rag.evaluation.fidelity import first_token_kl
from cacheclip_rag.evaluation.runner import ruler_engine, token_counter
from cacheclip_rag.evaluation.stats import bootstrap_ci
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.store import LMDBStore

DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
METHODS = ("shared_prefix", "cacheclip")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    primary, aux = load_model("gemma3-270m"), load_model("smollm2-135m")
    engines = {}
    for dtype in DTYPES:
        path = tempfile.mkdtemp(prefix=f"cacheclip-{dtype}-")
        engines[dtype] = Engine(primary=primary, store=LMDBStore(path), aux=aux,
                                config=EngineConfig(store_path=path, store_dtype=dtype))
    count = token_counter(engines["float32"])
    kl_storage = {(d, m): [] for d in DTYPES[1:] for m in METHODS}
    kl_full = {(d, m): [] for d in DTYPES for m in METHODS}
    for i in tqdm(range(args.samples), desc="samples"):
        sample = ruler.generate(ruler.TASKS[i % len(ruler.TASKS)], args.length, 2000 + i, count)
        chunks = ruler.sample_chunks(sample, count)
        base = dict(max_new_tokens=1, answer_prefix=sample.answer_prefix, prompt_stops=False, ratio=args.ratio)
        logits = {}
        for dtype, engine in engines.items():
            reader = ruler_engine(engine, sample)
            reader.ingest(chunks, progress=False)
            if dtype == "float32":
                logits["full"] = reader.generate(sample.question, chunks, RequestOptions(method="full", **base)).first_logits
            for method in METHODS:
                logits[dtype, method] = reader.generate(sample.question, chunks,
                                                        RequestOptions(method=method, **base)).first_logits
        for dtype in DTYPES:
            for method in METHODS:
                kl_full[dtype, method].append(first_token_kl(logits["full"], logits[dtype, method]))
                if dtype != "float32":
                    kl_storage[dtype, method].append(first_token_kl(logits["float32", method], logits[dtype, method]))
    sizes = {}
    for dtype, engine in engines.items():
        for row in engine.store.stats()["models"].values():
            sizes[dtype, ",".join(row["names"])] = row["bytes_per_token"]
    rows = []
    print(f"Gemma 3 270M + SmolLM2-135M, RULER {args.length} tokens, n={args.samples} samples, ratio {args.ratio}; "
          "KL in nats, mean [bootstrap 95% CI]")
    print("| storage | primary KB/token | aux KB/token | pair KB/token* | method | KL vs float32 storage | KL vs full |")
    print("|---|---|---|---|---|---|---|")
    for dtype in DTYPES:
        p_kb = sizes.get((dtype, primary.name), 0) / 1024
        a_kb = sizes.get((dtype, aux.name), 0) / 1024
        for method in METHODS:
            storage = bootstrap_ci(kl_storage[dtype, method]) if dtype != "float32" else None
            total = bootstrap_ci(kl_full[dtype, method])
            rows.append({"dtype": dtype, "method": method, "primary_kb_per_token": p_kb, "aux_kb_per_token": a_kb,
                         "kl_vs_float32_storage": None if storage is None else vars(storage),
                         "kl_vs_full": vars(total), "n": args.samples})
            print(f"| {dtype} | {p_kb:.1f} | {a_kb:.1f} | {p_kb + a_kb:.1f} | {method} | "
                  f"{'–' if storage is None else f'{storage.mean:.2e} [{storage.low:.2e}, {storage.high:.2e}]'} | "
                  f"{total.mean:.4f} [{total.low:.4f}, {total.high:.4f}] |")
    print("* per token of each model's own tokenizer, summed (the two tokenizers count a text within a few percent)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"length": args.length, "rows": rows}, indent=1))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
