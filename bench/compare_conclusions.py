"""Do two evaluation runs of the same samples reach the same paired conclusions? E.g. the 2K quality bench
in float32 and in bfloat16: for each run, `method` minus every other variant (score and teacher-forced KL,
paired bootstrap 95% intervals and sign tests), on the samples both runs finished, side by side, and whether
each conclusion (interval above zero, below zero, or spanning it) is the same. Prints one table; `--json`
writes the rows.

    python bench/compare_conclusions.py bench/eval-qwen-2k bench/eval-qwen-2k-bf16 [--method cacheclip_requery]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.runner import load_records  # noqa: E402
from cacheclip_rag.evaluation.summaries import paired_differences  # noqa: E402

METRICS = ("score", "tf_kl")


def verdict(row: dict) -> str:
    return "higher" if row["low"] > 0 else "lower" if row["high"] < 0 else "no difference shown"


def conclusions(folder: Path, samples: set, method: str) -> dict[tuple, dict]:
    records = [r for key, rows in load_records(folder).items() if key in samples for r in rows]
    return {(r["other"], r["ratio"], r["metric"]): r for r in paired_differences(records, method)
            if r["metric"] in METRICS}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--method", default="cacheclip_requery")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    a, b = Path(args.a), Path(args.b)
    samples = set(load_records(a)) & set(load_records(b))
    if not samples:
        raise SystemExit(f"{a} and {b} share no finished sample")
    left, right = conclusions(a, samples, args.method), conclusions(b, samples, args.method)
    rows = []
    print(f"\n{args.method} minus each other variant, n = {len(samples)} samples both runs finished")
    print(f"| against | metric | {a.name} | {b.name} | same conclusion |")
    print("|---|---|---|---|---|")
    for key in sorted(set(left) & set(right), key=str):
        x, y = left[key], right[key]
        same = verdict(x) == verdict(y)
        rows.append({"other": key[0], "ratio": key[1], "metric": key[2], "a": x, "b": y, "same": same})
        cell = lambda r: f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] ({r['wins']}/{r['losses']})"  # noqa: E731
        print(f"| {key[0]} | {key[2]} | {cell(x)} | {cell(y)} | {'yes' if same else '**no**'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"n": len(samples), "method": args.method, "a": str(a), "b": str(b),
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
