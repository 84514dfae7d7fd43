"""Paired comparison of one variant across two evaluation folders (e.g. the same primary with two auxes):
the samples both folders finished, matched by (task, length, seed); for score, teacher-forced KL and
first-token KL the mean difference B - A with a paired bootstrap 95% interval and a sign test. Each
folder's `full` rows must agree (same primary, same samples), or the comparison is refused.

    python bench/compare_runs.py bench/eval-qwen-same:cacheclip bench/eval-qwen-same-smol:cacheclip [--ratio 0.2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.runner import RECORDS_FILE, Record, load_records, merge_runs  # noqa: E402
from cacheclip_rag.evaluation.stats import bootstrap_ci, paired_bootstrap_ci, sign_test  # noqa: E402

METRICS = ("score", "tf_kl", "kl")


def rows_of(spec: str, ratio: float | None) -> tuple[Path, dict[tuple, Record], dict[tuple, Record]]:
    """(folder, the variant's rows, the `full` rows), both by (task, length, seed)."""
    folder, _, variant = spec.rpartition(":")
    if not folder:
        raise SystemExit(f"{spec!r}: expected FOLDER:VARIANT")
    path = Path(folder)
    if not (path / RECORDS_FILE).exists():
        raise SystemExit(f"{path}: no {RECORDS_FILE}")
    picked, full = {}, {}
    for key, records in load_records(path).items():
        for r in records:
            if r.variant == variant and (ratio is None or r.ratio is None or abs(r.ratio - ratio) < 1e-9):
                picked[key] = r
            elif r.variant == "full":
                full[key] = r
    if not picked:
        raise SystemExit(f"{path}: no rows of variant {variant!r} at ratio {ratio}")
    return path, picked, full


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a", help="FOLDER:VARIANT (the baseline)")
    p.add_argument("b", help="FOLDER:VARIANT (compared against a)")
    p.add_argument("--ratio", type=float, default=0.2)
    args = p.parse_args()
    path_a, a, full_a = rows_of(args.a, args.ratio)
    path_b, b, full_b = rows_of(args.b, args.ratio)
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit("the two folders share no finished sample")
    # refuses when the two `full` references disagree (another primary or other samples)
    merge_runs([(str(path_a), [full_a[k] for k in common if k in full_a]),
                (str(path_b), [full_b[k] for k in common if k in full_b])])
    print(f"n = {len(common)} paired samples; B - A with paired bootstrap 95% intervals")
    print(f"| metric | A {args.a} | B {args.b} | B - A | B higher / lower (sign test p) |")
    print("|---|---|---|---|---|")
    for m in METRICS:
        xa, xb = [getattr(a[k], m) for k in common], [getattr(b[k], m) for k in common]
        up, down, pval = sign_test(xb, xa)
        print(f"| {m} | {bootstrap_ci(xa)} | {bootstrap_ci(xb)} | {paired_bootstrap_ci(xb, xa)} | "
              f"{up} / {down} (p = {pval:.3g}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
