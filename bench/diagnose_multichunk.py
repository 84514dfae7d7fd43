"""Why a multi-chunk answer loses values under reuse (issue 54): each cause tested on the cases where full
attention lists every value, at one ratio, on the samples of an evaluation folder (`--profile multichunk`).

Per case, over the same blended cache the method loads (question rows computed over it as the method does):
- `default`: cacheclip's default selection (the question's attention), as shipped; `coverage` is the share of
  the value sentences' tokens (chunks after the first) it recomputes: is it selection?
- `values_added`: the default's rows plus every token of every value sentence: if this brings the values back,
  the value sentences' own stale rows were the loss (their cached K/V never saw the rest of the prompt).
- `value_chunks`: the default's rows plus every row of every chunk that holds a value: the context around them.
- `first_decision`: full's answer forced through the default's prefill: the first token where the default's
  greedy choice differs from full's, and the text before it (does it stop after the first value?).
Position is not a cause on its own: re-rotated keys equal keys computed at the target position to float
error (tests/test_invariants.py), so a chunk's position changes nothing but its context.

    python bench/diagnose_multichunk.py bench/eval-multichunk --length 2048 --ratio 0.2 \
        --out bench/results/multichunk_diagnosis.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.stages.load import blend  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.runner import decode_budget, ruler_engine, token_counter  # noqa: E402
from cacheclip_rag.stages.request import Prefill, Timings  # noqa: E402
from cacheclip_rag.stages.select.selection import question_attention  # noqa: E402

CONDITIONS = ("default", "values_added", "value_chunks")


def value_rows(plan, sample: ruler.Sample) -> list[torch.Tensor]:
    """Per chunk (bool per token): the tokens inside a sentence that gives one of the asked values."""
    sentences = [n.sentence for n in sample.needles if n.value in sample.references]
    rows = []
    for text, spans in zip(plan.texts, plan.char_spans):
        marks = torch.zeros(len(spans), dtype=torch.bool)
        for sentence in sentences:
            at = text.find(sentence)
            while at >= 0:
                stop = at + len(sentence)
                marks |= torch.tensor([a < stop and b > at for a, b in spans], dtype=torch.bool)
                at = text.find(sentence, at + 1)
        rows.append(marks)
    return rows


def answer(engine: Engine, plan, options: RequestOptions, extra: list[torch.Tensor] | None, sample: ruler.Sample):
    """The default selection over a fresh blended cache, plus `extra` rows; the greedy answer and the prefill."""
    parts = engine.parts
    cache = blend.blended_cache(parts, plan, options, shared=True)
    chosen = question_attention(parts, cache, plan, options)
    rows = list(chosen.rows) if extra is None else [a | b for a, b in zip(chosen.rows, extra)]
    prefill = recomputed(engine, plan, options, cache, rows)
    return decode_until_complete(engine, plan, prefill, options, sample), prefill, chosen


def recomputed(engine: Engine, plan, options: RequestOptions, cache, rows: list[torch.Tensor]) -> Prefill:
    """`rows` (per chunk, bool) recomputed over `cache` with the question: the prefill to decode from."""
    positions = blend.positions_of(plan, rows)
    logits = blend.recompute_and_answer(engine.parts, cache, plan, positions, options=options)
    return Prefill(cache, logits, positions, Timings())


def decode_until_complete(engine: Engine, plan, prefill, options: RequestOptions, sample: ruler.Sample) -> str:
    """The greedy answer from `prefill`, stopped once it holds every reference (or at the token budget)."""
    text = ""
    for piece in engine.decode(plan, prefill, options):
        text += piece
        if ruler.score(text, sample.references, sample.wrong) == 1.0:
            break
    return text


def ingested(engine: Engine, sample: ruler.Sample, count) -> tuple[Engine, list[str]]:
    """The engine as the sample's prompt layout asks, with the sample's chunks ingested; and the chunks."""
    chunks = ruler.sample_chunks(sample, count)
    view = ruler_engine(engine, sample)
    view.ingest(chunks, progress=False)
    return view, chunks


def append_row(path: Path, row: dict) -> None:
    """One result row appended to a JSONL file (the runs resume from what is there)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def diagnose(engine: Engine, sample: ruler.Sample, ratio: float, count) -> dict:
    view, chunks = ingested(engine, sample, count)
    budget = max(48, decode_budget(view, sample))
    options = RequestOptions(method="cacheclip", ratio=ratio, max_new_tokens=budget, answer_prefix=sample.answer_prefix,
                             prompt_stops=False)
    full_options = RequestOptions(method="full", max_new_tokens=budget, answer_prefix=sample.answer_prefix,
                                  prompt_stops=False)
    plan = view.plan(sample.question, chunks, options)
    full_prefill = view.prefill(plan, full_options)
    stream = view.decode(plan, full_prefill, full_options)
    full_text = "".join(stream)
    full_tokens = list(stream.token_ids) or [min(view.primary.eos_token_ids)]
    values = value_rows(plan, sample)
    skip = values[1:]  # chunk 0 behind the shared prefix is exact already
    row = {"task": sample.task, "seed": sample.seed, "length": sample.target_tokens, "ratio": ratio,
           "references": list(sample.references), "full": full_text,
           "full_solved": ruler.score(full_text, sample.references, sample.wrong) == 1.0,
           "value_tokens": int(sum(int(v.sum()) for v in skip)), "chunk_tokens": plan.question_start - plan.prefix_len}
    holding = [torch.full_like(v, bool(v.any())) for v in values]
    for name, extra in (("default", None), ("values_added", values), ("value_chunks", holding)):
        text, prefill, chosen = answer(view, plan, options, extra, sample)
        row[name] = {"output": text, "solved": ruler.score(text, sample.references, sample.wrong) == 1.0,
                     "partial": ruler.score(text, sample.references, sample.wrong),
                     "recomputed": int(prefill.recomputed_positions.numel())}
        if name == "default":
            covered = sum(int((c & v).sum()) for c, v in zip(chosen.rows[1:], skip))
            row[name]["coverage"] = covered / max(1, row["value_tokens"])
            # the value-sentence tokens it left stale, as text (a run of them per gap)
            row[name]["missed"] = [view.primary.tokenizer.decode([plan.chunk_ids[c][t]])
                                   for c in range(1, len(plan.chunk_ids))
                                   for t in torch.nonzero(values[c] & ~chosen.rows[c]).flatten().tolist()]
            forced = view.teacher_forced_logits(plan, prefill, full_tokens).argmax(-1).tolist()
            split = next((i for i, (a, b) in enumerate(zip(forced, full_tokens)) if a != b), None)
            row["first_decision"] = None if split is None else {
                "index": split, "before": view.primary.tokenizer.decode(full_tokens[:split]),
                "full_next": view.primary.tokenizer.decode([full_tokens[split]]),
                "default_next": view.primary.tokenizer.decode([forced[split]])}
    return row


def report(rows: list[dict], count) -> dict:
    """The diagnosis in numbers: per condition, full's complete lists kept (with a Wilson interval); the
    default's coverage of the value sentences; and, where the default drops a value, which one (the
    earliest in the context? in chunk 0, which is exact behind the prefix?)."""
    from cacheclip_rag.evaluation.stats import wilson_interval

    cases = [r for r in rows if r["full_solved"]]
    out = {"n": len(cases), "conditions": {}, "dropped": []}
    for name in CONDITIONS:
        kept = sum(r[name]["solved"] for r in cases)
        interval = wilson_interval(kept, len(cases))
        out["conditions"][name] = {"kept": kept, "share": interval.mean, "low": interval.low, "high": interval.high,
                                   "recomputed_mean": sum(r[name]["recomputed"] for r in cases) / max(1, len(cases))}
    coverage = [r["default"]["coverage"] for r in cases]
    out["coverage"] = {"mean": sum(coverage) / max(1, len(coverage)), "min": min(coverage, default=0.0)}
    for r in cases:
        if r["default"]["solved"]:
            continue
        sample = ruler.generate(r["task"], r["length"], r["seed"], count)
        chunks = ruler.sample_chunks(sample, count)
        order = sorted(sample.references, key=sample.context.index)
        missing = [v for v in order if v not in r["default"]["output"]]
        out["dropped"].append({"task": r["task"], "seed": r["seed"],
                               "chunks_of_values": [[i for i, c in enumerate(chunks) if v in c] for v in order],
                               "missing": missing, "missing_is_first": bool(missing) and missing[0] == order[0],
                               "fixed_by": [n for n in CONDITIONS[1:] if r[n]["solved"]]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="an evaluation folder of --profile multichunk (its records pick the cases)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--primary", default="qwen2.5-coder-0.5b")
    ap.add_argument("--store", default="/tmp/cacheclip-diagnose-store")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multichunk_diagnosis.jsonl")
    ap.add_argument("--report", type=Path, default=None, help="summarise --out's rows into this JSON, run nothing")
    args = ap.parse_args()
    if args.report is not None:
        engine = Engine.from_config(EngineConfig(primary=args.primary, aux=None, store_path=args.store))
        rows = [json.loads(line) for line in args.out.read_text().splitlines()]
        summary = report([r for r in rows if r["length"] == args.length and r["ratio"] == args.ratio],
                         token_counter(engine))
        args.report.write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary, indent=1))
        return 0
    cases = []
    for line in (args.run / "records.jsonl").read_text().splitlines():
        rows = json.loads(line)
        full = next(r for r in rows if r["variant"] == "full")
        if full["length"] == args.length and full["score"] == 1.0:
            cases.append((full["task"], full["seed"]))
    done = set()
    if args.out.exists():
        done = {(r["task"], r["seed"]) for r in map(json.loads, args.out.read_text().splitlines()) if r["ratio"] == args.ratio
                and r["length"] == args.length}
    engine = Engine.from_config(EngineConfig(primary=args.primary, aux=None, store_path=args.store))
    count = token_counter(engine)
    for task, seed in tqdm([c for c in cases if c not in done], desc="multichunk diagnosis", unit="case"):
        started = time.perf_counter()
        row = diagnose(engine, ruler.generate(task, args.length, seed, count), args.ratio, count)
        row["seconds"] = time.perf_counter() - started
        append_row(args.out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
