"""The shipped default's rows over a whole RULER run, from measured records (issue 54 changed the default).

The default (`cacheclip_spread`) is the question selection (`cacheclip_requery`) plus the spread budget, which
raises the ratio only for a question whose subject is in two chunks or more (`spread.answer_spread`). On any
other sample its request is the question selection's, token for token (tests/test_spread.py), so a run of the
default needs only the flagged samples: this script regenerates every sample of the base run, checks which
the spread budget flags, takes the flagged ones from a run of `cacheclip_spread` (refusing if one is missing)
and the rest from the base run's `cacheclip_requery` rows, and writes the run's quality JSON with these rows
as `cacheclip_spread`, marked default, through the harness's own report. Nothing is estimated: every row
is a measured record.

    python bench/compose_default.py bench/eval-qwen-4k --spread bench/eval-qwen-4k-spread --json bench/results/quality_qwen_4k.json

`--from-ratio R` reads the flagged samples from a run of the question selection at ratio R instead (the
default's request on a flagged sample is the question selection at spread_ratio, token for token): the 2K
sweep `bench/eval-qwen-2k-requery-budget` holds it at 0.5.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import RequestOptions  # noqa: E402
from cacheclip_rag.evaluation import report, ruler, runner  # noqa: E402
from cacheclip_rag.methods.spread import answer_spread  # noqa: E402

BASE, DEFAULT = "cacheclip_requery", "cacheclip_spread"
RATIO = RequestOptions().ratio  # the ratio a request without options asks for


def compose(base: list, spread: list, flagged, from_ratio: float | None = None) -> tuple[list, dict]:
    """base's records plus the default's: `spread`'s on the samples `flagged(task, length, seed)` names (its
    question-selection rows at `from_ratio`, when given), base's question-selection rows renamed on the others;
    with counts of each."""
    if from_ratio is None:
        measured = {(r.task, r.length, r.seed, r.ratio): r for r in spread if r.variant == DEFAULT}
    else:
        measured = {(r.task, r.length, r.seed, RATIO): replace(r, variant=DEFAULT, ratio=RATIO) for r in spread
                    if r.variant == BASE and r.ratio == from_ratio}
    out, counts = list(runner.merge_runs([("base", base), ("spread", [r for r in spread if r.variant == "full"])])), {}
    for r in [r for r in base if r.variant == BASE and r.ratio == RATIO]:
        key = (r.task, r.length, r.seed, r.ratio)
        if flagged(r.task, r.length, r.seed):
            if key not in measured:
                raise ValueError(f"{r.task} seed {r.seed} at {r.length} is flagged, and the spread run has no record of it")
            out.append(measured[key])
            counts["spread run"] = counts.get("spread run", 0) + 1
        else:
            out.append(replace(r, variant=DEFAULT))
            counts["base run"] = counts.get("base run", 0) + 1
    return out, counts


def spread_flags(tokenizer: str) -> Callable[[str, int, int], bool]:
    """Whether the spread budget flags RULER's sample (task, length, seed), its chunks sized by `tokenizer`'s
    tokens (the primary's): the samples on which the default's request differs from the question selection's."""
    from cacheclip_rag.models.loading import load_model

    lm = load_model(tokenizer)
    count = functools.lru_cache(maxsize=None)(lambda text: len(lm.encode(text)))

    @functools.lru_cache(maxsize=None)
    def flagged(task: str, length: int, seed: int) -> bool:
        sample = ruler.generate(task, length, seed, count)
        return answer_spread(sample.question, ruler.sample_chunks(sample, count)).spread

    return flagged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, nargs="+", help="runs of one length with cacheclip_requery rows (merged)")
    ap.add_argument("--spread", type=Path, required=True, help="a run of cacheclip_spread on the flagged samples")
    ap.add_argument("--from-ratio", type=float, default=None)
    ap.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="the primary whose tokens sized the chunks")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    flagged = spread_flags(args.tokenizer)
    base = runner.merge_runs([(str(b), [r for rows in runner.load_records(b).values() for r in rows]) for b in args.base])
    spread = [r for rows in runner.load_records(args.spread).values() for r in rows]
    records, counts = compose(base, spread, flagged, args.from_ratio)
    lengths = sorted({r.length for r in records})
    if len(lengths) != 1:
        raise ValueError(f"one length a file, got {lengths}")
    body = report.quality(records, lengths[0])
    body["composed"] = {"base": [str(b) for b in args.base], "spread": str(args.spread), "from_ratio": args.from_ratio,
                        "default_rows_from": counts}
    args.json.write_text(json.dumps(body, indent=1) + "\n")
    for m in body["methods"]:
        if m["method"] in (BASE, DEFAULT):
            print(m["method"], m["ratio"], m["n"], "retention", m["retention"], "tf_kl", m["tf_kl"]["mean"],
                  "default" if m["default"] else "")
    print(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
