"""Where a method's teacher-forced KL comes from, task by task (issue 51, item 3): its KL as a share of
shared-prefix reuse's (mean over mean, paired bootstrap 95%: `stats.ratio_of_means`, as the evaluation
report), per RULER task and pooled with and without the tasks named by --apart, from evaluation folders
(merged by sample as `cacheclip eval --merge` does, so a ratio sweep run apart pairs with its power run).

    python bench/kl_by_task.py bench/eval-qwen-2k bench/eval-qwen-2k-requery-budget bench/eval-qwen-4k \
        --ratios 0.2,0.3,0.5 --json bench/results/kl_by_task.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation import runner  # noqa: E402
from cacheclip_rag.evaluation.ruler import TASKS  # noqa: E402
from cacheclip_rag.evaluation.stats import ratio_of_means  # noqa: E402


def by_sample(folders: list[Path]) -> dict[int, dict[tuple, dict]]:
    """length -> (task, seed) -> {(variant, ratio): record}, the folders merged (`runner.merge_runs`: a row two
    folders hold must agree)."""
    records = runner.merge_runs([(str(f), [r for rows in runner.load_records(f).values() for r in rows])
                                 for f in folders])
    out: dict[int, dict[tuple, dict]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        out[r.length][(r.task, r.seed)][(r.variant, r.ratio)] = r
    return out


def rows(folders: list[Path], variant: str, ratios: list[float], apart: tuple[str, ...]) -> list[dict]:
    table = []
    for length, samples in sorted(by_sample(folders).items()):
        for ratio in ratios:
            def pairs(keep):
                return [(s[(variant, ratio)].tf_kl, s[("shared_prefix", None)].tf_kl)
                        for (task, _), s in samples.items()
                        if keep(task) and (variant, ratio) in s and ("shared_prefix", None) in s]

            groups = {task: (lambda t, task=task: t == task) for task in TASKS}
            groups["all"] = lambda t: True
            groups["without " + "/".join(apart)] = lambda t: t not in apart
            groups["/".join(apart)] = lambda t: t in apart
            for name, keep in groups.items():
                found = pairs(keep)
                if found:
                    table.append({"length": length, "variant": variant, "ratio": ratio, "tasks": name,
                                  "kl_share": ratio_of_means(found)})
    return table


def markdown(table: list[dict]) -> str:
    out = ["| length | ratio | tasks | n | KL ÷ shared-prefix reuse's [95% CI] |", "|---|---|---|---|---|"]
    for r in table:
        k = r["kl_share"]
        out.append(f"| {r['length']} | {r['ratio']} | {r['tasks']} | {k['n']} | {k['mean']:.2f} [{k['low']:.2f}, {k['high']:.2f}] |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", type=Path, nargs="+")
    ap.add_argument("--variant", default="cacheclip_requery")
    ap.add_argument("--ratios", default="0.2")
    ap.add_argument("--apart", default="multikey2,multikey3", help="tasks pooled apart from the rest")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    table = rows(args.folders, args.variant, [float(r) for r in args.ratios.split(",")], tuple(args.apart.split(",")))
    if args.json:
        args.json.write_text(json.dumps({"folders": [str(f) for f in args.folders], "rows": table}, indent=1) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
