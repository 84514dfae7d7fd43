"""Does the question's attention find the chunks that hold the facts, once the position bias is taken out?
(issue 67's model-read budget signals)

`bench_deployed.py` records, per request, the question's share of its attention over each reused chunk (the
default's own scoring pass). Raw, those shares say where a chunk sits, not what it holds: the last chunk takes
0.17-0.35 of the mass whatever it says. Here each share is divided by the mean share at the same position
(same chunk count, same index) over the requests of the *other* families, so no request and no family is its
own baseline. Read from `--rows` (no model runs):

- **locating**: AUC between the chunks that hold a fact the question asks about and the chunks that do not
  (pooled over every request of a family and length), with a 95% bootstrap interval;
- **top-k recall**: of each request's fact chunks, how many are among its k chunks of the largest ratio
  (k = its number of fact chunks);
- **routing**: how well a request-level summary (the second-largest ratio; the count of chunks over 2x)
  separates each multi-chunk family from the topical single-fact one at the same length, and the requests
  the default loses (full right, default wrong) from those it keeps.

    python bench/chunk_locator.py --rows bench/results/deployed.jsonl --json bench/results/chunk_locator.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_deployed import auc, auc_interval  # noqa: E402

MULTI = ("values", "compare", "link")


def load(path: Path, primary: str) -> list[dict]:
    """The requests of `primary` that recorded chunk shares (the short family has no filler chunks: left out)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r.get("primary", "qwen2.5-coder-0.5b") == primary and r["case"]["family"] != "short"
            and "shares" in r["signals"]]


def ratios(rows: list[dict]) -> list[list[float]]:
    """Each request's shares over the mean share at the same (chunk count, index) in the other families."""
    every: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (count, index): [mass, requests]
    own: dict[tuple[str, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # the same, per family
    for r in rows:
        shares = r["signals"]["shares"]
        for i, share in enumerate(shares):
            for entry in (every[(len(shares), i)], own[(r["case"]["family"], len(shares), i)]):
                entry[0] += share
                entry[1] += 1
    out = []
    for r in rows:
        shares = r["signals"]["shares"]
        row = []
        for i, share in enumerate(shares):
            (mass, count), (mine, mine_count) = every[(len(shares), i)], own[(r["case"]["family"], len(shares), i)]
            mass, count = mass - mine, count - mine_count
            row.append(share / (mass / count) if count and mass > 0 else float("nan"))
        out.append(row)
    return out


def second(values: list[float]) -> float:
    return sorted(values)[-2] if len(values) > 1 else 0.0


def report(rows: list[dict]) -> dict:
    z = ratios(rows)
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for j, r in enumerate(rows):
        groups[(r["case"]["family"], r["length"])].append(j)
    locating = []
    for (family, length), members in sorted(groups.items()):
        facts, others, found, wanted = [], [], 0, 0
        for j in members:
            held = set(rows[j]["case"]["fact_chunks"])
            usable = [i for i, v in enumerate(z[j]) if v == v]
            facts += [z[j][i] for i in usable if i in held]
            others += [z[j][i] for i in usable if i not in held]
            top = sorted(usable, key=lambda i: -z[j][i])[: len(held)]
            found, wanted = found + len(held & set(top)), wanted + len(held)
        locating.append({"family": family, "length": length, "requests": len(members), "fact_chunks": len(facts),
                         "other_chunks": len(others), "auc": round(auc(facts, others), 3),
                         "auc_95": auc_interval(facts, others, resamples=500), "top_k_recall": [found, wanted]})
    summaries = {"second-largest ratio": second, "chunks over 2x": lambda v: float(sum(x > 2 for x in v))}
    routing = []
    for length in sorted({r["length"] for r in rows}):
        topical = groups.get(("topical", length), [])
        for name, summary in summaries.items():
            for family in MULTI:
                members = groups.get((family, length), [])
                if not members or not topical:
                    continue
                pos, neg = [summary(z[j]) for j in members], [summary(z[j]) for j in topical]
                routing.append({"length": length, "summary": name, "positive": family, "negative": "topical",
                                "n": [len(pos), len(neg)], "auc": round(auc(pos, neg), 3),
                                "auc_95": auc_interval(pos, neg, resamples=500)})
            solved = [j for j in range(len(rows)) if rows[j]["length"] == length and rows[j]["rows"]["full"]["right"]]
            lost = [summary(z[j]) for j in solved if not rows[j]["rows"]["default"]["right"]]
            kept = [summary(z[j]) for j in solved if rows[j]["rows"]["default"]["right"]]
            if lost and kept:
                routing.append({"length": length, "summary": name, "positive": "default loses full's answer",
                                "negative": "default keeps it", "n": [len(lost), len(kept)],
                                "auc": round(auc(lost, kept), 3), "auc_95": auc_interval(lost, kept, resamples=500)})
    return {"locating": locating, "routing": routing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="bench/results/deployed.jsonl")
    parser.add_argument("--primary", default="qwen2.5-coder-0.5b")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {"primary": args.primary, **report(load(Path(args.rows), args.primary))}
    for row in result["locating"]:
        print(f"locating {row['family']:8s} {row['length']}: AUC {row['auc']} {row['auc_95']}, "
              f"top-k {row['top_k_recall'][0]}/{row['top_k_recall'][1]}")
    for row in result["routing"]:
        print(f"routing {row['length']} {row['summary']:22s} {row['positive']} vs {row['negative']}: "
              f"AUC {row['auc']} {row['auc_95']} n={row['n']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
