"""Decode speed at long contexts: the engine's decode steps over its blended cache against transformers'
own `generate` (a copy of the model loaded apart, on transformers' sdpa attention, dense linears) on the
same prompt, and against the engine with its linears left dense (`load_model(prepack=False)`: what the
prepacked oneDNN weights of `packed_linear` gain), and against the engine with each step run through
transformers' forward (`recompute.forward_at`) instead of `decode_step`'s lean loop (what the lean step
gains), and against the engine with the CPU decode kernels switched off (`cpu_kernels.set_enabled(False)` and,
for a float32 model on an AVX2 CPU, `half_gemv.set_enabled(False)`: what they gain), in the same run (rotating,
repeated). All in the dtype "auto" picks. Beside the rates, whether each variant's tokens equal the engine's with
the kernels off (float32 or bf16 weights read as they are). Prints one table; `--json` writes the rows.

The engine's rate is its own decode timing (tokens after the first over the time after TTFT). For
`generate`, prefill is taken out by difference: the time of `max_new_tokens = n + 1` minus that of
`max_new_tokens = 1`, over n tokens; both greedy, forced to the full length.

    python bench/bench_decode.py [--model qwen2.5-coder-0.5b] [--lengths 2048,4096] [--tokens 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.models import cpu_kernels, half_gemv  # noqa: E402
from cacheclip_rag.cli import demo_chunks  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402


def chunks_of(engine: Engine, tokens: int) -> list[str]:
    sections, out, total = demo_chunks(), [], 0
    while total < tokens:
        text = f"Part {len(out) + 1}. " + sections[len(out) % len(sections)]
        out.append(text)
        total += len(engine.primary.encode(text))
    return out


def engine_rate(engine: Engine, chunks: list[str], tokens: int, lean: bool = True, kernels: bool = True,
                answers: list[str] | None = None) -> float:
    """`lean=False`: every step through `forward_at`, as before `decode_step` existed. `kernels=False`: the
    CPU decode kernels switched off for this run (torch's, oneDNN's and MKL's paths). The answer's text is
    appended to `answers`."""
    for kernel in (cpu_kernels, half_gemv):
        kernel.set_enabled(kernels)
    try:
        return _engine_rate(engine, chunks, tokens, lean, answers if answers is not None else [])
    finally:
        for kernel in (cpu_kernels, half_gemv):
            kernel.set_enabled(True)


def _engine_rate(engine: Engine, chunks: list[str], tokens: int, lean: bool, answers: list[str]) -> float:
    options = RequestOptions(method="shared_prefix", max_new_tokens=tokens + 1, prompt_stops=False)
    plan = engine.plan("What does the handbook say?", chunks, options)
    prefill = engine.prefill(plan, options)
    stream = engine.decode(plan, prefill, options)
    stream.decoder.lean = stream.decoder.lean and lean
    for _ in stream:
        pass
    answers.append(stream.answer.text)
    return stream.answer.timings.decode_tokens_per_s


ENGINE_RUNS = ("engine", "engine_dense", "engine_forward_at", "engine_no_kernels")


def generate_rate(engine: Engine, model, chunks: list[str], tokens: int) -> float:
    """`model`: a copy of the primary loaded apart, so `generate` runs transformers' own sdpa attention."""
    options = RequestOptions(method="shared_prefix", max_new_tokens=tokens + 1)
    ids = torch.tensor([engine.plan("What does the handbook say?", chunks, options).all_ids()])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    return tokens / max(1e-9, timed(tokens + 1) - timed(1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm, stock = load_model(args.model), load_model(args.model, prepack=False).model  # ours; transformers' own
    stock.generation_config.pad_token_id = lm.tokenizer.pad_token_id or lm.tokenizer.eos_token_id
    path = tempfile.mkdtemp(prefix="cacheclip-bench-decode-")
    config, store = EngineConfig(store_path=path, aux=None), LMDBStore(path)
    engine = Engine(primary=lm, aux=None, store=store, config=config)
    dense = Engine(primary=load_model(args.model, prepack=False), aux=None, store=store, config=config)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        chunks = chunks_of(engine, length)
        engine.ingest(chunks, progress=False)
        texts: dict[str, list[str]] = {name: [] for name in ENGINE_RUNS}
        runs = {"engine": lambda: engine_rate(engine, chunks, args.tokens, answers=texts["engine"]),
                "engine_dense": lambda: engine_rate(dense, chunks, args.tokens, answers=texts["engine_dense"]),
                "engine_forward_at": lambda: engine_rate(engine, chunks, args.tokens, lean=False,
                                                         answers=texts["engine_forward_at"]),
                "engine_no_kernels": lambda: engine_rate(engine, chunks, args.tokens, kernels=False,
                                                         answers=texts["engine_no_kernels"]),
                "generate": lambda: generate_rate(engine, stock, chunks, args.tokens)}
        for warm in (engine, dense):
            engine_rate(warm, chunks, 2)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.repeats):  # rotating, so load on the machine hits each
            for name in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
                rates[name].append(runs[name]())
        prompt = engine.plan("What does the handbook say?", chunks, RequestOptions()).length
        ratios = [a / b for a, b in zip(rates["engine"], rates["generate"])]
        gains = [a / b for a, b in zip(rates["engine"], rates["engine_dense"])]
        lean_gains = [a / b for a, b in zip(rates["engine"], rates["engine_forward_at"])]
        kernel_gains = [a / b for a, b in zip(rates["engine"], rates["engine_no_kernels"])]
        rows.append({"model": args.model, "context": prompt, "engine_tok_s": statistics.median(rates["engine"]),
                     "engine_dense_tok_s": statistics.median(rates["engine_dense"]),
                     "engine_forward_at_tok_s": statistics.median(rates["engine_forward_at"]),
                     "lean_gain": statistics.median(lean_gains), "lean_gains": lean_gains,
                     "engine_no_kernels_tok_s": statistics.median(rates["engine_no_kernels"]),
                     "kernel_gain": statistics.median(kernel_gains), "kernel_gains": kernel_gains,
                     "cpu_kernels": cpu_kernels.available(), "half_gemv": half_gemv.available(),
                     "same_answer_as_no_kernels": {name: sum(t == base for t, base in zip(texts[name],
                                                                                          texts["engine_no_kernels"]))
                                                   / len(texts[name]) for name in ENGINE_RUNS},
                     "answers": {name: sorted(set(texts[name])) for name in ENGINE_RUNS},
                     "generate_tok_s": statistics.median(rates["generate"]), "ratio": statistics.median(ratios),
                     "packed_gain": statistics.median(gains), "dtype": str(lm.dtype).removeprefix("torch."),
                     "ratios": ratios, "packed_gains": gains, "tokens": args.tokens, "repeats": args.repeats,
                     "date": datetime.date.today().isoformat()})
    print(f"\n{args.model}, {str(lm.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"{args.tokens} decoded tokens, median of {args.repeats}")
    print("| context tokens | engine tok/s | engine, no CPU kernels | engine, dense linears | engine, steps by forward_at "
          "| transformers generate tok/s | engine / generate (per repeat) | kernel gain (per repeat) | packed gain "
          "| lean-step gain (per repeat) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['engine_tok_s']:.2f} | {r['engine_no_kernels_tok_s']:.2f} | "
              f"{r['engine_dense_tok_s']:.2f} | "
              f"{r['engine_forward_at_tok_s']:.2f} | {r['generate_tok_s']:.2f} | "
              f"{r['ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
              f"{r['kernel_gain']:.2f} ({', '.join(f'{x:.2f}' for x in r['kernel_gains'])}) | {r['packed_gain']:.2f} | "
              f"{r['lean_gain']:.2f} ({', '.join(f'{x:.2f}' for x in r['lean_gains'])}) |")
    for r in rows:
        print(f"{r['context']} tokens: answers equal to the kernels-off run's: "
              + ", ".join(f"{name} {share:.2f}" for name, share in r["same_answer_as_no_kernels"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
