"""Why RULER's multi-answer tasks lose a value in the deployed format and not in RULER's (issue 67, item 3).

`bench/compare_formats.py` found the default keeping 0.96 of full's strict answers at 2K in RULER's layout and
0.79 in the deployed one; in `multivalue` it lists every value in 2 of full's 9 (12 of 13 in RULER's), and
where it fails it drops the value that comes first in the context. Each sample runs, in the deployed format
(the engine's chat template, chunks ingested behind its generic system prompt), `full` and the default (the
question's selection with the spread budget at 0.5, pinned as `SPREAD` so that every file stands on one base),
then over a fresh blended cache that selection at the ratio it ran at plus extra rows:

- `heads_K`: each reused chunk's first K tokens (each chunk's cache was computed as the first thing after the
  system prompt: does its start still read as the start of the user's message?);
- `first_whole`: every row of the chunk holding the earliest answer value in the context;
- `values_whole`: every row of each chunk holding an answer value;
- `ratio_R`: the same selection at a larger ratio (how much budget the loss needs);
- `from_first_whole` / `after_first_whole`: every row of every chunk from / after the one holding the earliest
  value (is the loss in the stale chunks that follow it?);
- `deviation_R`: R of the chunk rows more, those whose layer-1 values move most when layers 0-1 are recomputed
  (CacheBlend's signal, a practical pick of the stale rows);
- `true_dev_R`: R of the chunk rows more, those whose values differ most from full prefill's over all layers
  (each layer's difference over its mean row norm): the oracle of which stale rows matter;
- `cacheblend_same`: CacheBlend alone at the default's ratio (the peer's pick at the same budget);
- `shallow_later_K` / `shallow_all_K`: before the default selects, every row of the chunks after the one holding
  the earliest value (of every chunk but the first) recomputed through the first K layers only, its upper
  layers left as loaded: is the stale part of those rows in the lower layers (a refresh at K/L of the cost)?

Every sample also records the question's attention mass on each chunk (`chunk_mass`, the default selection's
scores summed per chunk), so a budget read from the model can be tested against which chunks hold values.

Per sample: which answer values each condition lists and which chunk holds each value. Resumable JSON lines.

    python bench/diagnose_deployed.py --tasks multivalue --length 2048 --samples 13 --out bench/results/deployed_diagnosis.jsonl
    python bench/diagnose_deployed.py --tasks multivalue,multiquery --conditions from_first_whole,after_first_whole \
        --out bench/results/deployed_diagnosis_later.jsonl
    python bench/diagnose_deployed.py --report bench/results/deployed_diagnosis*.jsonl --json bench/results/deployed_diagnosis.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.stats import wilson_interval  # noqa: E402
from cacheclip_rag.methods.budget import budget  # noqa: E402
from cacheclip_rag.methods.prefills import PREFILLS  # noqa: E402
from cacheclip_rag.stages.load import blend  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402
from cacheclip_rag.stages.select.selection import to_budget, value_deviation  # noqa: E402
from common import chunk_shares, prefill_with_rows  # noqa: E402

CONDITIONS = ("default", "heads_8", "heads_32", "first_whole", "values_whole", "ratio_0.7", "ratio_0.9")
LATER = ("from_first_whole", "after_first_whole")  # --conditions: where the stale rows that lose the value are
STALE = ("deviation_0.2", "true_dev_0.2", "cacheblend_same")  # --conditions: can a pick of the stale rows do it?
SHALLOW = tuple(f"shallow_{rows}_{k}" for rows in ("later", "all") for k in (4, 8, 12, 16))  # --conditions: which layers?


def listed(text: str, references: tuple[str, ...]) -> list[str]:
    return [v for v in references if v in text]


def answer(engine: Engine, plan, options: RequestOptions, extra: list[torch.Tensor] | None, before=None) -> str:
    """The default's selection at `options.ratio` over a fresh blended cache (changed by `before` first), plus
    `extra` rows; greedy answer."""
    return "".join(engine.decode(plan, prefill_with_rows(engine, plan, options, extra, before), options))


def shallow_refresh(engine: Engine, plan, rows: list[torch.Tensor], layers: int):
    """A change to the loaded cache: the chunk `rows` (per chunk, bool) recomputed through the first `layers`
    layers only (their K/V there written, the layers above left as loaded)."""
    model = engine.primary.model

    def refresh(cache) -> None:
        positions = blend.positions_of(plan, rows)
        ids = torch.tensor(plan.all_ids())[positions]
        every = model.model.layers
        model.model.layers = torch.nn.ModuleList(list(every)[:layers])
        try:
            forward_at(model, cache, ids[None], positions[None], base_model_only=True, kernel=engine.parts.kernel)
        finally:
            model.model.layers = every
    return refresh


def value_places(chunks: list[str], references: tuple[str, ...]) -> dict[str, list[int]]:
    """Where each value first is: [chunk, character in it] (chunks overlap, so a value can be in two)."""
    return {v: next([i, c.index(v)] for i, c in enumerate(chunks) if v in c) for v in references}


def per_chunk(plan, scores: torch.Tensor) -> list[torch.Tensor]:
    return [scores[a:b] for a, b in plan.chunk_rows()]


def deviation_rows(engine: Engine, plan, options: RequestOptions, ratio: float) -> list[torch.Tensor]:
    """CacheBlend's pick at `ratio`: the rows whose layer-1 values move most (over a cache of their own)."""
    cache = blend.blended_cache(engine.parts, plan, options, shared=True)
    return list(value_deviation(engine.parts, cache, plan, replace(options, ratio=ratio)).rows)


def true_deviation_rows(engine: Engine, plan, options: RequestOptions, ratio: float) -> list[torch.Tensor]:
    """The rows whose values differ most from full prefill's, summed over layers (each layer's row
    difference over its mean row norm), top `ratio` of the chunk rows, chunk 0 (exact) never."""
    full = PREFILLS["full"](engine.parts, plan, options).cache
    reused = blend.blended_cache(engine.parts, plan, options, shared=True)
    a, b = plan.prefix_len, plan.question_start
    score = torch.zeros(b - a)
    for exact, stale in zip(full.layers, reused.layers):
        truth = exact.values[0, :, a:b].float()
        score += (truth - stale.values[0, :, a:b].float()).norm(dim=-1).sum(0) / truth.norm(dim=-1).sum(0).mean()
    scores = per_chunk(plan, score)
    scores[0] = torch.full_like(scores[0], float("-inf"))
    return to_budget(engine.parts, options, scores, ratio, grouped=False)


SPREAD = 0.5  # the default's spread budget, pinned: every file of this diagnosis stands on the same base


def evaluate(engine: Engine, sample: ruler.Sample, count, conditions: tuple[str, ...] = CONDITIONS[1:]) -> dict:
    chunks = ruler.sample_chunks(sample, count)
    engine.ingest(chunks, progress=False)
    options = RequestOptions(max_new_tokens=max(64, 12 * len(sample.references)), spread_ratio=SPREAD)
    full = engine.generate(sample.question, chunks, replace(options, method="full")).text
    default = engine.generate(sample.question, chunks, options)
    plan = engine.plan(sample.question, chunks, options)
    ran = replace(budget(plan, options), spread_ratio=None, min_recompute_tokens=0)  # the ratio the default ran at
    places = value_places(chunks, sample.references)
    where = {v: place[0] for v, place in places.items()}
    first = min(where.values())
    whole = lambda keep: [torch.full((len(ids),), keep(i), dtype=torch.bool) for i, ids in enumerate(plan.chunk_ids)]  # noqa: E731

    def heads(k: int) -> list[torch.Tensor]:
        return [torch.arange(len(ids)) < (k if i > 0 else 0) for i, ids in enumerate(plan.chunk_ids)]

    runs = {"heads_8": (ran, heads(8)), "heads_32": (ran, heads(32)), "first_whole": (ran, whole(lambda i: i == first)),
            "values_whole": (ran, whole(lambda i: i in set(where.values()))),
            "ratio_0.7": (replace(ran, ratio=0.7), None), "ratio_0.9": (replace(ran, ratio=0.9), None),
            "from_first_whole": (ran, whole(lambda i: i >= first)), "after_first_whole": (ran, whole(lambda i: i > first)),
            "deviation_0.2": (ran, lambda: deviation_rows(engine, plan, ran, 0.2)),
            "true_dev_0.2": (ran, lambda: true_deviation_rows(engine, plan, ran, 0.2))}
    later, every = whole(lambda i: i > first), whole(lambda i: i > 0)
    shallow = {f"shallow_{name}_{k}": shallow_refresh(engine, plan, rows, k)
               for name, rows in (("later", later), ("all", every)) for k in (4, 8, 12, 16)}
    outputs = {"full": full, "default": default.text}
    for name in conditions:
        if name == "cacheblend_same":
            outputs[name] = engine.generate(sample.question, chunks, replace(ran, method="cacheblend")).text
        elif name in shallow:
            outputs[name] = answer(engine, plan, ran, None, shallow[name])
        else:
            at, extra = runs[name]
            outputs[name] = answer(engine, plan, at, extra() if callable(extra) else extra)
    return {"task": sample.task, "length": sample.target_tokens, "seed": sample.seed, "references": sample.references,
            "value_places": places, "chunks": len(chunks), "ratio": ran.ratio, "chunk_mass": [round(s, 5) for s in chunk_shares(engine, plan, ran)],
            "outputs": outputs, "listed": {k: listed(v, sample.references) for k, v in outputs.items()}}


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    done = {(r["task"], r["length"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    with tempfile.TemporaryDirectory() as store:
        engine = Engine.from_config(EngineConfig(aux=None, store_path=store))
        count = functools.lru_cache(maxsize=None)(lambda text: len(engine.primary.encode(text)))
        todo = [(t, s) for t in args.tasks.split(",") for s in range(args.samples) if (t, args.length, s) not in done]
        for task, seed in tqdm(todo, desc="deployed diagnosis"):
            conditions = tuple(c for c in args.conditions.split(",") if c)
            row = evaluate(engine, ruler.generate(task, args.length, seed, count), count, conditions)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def merged(paths: list[Path]) -> list[dict]:
    """The rows of runs over the same samples, each sample's conditions together (full's answer must agree)."""
    by: dict[tuple, dict] = {}
    for path in paths:
        for r in map(json.loads, path.read_text().splitlines()):
            key = (r["task"], r["length"], r["seed"])
            if key in by:
                if by[key]["ratio"] != r["ratio"]:
                    raise SystemExit(f"{path}: {key} ran at ratio {r['ratio']}, an earlier file at {by[key]['ratio']}")
                if by[key]["outputs"]["full"] != r["outputs"]["full"]:
                    raise SystemExit(f"{path}: full answers {key} otherwise than an earlier file")
                by[key]["outputs"] |= r["outputs"]
                by[key]["listed"] |= r["listed"]
            else:
                by[key] = r
    return list(by.values())


def report(paths: list[Path]) -> list[dict]:
    """Per task: of the samples where full lists every value, how many each condition lists completely
    (Wilson 95%), and where the default drops a value, whether it is the earliest one in the context."""
    rows = merged(paths)
    table = []
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        solved = [r for r in mine if len(r["listed"]["full"]) == len(r["references"])]
        entry = {"task": task, "samples": len(mine), "full_complete": len(solved), "conditions": {}}
        for name in (*CONDITIONS, *LATER, *STALE, *SHALLOW):
            have = [r for r in solved if name in r["listed"]]
            if not have:
                continue
            kept = sum(len(r["listed"][name]) == len(r["references"]) for r in have)
            e = wilson_interval(kept, len(have))
            entry["conditions"][name] = {"kept": kept, "of": len(have), "share": [round(e.mean, 3), round(e.low, 3), round(e.high, 3)]}
        lost = [r for r in solved if len(r["listed"]["default"]) < len(r["references"])]
        entry["default_lost"] = len(lost)
        entry["lost_the_earliest_value"] = sum(
            min(r["value_places"], key=lambda v: r["value_places"][v]) not in r["listed"]["default"] for r in lost)
        table.append(entry)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="multivalue")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=13)
    parser.add_argument("--conditions", default=",".join(CONDITIONS[1:]), help=f"of {', '.join(CONDITIONS[1:] + LATER + STALE + SHALLOW)} (none: '')")
    parser.add_argument("--out", default="bench/results/deployed_diagnosis.jsonl")
    parser.add_argument("--report", nargs="+", type=Path, help="rows of runs over the same samples")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.report:
        table = report(args.report)
        for entry in table:
            cells = "  ".join(f"{k} {v['kept']}/{v['of']}" for k, v in entry["conditions"].items())
            print(f"{entry['task']:11} full complete {entry['full_complete']:3}/{entry['samples']:3}  {cells}  "
                  f"default lost {entry['default_lost']} (the earliest value in {entry['lost_the_earliest_value']})")
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
