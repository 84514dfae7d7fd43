"""Attention by row blocks on the CPU (`cacheclip_rag.stages.recompute.blocked_attention`), on and off side by side in one run.

Two cases, each paired (the same request with blocks and with one sdpa over every key, rotating which runs
first):
- a CacheClip request (the default: question selection, ratio 0.2) on Qwen2.5-Coder-0.5B over RULER
  samples of several tasks at each length: TTFT, the recompute stage's time, and whether the greedy
  answer (16 tokens) and its first-token distribution change (KL, on against off);
- a full prefill on Gemma 3 270M (five of every six layers have a 512-token window; their masks cut each
  block's keys to the window) at each length.

    python bench/bench_row_blocks.py [--lengths 2048,4096,8192] [--samples 3] [--repeats 2] [--json bench/results/row_blocks.json]
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
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.stages.recompute import blocked_attention  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.fidelity import first_token_kl  # noqa: E402
from cacheclip_rag.evaluation.runner import token_counter  # noqa: E402
from cacheclip_rag.stages.load.ingest import new_cache  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402

TASKS = ("single2", "multikey2", "multivalue", "multiquery")
DEFAULT = blocked_attention.PACKED_ROWS_PER_BLOCK
OFF = 10**12  # packed rows a block: never two blocks


def blocks_set(on: bool) -> None:
    blocked_attention.PACKED_ROWS_PER_BLOCK = DEFAULT if on else OFF


def request_rows(engine: Engine, lengths: list[int], samples: int, repeats: int) -> list[dict]:
    count = token_counter(engine)
    rows = []
    cases = [(length, TASKS[i % len(TASKS)], i) for length in lengths for i in range(samples)]
    for length, task, seed in tqdm(cases, desc="cacheclip requests", unit="request"):
        sample = ruler.generate(task, length, seed, count)
        chunks = ruler.sample_chunks(sample, count)
        engine.ingest(chunks, progress=False)
        options = RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=16, answer_prefix=sample.answer_prefix)
        engine.generate(sample.question, chunks, options)  # warm
        runs: dict[bool, list] = {True: [], False: []}
        for r in range(repeats):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                blocks_set(on)
                runs[on].append(engine.generate(sample.question, chunks, options))
        blocks_set(True)
        on, off = runs[True], runs[False]
        rows.append({
            "case": "cacheclip", "model": engine.primary.name, "length": length, "task": task, "seed": seed,
            "recomputed": on[0].recomputed_tokens,
            "ttft_on_s": statistics.median(a.timings.ttft_s for a in on),
            "ttft_off_s": statistics.median(a.timings.ttft_s for a in off),
            "recompute_on_s": statistics.median(a.timings.recompute_s for a in on),
            "recompute_off_s": statistics.median(a.timings.recompute_s for a in off),
            "same_answer": on[0].text == off[0].text,
            "first_token_kl": first_token_kl(off[0].first_logits, on[0].first_logits),
        })
    return rows


def prefill_rows(model: str, lengths: list[int], repeats: int) -> list[dict]:
    """Full prefills with blocks on and off; each one's first-token KL from a float32 prefill (which blocks
    change only by float rounding) says whether either loses more to bf16 rounding than the other."""
    lm, exact = load_model(model), load_model(model, dtype="float32")
    rows = []
    for length in tqdm(lengths, desc=f"{model} full prefill", unit="length"):
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
        times: dict[bool, list[float]] = {True: [], False: []}
        logits = {}
        for r in range(repeats + 1):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                blocks_set(on)
                cache = new_cache(lm, length)
                start = time.perf_counter()
                logits[on] = forward_at(lm.model, cache, ids, torch.arange(length)[None])[0, -1]
                if r:  # the first round warms up
                    times[on].append(time.perf_counter() - start)
        blocks_set(False)
        reference = forward_at(exact.model, new_cache(exact, length), ids, torch.arange(length)[None])[0, -1]
        blocks_set(True)
        rows.append({
            "case": "full prefill", "model": lm.name, "dtype": str(lm.dtype).removeprefix("torch."), "length": length,
            "ttft_on_s": statistics.median(times[True]), "ttft_off_s": statistics.median(times[False]),
            "same_answer": bool(logits[True].argmax() == logits[False].argmax()),
            "first_token_kl": first_token_kl(logits[False], logits[True]),
            "kl_from_float32_on": first_token_kl(reference, logits[True]),
            "kl_from_float32_off": first_token_kl(reference, logits[False]),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--samples", type=int, default=3, help="RULER samples a length (tasks in turn)")
    ap.add_argument("--repeats", type=int, default=2, help="paired runs a case (medians)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    path = tempfile.mkdtemp(prefix="cacheclip-bench-")
    engine = Engine(primary=load_model("qwen2.5-coder-0.5b"), store=LMDBStore(path),
                    config=EngineConfig(store_path=path))
    dtype = str(engine.primary.dtype).removeprefix("torch.")
    rows = request_rows(engine, lengths, args.samples, args.repeats)
    del engine
    rows += prefill_rows("gemma3-270m", lengths, args.repeats)
    print(f"{dtype}, threads={torch.get_num_threads()}, packed rows a block={DEFAULT}; on = blocks, off = one sdpa over every key")
    print("| case | model | length | task | recomputed | TTFT off | TTFT on | on ÷ off | recompute off → on | same answer | KL on vs off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        recompute = f"{r['recompute_off_s']:.2f} → {r['recompute_on_s']:.2f} s" if "recompute_on_s" in r else "–"
        print(f"| {r['case']} | {r['model']} | {r['length']} | {r.get('task', '–')} | {r.get('recomputed', '–')} | "
              f"{r['ttft_off_s']:.2f} s | {r['ttft_on_s']:.2f} s | {r['ttft_on_s'] / r['ttft_off_s']:.2f} | {recompute} | "
              f"{r['same_answer']} | {r['first_token_kl']:.1e} |")
    for case in ("cacheclip", "full prefill"):
        for length in lengths:
            ratios = [r["ttft_on_s"] / r["ttft_off_s"] for r in rows if r["case"] == case and r["length"] == length]
            if ratios:
                print(f"{case} {length}: on ÷ off geometric mean {statistics.geometric_mean(ratios):.3f} (n={len(ratios)})")
    for r in rows:
        if "kl_from_float32_on" in r:
            print(f"{r['model']} {r['length']}: KL from a float32 prefill, blocks on {r['kl_from_float32_on']:.1e}, "
                  f"off {r['kl_from_float32_off']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "threads": torch.get_num_threads(), "dtype": dtype,
            "packed_rows_per_block": DEFAULT, "rows": rows}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
