"""Behaviour unchanged across a refactor: two evaluation folders over the same samples (one run at the commit
before, one after) must give identical greedy answers and teacher-forced KL within a tolerance, case by case.

    # before: in a worktree of the old commit; after: in this checkout; the same arguments, their own store
    cacheclip eval --profile quick --primary qwen2.5-coder-0.5b --aux smollm2-135m --lengths 1024 \
        --tasks single1,single2,multikey1,multivalue,multiquery --samples 4 --ratios 0.2 \
        --variants full,shared_prefix,ape,cacheblend,cacheclip,cacheclip_requery,oracle --alignment-samples 0 \
        --store /tmp/identity/store-after --out /tmp/identity/after
    python bench/check_identity.py /tmp/identity/before /tmp/identity/after --out bench/results/refactor_identity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEY = ("task", "length", "seed", "variant", "ratio")


def records(folder: Path) -> dict[tuple, dict]:
    rows = {}
    for line in (folder / "records.jsonl").read_text().splitlines():
        for record in json.loads(line):
            rows[tuple(record[k] for k in KEY)] = record
    return rows


def compare(before: dict[tuple, dict], after: dict[tuple, dict], tolerance: float) -> dict:
    common = sorted(set(before) & set(after), key=str)
    differing = []
    for key in common:
        a, b = before[key], after[key]
        kl_gap = abs(a["tf_kl"] - b["tf_kl"])
        if a["output"] != b["output"] or kl_gap > tolerance:
            differing.append({"case": dict(zip(KEY, key)), "before": a["output"], "after": b["output"], "tf_kl_gap": kl_gap})
    cases = {k[:3] for k in common}
    return {"cases": len(cases), "rows": len(common), "variants": sorted({k[3] for k in common}),
            "identical_answers": sum(before[k]["output"] == after[k]["output"] for k in common),
            "max_tf_kl_gap": max((abs(before[k]["tf_kl"] - after[k]["tf_kl"]) for k in common), default=0.0),
            "tolerance": tolerance, "only_before": len(set(before) - set(after)), "only_after": len(set(after) - set(before)),
            "differing": differing}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--tolerance", type=float, default=1e-6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = compare(records(args.before), records(args.after), args.tolerance)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if not result["differing"] and result["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
