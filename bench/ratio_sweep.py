"""One variant at several ratios, paired on the samples every ratio finished: score retention of `full`'s and
teacher-forced KL ÷ shared-prefix reuse's (paired bootstrap 95% intervals), median TTFT, and each ratio's
paired difference from a reference ratio (score and KL, with the samples up / down). The folders' records
are merged (`merge_runs`: the `full` rows they share must agree, or it refuses).

    python bench/ratio_sweep.py bench/eval-qwen-4k-ratios bench/eval-qwen-4k --variant cacheclip_requery \
        --reference 0.2 [--json bench/results/ratio_sweep_4k.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.runner import Record, load_records, merge_runs  # noqa: E402
from cacheclip_rag.evaluation.stats import paired_bootstrap_ci, ratio_of_means, sign_test  # noqa: E402


def sweep(rows: list[Record], variant: str, reference: float) -> list[dict]:
    """A row a ratio of `variant` over the samples every ratio, `full` and `shared_prefix` finished."""
    by: dict = {}
    for r in rows:
        by.setdefault(r.variant if r.variant != variant else (variant, round(r.ratio, 6)), {})[(r.task, r.length, r.seed)] = r
    ratios = sorted(k[1] for k in by if isinstance(k, tuple))
    if reference not in ratios:
        raise ValueError(f"no {variant} rows at the reference ratio {reference}; have {ratios}")
    keys = set(by.get("full", {})) & set(by.get("shared_prefix", {}))
    for ratio in ratios:
        keys &= set(by[(variant, ratio)])
    keys = sorted(keys)
    if not keys:
        raise ValueError("no sample has every ratio, full and shared_prefix")
    full, reuse, base = by["full"], by["shared_prefix"], by[(variant, reference)]
    out = []
    for ratio in ratios:
        at = by[(variant, ratio)]
        scores, base_scores = [at[k].score for k in keys], [base[k].score for k in keys]
        up, down, _ = sign_test(scores, base_scores)
        out.append({
            "ratio": ratio, "n": len(keys),
            "retention": ratio_of_means([(at[k].score, full[k].score) for k in keys]),
            "tf_kl_share": ratio_of_means([(at[k].tf_kl, reuse[k].tf_kl) for k in keys]),
            "ttft_s": statistics.median(at[k].ttft_s for k in keys),
            "full_ttft_s": statistics.median(full[k].ttft_s for k in keys),
            "score_minus_reference": vars(paired_bootstrap_ci(scores, base_scores)),
            "tf_kl_minus_reference": vars(paired_bootstrap_ci([at[k].tf_kl for k in keys], [base[k].tf_kl for k in keys])),
            "up": up, "down": down,
        })
    return out


def interval(e: dict, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.2f}"
    return f"{f.format(e['mean'])} [{f.format(e['low'])}, {f.format(e['high'])}]"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--variant", default="cacheclip_requery")
    p.add_argument("--reference", type=float, default=0.2, help="the ratio the others are compared with")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = [(f, [r for records in load_records(Path(f)).values() for r in records]) for f in args.folders]
    try:
        out = sweep(merge_runs(runs), args.variant, args.reference)
    except ValueError as e:
        raise SystemExit(str(e))
    print(f"{args.variant}, n = {out[0]['n']} samples every ratio finished; paired bootstrap 95% intervals")
    print(f"| ratio | retention of full's score | KL ÷ reuse's | median TTFT (full {out[0]['full_ttft_s']:.1f} s) "
          f"| score − {args.reference}'s (up / down) | KL − {args.reference}'s |")
    print("|---|---|---|---|---|---|")
    for row in out:
        same = row["ratio"] == args.reference
        diffs = "– | –" if same else (f"{interval(row['score_minus_reference'], True)} ({row['up']} / {row['down']}) | "
                                      f"{interval(row['tf_kl_minus_reference'], True)}")
        print(f"| {row['ratio']} | {interval(row['retention'])} | {interval(row['tf_kl_share'])} | {row['ttft_s']:.1f} s | {diffs} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": args.variant, "reference": args.reference,
                                               "folders": args.folders, "rows": out}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
