"""Why RULER's multi-answer tasks lose a value in the deployed format and not in RULER's (issue 67, item 3).

`bench/compare_formats.py` found the default keeping 0.96 of full's strict answers at 2K in RULER's layout and
0.79 in the deployed one; in `multivalue` it lists every value in 2 of full's 9 (12 of 13 in RULER's), and
where it fails it drops the value that comes first in the context. Each sample runs, in the deployed format
(the engine's chat template, chunks ingested behind its generic system prompt), `full` and the default, then
over a fresh blended cache the default's own selection at the ratio it ran at (the spread budget's, where it
fires) plus extra rows:

- `heads_K`: each reused chunk's first K tokens (each chunk's cache was computed as the first thing after the
  system prompt: does its start still read as the start of the user's message?);
- `first_whole`: every row of the chunk holding the earliest answer value in the context;
- `values_whole`: every row of each chunk holding an answer value;
- `ratio_R`: the same selection at a larger ratio (how much budget the loss needs);
- `from_first_whole` / `after_first_whole`: every row of every chunk from / after the one holding the earliest
  value (is the loss in the stale chunks that follow it?).

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
from common import prefill_with_rows  # noqa: E402

CONDITIONS = ("default", "heads_8", "heads_32", "first_whole", "values_whole", "ratio_0.7", "ratio_0.9")
LATER = ("from_first_whole", "after_first_whole")  # --conditions: where the stale rows that lose the value are


def listed(text: str, references: tuple[str, ...]) -> list[str]:
    return [v for v in references if v in text]


def answer(engine: Engine, plan, options: RequestOptions, extra: list[torch.Tensor] | None) -> str:
    """The default's selection at `options.ratio` over a fresh blended cache, plus `extra` rows; greedy answer."""
    return "".join(engine.decode(plan, prefill_with_rows(engine, plan, options, extra), options))


def value_places(chunks: list[str], references: tuple[str, ...]) -> dict[str, list[int]]:
    """Where each value first is: [chunk, character in it] (chunks overlap, so a value can be in two)."""
    return {v: next([i, c.index(v)] for i, c in enumerate(chunks) if v in c) for v in references}


def evaluate(engine: Engine, sample: ruler.Sample, count, conditions: tuple[str, ...] = CONDITIONS[1:]) -> dict:
    chunks = ruler.sample_chunks(sample, count)
    engine.ingest(chunks, progress=False)
    options = RequestOptions(max_new_tokens=max(64, 12 * len(sample.references)))
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
            "from_first_whole": (ran, whole(lambda i: i >= first)), "after_first_whole": (ran, whole(lambda i: i > first))}
    outputs = {"full": full, "default": default.text} | {name: answer(engine, plan, *runs[name]) for name in conditions}
    return {"task": sample.task, "length": sample.target_tokens, "seed": sample.seed, "references": sample.references,
            "value_places": places, "chunks": len(chunks), "ratio": ran.ratio,
            "outputs": outputs, "listed": {k: listed(v, sample.references) for k, v in outputs.items()}}


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    done = {(r["task"], r["length"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    with tempfile.TemporaryDirectory() as store:
        engine = Engine.from_config(EngineConfig(aux=None, store_path=store))
        count = functools.lru_cache(maxsize=None)(lambda text: len(engine.primary.encode(text)))
        todo = [(t, s) for t in args.tasks.split(",") for s in range(args.samples) if (t, args.length, s) not in done]
        for task, seed in tqdm(todo, desc="deployed diagnosis"):
            row = evaluate(engine, ruler.generate(task, args.length, seed, count), count, tuple(args.conditions.split(",")))
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def merged(paths: list[Path]) -> list[dict]:
    """The rows of runs over the same samples, each sample's conditions together (full's answer must agree)."""
    by: dict[tuple, dict] = {}
    for path in paths:
        for r in map(json.loads, path.read_text().splitlines()):
            key = (r["task"], r["length"], r["seed"])
            if key in by:
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
        for name in (*CONDITIONS, *LATER):
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
    parser.add_argument("--conditions", default=",".join(CONDITIONS[1:]), help=f"of {', '.join(CONDITIONS[1:] + LATER)}")
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
