"""What bfloat16 costs in quality: `full` in bfloat16 (the CPU default where bf16 is native) against `full` in
float32 on the same RULER prompts as the 2K quality bench (its tasks and seeds), in one run. Per sample: the
teacher-forced KL(float32 || bf16) along float32's greedy answer, top-1 agreement on it, whether the two greedy
answers are identical, and each one's score. Prints one table with n and 95% bootstrap intervals (the score
difference paired); `--json` writes it.

Resumable: one JSON row per sample is appended to `--rows`; samples already there are skipped.

    python bench/bench_bf16_quality.py [--length 2048] [--samples 13] [--limit-minutes 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.fidelity import teacher_forced_fidelity  # noqa: E402
from cacheclip_rag.evaluation.records import token_counter  # noqa: E402
from cacheclip_rag.evaluation.runner import PROFILES, decode_budget, jobs_of, ruler_engine  # noqa: E402
from cacheclip_rag.evaluation.stats import bootstrap_ci, paired_bootstrap_ci  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402


def answer(engine: Engine, sample: ruler.Sample, chunks: list[str]) -> tuple[str, list[int], object, object]:
    """`full`'s greedy answer (text, tokens), its plan and prefill, decoded to the evaluation's budget."""
    options = RequestOptions(method="full", max_new_tokens=max(32, decode_budget(engine, sample)),
                             answer_prefix=sample.answer_prefix, prompt_stops=False)
    plan = engine.plan(sample.question, chunks, options)
    prefill = engine.prefill(plan, options)
    stream = engine.decode(plan, prefill, options)
    text = "".join(stream)
    return text, list(stream.token_ids), plan, prefill


def measure(engines: dict[str, Engine], sample: ruler.Sample, count) -> dict:
    chunks = ruler.sample_chunks(sample, count)
    views = {name: ruler_engine(engine, sample) for name, engine in engines.items()}
    results = {name: answer(view, sample, chunks) for name, view in views.items()}
    reference = results["float32"][1]
    rows = {name: views[name].teacher_forced_logits(plan, prefill, reference).float()
            for name, (_, _, plan, prefill) in results.items()}
    kl, top1 = teacher_forced_fidelity(rows["float32"], rows["bfloat16"], reference)
    return {"task": sample.task, "length": sample.target_tokens, "seed": sample.seed, "tf_kl": kl, "tf_top1": top1,
            "identical": results["float32"][1] == results["bfloat16"][1],
            **{f"score_{name}": ruler.score(text, sample.references, sample.wrong)
               for name, (text, *_) in results.items()},
            **{f"output_{name}": text for name, (text, *_) in results.items()}, "references": list(sample.references)}


def summarize(rows: list[dict]) -> dict:
    def estimate(values):
        e = bootstrap_ci(values)
        return {"mean": e.mean, "low": e.low, "high": e.high, "n": len(values)}

    diff = paired_bootstrap_ci([r["score_bfloat16"] for r in rows], [r["score_float32"] for r in rows])
    return {"n": len(rows), "tf_kl": estimate([r["tf_kl"] for r in rows]),
            "tf_top1": estimate([r["tf_top1"] for r in rows]),
            "identical_answers": estimate([float(r["identical"]) for r in rows]),
            "score_float32": estimate([r["score_float32"] for r in rows]),
            "score_bfloat16": estimate([r["score_bfloat16"] for r in rows]),
            "score_difference": {"mean": diff.mean, "low": diff.low, "high": diff.high, "n": len(rows)},
            "date": datetime.date.today().isoformat()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=13, help="per task (the 2K quality bench: 13 of each of 8)")
    p.add_argument("--rows", default=str(ROOT / "bench/results/bf16_quality.jsonl"))
    p.add_argument("--json", default=str(ROOT / "bench/results/bf16_quality.json"))
    p.add_argument("--limit-minutes", type=float, default=None)
    args = p.parse_args()
    path = Path(args.rows)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["task"], r["length"], r["seed"]) for r in rows}
    profile = PROFILES["power"]
    jobs = [(task, args.length, seed) for task, length, seed in jobs_of(profile)
            if length == profile.lengths[0] and seed < args.samples and (task, args.length, seed) not in done]
    store = tempfile.mkdtemp(prefix="cacheclip-bf16-quality-")
    engines = {name: Engine(primary=load_model(args.model, dtype=name), aux=None, store=LMDBStore(store),
                            config=EngineConfig(store_path=store, aux=None)) for name in ("float32", "bfloat16")}
    count = token_counter(engines["float32"])  # the evaluation's own counter: the same samples as its runs
    deadline = time.monotonic() + 60 * args.limit_minutes if args.limit_minutes else None
    for task, length, seed in tqdm(jobs, desc="bf16 vs float32", unit="sample"):
        if deadline is not None and time.monotonic() > deadline:
            break
        with torch.inference_mode():
            row = measure(engines, ruler.generate(task, length, seed, count), count)
        rows.append(row)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    report = summarize(rows)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.model}, `full` in bfloat16 vs float32, {args.length} tokens, n = {report['n']} samples")
    print("| measure | value [95% interval] |")
    print("|---|---|")
    for key in ("tf_kl", "tf_top1", "identical_answers", "score_float32", "score_bfloat16", "score_difference"):
        e = report[key]
        print(f"| {key} | {e['mean']:.4f} [{e['low']:.4f}, {e['high']:.4f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
