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

from cacheclip_rag.evaluation.runner import load_records, merge_runs  # noqa: E402
from cacheclip_rag.evaluation.stats import paired_bootstrap_ci, ratio_of_means, sign_test  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--variant", default="cacheclip_requery")
    p.add_argument("--reference", type=float, default=0.2, help="the ratio the others are compared with")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = [(f, [r for records in load_records(Path(f)).values() for r in records]) for f in args.folders]
    rows = merge_runs(runs)
    by = {}
    for r in rows:
        variant = r.variant if r.variant != args.variant else (args.variant, round(r.ratio, 6))
        by.setdefault(variant, {})[(r.task, r.length, r.seed)] = r
    ratios = sorted(k[1] for k in by if isinstance(k, tuple))
    if args.reference not in ratios:
        raise SystemExit(f"no {args.variant} rows at the reference ratio {args.reference}; have {ratios}")
    keys = set(by["full"]) & set(by["shared_prefix"])
    for ratio in ratios:
        keys &= set(by[(args.variant, ratio)])
    keys = sorted(keys)
    if not keys:
        raise SystemExit("no sample has every ratio, full and shared_prefix")
    full, reuse = by["full"], by["shared_prefix"]
    reference = by[(args.variant, args.reference)]
    out = []
    print(f"{args.variant}, n = {len(keys)} samples every ratio finished; paired bootstrap 95% intervals")
    print(f"| ratio | retention of full's score | KL ÷ reuse's | median TTFT (full {statistics.median(full[k].ttft_s for k in keys):.1f} s) "
          f"| score − {args.reference}'s (up / down) | KL − {args.reference}'s |")
    print("|---|---|---|---|---|---|")
    for ratio in ratios:
        rows_at = by[(args.variant, ratio)]
        retention = ratio_of_means([(rows_at[k].score, full[k].score) for k in keys])
        kl_share = ratio_of_means([(rows_at[k].tf_kl, reuse[k].tf_kl) for k in keys])
        score_diff = paired_bootstrap_ci([rows_at[k].score for k in keys], [reference[k].score for k in keys])
        kl_diff = paired_bootstrap_ci([rows_at[k].tf_kl for k in keys], [reference[k].tf_kl for k in keys])
        up, down, _ = sign_test([rows_at[k].score for k in keys], [reference[k].score for k in keys])
        ttft = statistics.median(rows_at[k].ttft_s for k in keys)
        out.append({"ratio": ratio, "n": len(keys), "retention": retention, "tf_kl_share": kl_share, "ttft_s": ttft,
                    "score_minus_reference": vars(score_diff), "tf_kl_minus_reference": vars(kl_diff),
                    "up": up, "down": down})
        same = ratio == args.reference
        print(f"| {ratio} | {retention['mean']:.2f} [{retention['low']:.2f}, {retention['high']:.2f}] | "
              f"{kl_share['mean']:.2f} [{kl_share['low']:.2f}, {kl_share['high']:.2f}] | {ttft:.1f} s | "
              + ("–" if same else f"{score_diff.mean:+.3f} [{score_diff.low:+.3f}, {score_diff.high:+.3f}] ({up} / {down})")
              + " | " + ("–" if same else f"{kl_diff.mean:+.3f} [{kl_diff.low:+.3f}, {kl_diff.high:+.3f}]") + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": args.variant, "reference": args.reference,
                                               "folders": args.folders, "rows": out}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
