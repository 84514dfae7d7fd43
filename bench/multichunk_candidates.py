"""Remedies for multi-chunk answers (issue 54), each run on every case of an evaluation folder where `full`
lists every value, over the same blended cache the default loads; strict solves paired against the default's
answer in the folder's records (`cacheclip_requery` at ratio 0.2).

Conditions (comma-separated):
- `ratio_R`: the default selection at ratio R (what ratio keeps the lists?);
- `backfill_L`: the default's scores, each row ranked by the best score within the next L rows of its chunk
  (and the 4 before it), at the same ratio: the budget goes to the picked sentences' preceding context;
- `ratio_R@lower` / `ratio_R@upper`: the default at ratio R, its recomputed chunk rows written back only in the
  lower (upper) half of the layers, the other half keeping the reused rows: which layers matter?
- `twostage_P`: ProphetKV's two stages through the engine's own path: the aux's pick of P of the 0.2 budget
  recomputed first, then the question's attention over that cache spends the rest (needs `--aux`);
- `preceding` / `following`: the default's rows plus every row of each value chunk before (after) its value
  sentence, a diagnosis that knows where the values are (not a method).

    python bench/multichunk_candidates.py bench/eval-multichunk --conditions ratio_0.3,ratio_0.5,backfill_32 \
        --out bench/results/multichunk_candidates.jsonl
    python bench/multichunk_candidates.py bench/eval-multichunk --report bench/results/multichunk_candidates.json

`--chunk-signal` asks whether the question's attention could tell a per-request budget that the answer spans
several chunks: per chunk, its peak score over its median, and how many of the value chunks the top chunks by
that measure find (as many as there are value chunks), against chance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from diagnose_multichunk import (  # noqa: E402
    answer,
    append_row,
    decode_until_complete,
    ingested,
    recomputed,
    value_rows,
)

from cacheclip_rag.stages.load import blend  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.runner import decode_budget, token_counter  # noqa: E402
from cacheclip_rag.evaluation.stats import sign_test, wilson_interval  # noqa: E402
from cacheclip_rag.stages.request import Prefill  # noqa: E402
from cacheclip_rag.stages.select.selection import SEPARATOR, question_attention, question_scores, to_budget  # noqa: E402

DEFAULT = "cacheclip_requery"


def backfilled(score: torch.Tensor, reach: int, before: int = 4) -> torch.Tensor:
    """Each row's rank key: the best score from `before` rows before it to `reach` rows after it, plus a
    thousandth of its own score (so a run ties-breaks toward its peak)."""
    n = score.numel()
    padded = torch.cat([torch.full((before,), float("-inf")), score, torch.full((reach,), float("-inf"))])
    windows = padded.unfold(0, before + reach + 1, 1)[:n]
    return windows.max(dim=1).values + 1e-3 * score


def backfill_rows(engine: Engine, plan, options: RequestOptions, reach: int) -> tuple[object, list[torch.Tensor]]:
    parts = engine.parts
    cache = blend.blended_cache(parts, plan, options, shared=True)
    scores = question_scores(parts, cache, plan, options)
    per_chunk = []
    for c, (a, b) in enumerate(plan.chunk_rows()):
        score = torch.full((b - a,), float("-inf")) if c == 0 else backfilled(scores[a:b].clone(), reach)
        if c:
            score[plan.separators(c)] = SEPARATOR
        per_chunk.append(score)
    return cache, to_budget(parts, options, per_chunk, options.ratio)


def layered_answer(engine: Engine, plan, options: RequestOptions, half: str) -> Prefill:
    """The default selection at `options.ratio`, its chunk rows written back only in `half` of the layers."""
    parts = engine.parts
    cache = blend.blended_cache(parts, plan, options, shared=True)
    chosen = question_attention(parts, cache, plan, options)
    layers = parts.primary.model.config.num_hidden_layers
    kept = range(layers // 2, layers) if half == "lower" else range(layers // 2)
    cache.stale_layers, cache.stale_before = frozenset(kept), plan.question_start  # rows there stay reused
    return recomputed(engine, plan, options, cache, list(chosen.rows))


def around(values: list[torch.Tensor], side: str) -> list[torch.Tensor]:
    """Per chunk, every row before the end (`preceding`) or after the start (`following`) of its value rows."""
    out = []
    for v in values:
        marks = torch.zeros_like(v)
        at = torch.nonzero(v).flatten()
        if at.numel():
            if side == "preceding":
                marks[: int(at.max()) + 1] = True
            else:
                marks[int(at.min()):] = True
        out.append(marks)
    return out


def parse_condition(condition: str) -> tuple[str, float | None, str]:
    """(kind, its number or None, "lower"/"upper"/"") of a condition name; a clear error for anything else."""
    name, _, half = condition.partition("@")
    kind, _, number = name.partition("_")
    try:
        value = float(number) if number else None
    except ValueError:
        value = float("nan")
    numbered = kind in ("ratio", "backfill", "twostage")
    if kind not in ("ratio", "backfill", "twostage", "preceding", "following") or numbered != (value is not None) \
            or value != value or half not in ("", "lower", "upper") or (half and kind != "ratio"):
        raise ValueError(f"unknown condition {condition!r}: ratio_R[@lower|@upper], backfill_L, twostage_P, preceding "
                         f"or following")
    return kind, value, half


def run_condition(engine: Engine, sample: ruler.Sample, chunks: list[str], condition: str, budget: int) -> dict:
    kind, value, half = parse_condition(condition)
    options = RequestOptions(method="cacheclip", ratio=value if kind == "ratio" else 0.2, max_new_tokens=budget,
                             answer_prefix=sample.answer_prefix, prompt_stops=False)
    plan = engine.plan(sample.question, chunks, options)
    if kind == "backfill":
        cache, rows = backfill_rows(engine, plan, options, int(value))
        prefill = recomputed(engine, plan, options, cache, rows)
        text = decode_until_complete(engine, plan, prefill, options, sample)
    elif kind == "twostage":
        options = replace(options, aux_share=value)
        prefill = engine.prefill(plan, options)
        text = decode_until_complete(engine, plan, prefill, options, sample)
    elif kind in ("preceding", "following"):
        values = value_rows(plan, sample)
        values[0] = torch.zeros_like(values[0])  # chunk 0 is exact behind the prefix
        text, prefill, _ = answer(engine, plan, options, around(values, kind), sample)
    elif half:
        prefill = layered_answer(engine, plan, options, half)
        text = decode_until_complete(engine, plan, prefill, options, sample)
    else:
        text, prefill, _ = answer(engine, plan, options, None, sample)
    return {"output": text, "solved": ruler.score(text, sample.references, sample.wrong) == 1.0,
            "partial": ruler.score(text, sample.references, sample.wrong),
            "recomputed": int(prefill.recomputed_positions.numel()), "chunk_tokens": plan.question_start - plan.prefix_len}


def chunk_signal(engine: Engine, sample: ruler.Sample, chunks: list[str]) -> dict:
    options = RequestOptions(method="cacheclip", ratio=0.2, answer_prefix=sample.answer_prefix, prompt_stops=False)
    plan = engine.plan(sample.question, chunks, options)
    cache = blend.blended_cache(engine.parts, plan, options, shared=True)
    scores = question_scores(engine.parts, cache, plan, options)
    peaked = [float(scores[a:b].max() / scores[a:b].median()) for a, b in plan.chunk_rows()]
    holding = sorted({i for n in sample.needles if n.value in sample.references
                      for i, c in enumerate(chunks) if n.sentence in c})
    top = sorted(range(len(peaked)), key=lambda c: -peaked[c])[: len(holding)]
    return {"peak_over_median": peaked, "value_chunks": holding,
            "found": len(set(top) & set(holding)) / len(holding), "chance": len(holding) / len(peaked)}


def cases_of(run: Path, length: int) -> list[tuple[str, int, dict]]:
    """(task, seed, the default's record) for every sample where full lists every value."""
    out = []
    for line in (run / "records.jsonl").read_text().splitlines():
        rows = json.loads(line)
        full = next(r for r in rows if r["variant"] == "full")
        default = next(r for r in rows if r["variant"] == DEFAULT and r["ratio"] == 0.2)
        if full["length"] == length and full["score"] == 1.0:
            out.append((full["task"], full["seed"], default))
    return out


def report(rows: list[dict], cases: list[tuple[str, int, dict]]) -> dict:
    default = {(t, s): d["score"] == 1.0 for t, s, d in cases}
    out = {"n": len(cases), "default": {"kept": sum(default.values())}, "conditions": {}}
    interval = wilson_interval(out["default"]["kept"], len(cases))
    out["default"] |= {"share": interval.mean, "low": interval.low, "high": interval.high}
    for condition in sorted({r["condition"] for r in rows}):
        mine = {(r["task"], r["seed"]): r for r in rows if r["condition"] == condition}
        keys = [k for k in default if k in mine]
        kept = sum(mine[k]["solved"] for k in keys)
        interval = wilson_interval(kept, len(keys))
        wins, losses, p = sign_test([float(mine[k]["solved"]) for k in keys], [float(default[k]) for k in keys])
        out["conditions"][condition] = {
            "n": len(keys), "kept": kept, "share": interval.mean, "low": interval.low, "high": interval.high,
            "recomputed_share": sum(mine[k]["recomputed"] / mine[k]["chunk_tokens"] for k in keys) / max(1, len(keys)),
            "vs_default": {"wins": wins, "losses": losses, "sign_p": p}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="an evaluation folder of --profile multichunk")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--conditions", default="ratio_0.3,ratio_0.5,backfill_32")
    ap.add_argument("--primary", default="qwen2.5-coder-0.5b")
    ap.add_argument("--aux", default=None, help="an aux model, for the twostage_P conditions (smollm2-135m)")
    ap.add_argument("--store", default="/tmp/cacheclip-diagnose-store")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multichunk_candidates.jsonl")
    ap.add_argument("--report", type=Path, default=None, help="summarise --out's rows into this JSON, run nothing")
    ap.add_argument("--chunk-signal", type=Path, default=None, help="write the per-chunk signal rows here, run nothing else")
    ap.add_argument("--only-lost", action="store_true", help="only the cases the default loses (a diagnosis)")
    ap.add_argument("--dtype", default="auto", help="the run's own dtype (float32 for a run made in float32)")
    args = ap.parse_args()
    cases = cases_of(args.run, args.length)
    rows = [json.loads(x) for x in args.out.read_text().splitlines()] if args.out.exists() else []
    if args.report is not None:
        summary = report([r for r in rows if r["length"] == args.length], cases)
        args.report.write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary, indent=1))
        return 0
    done = {(r["task"], r["seed"], r["condition"]) for r in rows if r["length"] == args.length}
    conditions = args.conditions.split(",")
    for condition in conditions:  # before the models load
        parse_condition(condition)
    engine = Engine.from_config(EngineConfig(primary=args.primary, aux=args.aux, store_path=args.store,
                                             dtype=args.dtype))
    count = token_counter(engine)
    if args.chunk_signal is not None:
        signal = []
        for task, seed, _ in tqdm(cases, desc="chunk signal", unit="case"):
            sample = ruler.generate(task, args.length, seed, count)
            view, chunks = ingested(engine, sample, count)
            signal.append({"task": task, "seed": seed} | chunk_signal(view, sample, chunks))
        args.chunk_signal.write_text("".join(json.dumps(r) + "\n" for r in signal))
        found, chance = (sum(r[k] for r in signal) / len(signal) for k in ("found", "chance"))
        print(json.dumps({"n": len(signal), "value_chunks_found": found, "chance": chance}))
        return 0
    if args.only_lost:
        cases = [c for c in cases if c[2]["score"] < 1.0]
    for task, seed, _ in tqdm(cases, desc="multichunk remedies", unit="case"):
        todo = [c for c in conditions if (task, seed, c) not in done]
        if not todo:
            continue
        sample = ruler.generate(task, args.length, seed, count)
        view, chunks = ingested(engine, sample, count)
        budget = max(48, decode_budget(view, sample))
        for condition in todo:
            started = time.perf_counter()
            row = {"task": task, "seed": seed, "length": args.length, "condition": condition}
            row |= run_condition(view, sample, chunks, condition, budget)
            row["seconds"] = time.perf_counter() - started
            append_row(args.out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
