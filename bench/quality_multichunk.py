"""The multi-chunk answers table (issue 54): for each method, prompt length and ratio, how many of `full`'s
complete answers it keeps, from the records of `cacheclip eval --profile multichunk` runs.

Per row (method, length, ratio), over the samples where `full` lists every value (`n`):
- `strict_retention`: the share the method also answers completely (every value present), Wilson 95%;
- `partial_retention`: its mean partial credit (the share of values found) on those samples, bootstrap 95%;
- `tf_kl`: teacher-forced KL to `full` over full's answer, all samples, bootstrap 95%;
- `ttft_speedup`: mean TTFT of `full` over the method's (indicative: CPU, runs may share the machine);
- `paired_vs_default`: strict wins/losses against the shipped default on the same samples, sign test (the
  default's own row: against the default before the spread budget, `paired_vs_before`);
- `default`: whether the row is the shipped default (`profiles.is_default`: `cacheclip_spread` at 0.2).

    python bench/quality_multichunk.py bench/eval-multichunk bench/eval-multichunk-4k \
        --json bench/results/quality_multichunk.json --plot bench/results/quality_multichunk.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.profiles import is_default  # noqa: E402
from cacheclip_rag.evaluation.stats import bootstrap_ci, sign_test, wilson_interval  # noqa: E402

DEFAULT = "cacheclip_spread"  # the variant that runs the shipped default (question selection + the spread budget)
BEFORE = "cacheclip_requery"  # the default before the spread budget (issue 54): question selection at the ratio alone
LABELS = {"cacheclip_spread": "cacheclip (default: question selection + spread budget)",
          "cacheclip_requery": "cacheclip, question selection alone (the default before)",
          "cacheclip_nospread": "cacheclip without the spread budget (spread_ratio=None)",
          "cacheclip": "cacheclip (paper: aux selection)"}


def _estimate(e) -> dict:
    return {"mean": e.mean, "low": e.low, "high": e.high}


def load(runs: list[Path]) -> list[list[dict]]:
    """Every sample's records (one list per sample and run), from each run's records.jsonl."""
    samples = []
    for run in runs:
        for line in (run / "records.jsonl").read_text().splitlines():
            samples.append(json.loads(line))
    return samples


def table(samples: list[list[dict]]) -> list[dict]:
    by_key: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    for records in samples:
        full = next((r for r in records if r["variant"] == "full"), None)
        if full is None:
            raise ValueError(f"a sample without full's record: {records[0]['task']} seed {records[0]['seed']}")
        for r in records:
            if r["variant"] != "full":
                by_key[(r["variant"], r["length"], r["ratio"])].append((full, r))
    rows = []
    for (variant, length, ratio), pairs in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2] or 0)):
        solved = [(f, r) for f, r in pairs if f["score"] == 1.0]
        kept = sum(r["score"] == 1.0 for _, r in solved)
        row = {"method": variant, "label": LABELS.get(variant, variant), "length": length, "ratio": ratio,
               "samples": len(pairs), "n": len(solved),
               "strict_retention": _estimate(wilson_interval(kept, len(solved))) | {"kept": kept},
               "partial_retention": _estimate(bootstrap_ci([r["score"] for _, r in solved])),
               "tf_kl": _estimate(bootstrap_ci([r["tf_kl"] for _, r in pairs])),
               "ttft_speedup": sum(f["ttft_s"] for f, _ in pairs) / sum(r["ttft_s"] for _, r in pairs)}
        row["default"] = is_default(variant, ratio)
        against = BEFORE if variant == DEFAULT else DEFAULT
        other = {(r["task"], r["seed"]): r for f, r in by_key.get((against, length, ratio), [])}
        if other:
            shared = [(r, other[(r["task"], r["seed"])]) for _, r in solved if (r["task"], r["seed"]) in other]
            wins, losses, p = sign_test([float(r["score"] == 1.0) for r, _ in shared],
                                        [float(d["score"] == 1.0) for _, d in shared])
            key = "paired_vs_before" if variant == DEFAULT else "paired_vs_default"
            row[key] = {"n": len(shared), "wins": wins, "losses": losses, "sign_p": p}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    header = ("| length | method | ratio | full's complete lists (n) | kept strictly, Wilson 95% | partial credit on "
              "them, bootstrap 95% | teacher-forced KL | TTFT speed-up |")
    out = [header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p, k = r["strict_retention"], r["partial_retention"], r["tf_kl"]
        out.append(f"| {r['length']} | {r['label']} | {r['ratio'] if r['ratio'] is not None else '—'} | {r['n']} | "
                   f"{s['kept']} = {s['mean']:.2f} [{s['low']:.2f}, {s['high']:.2f}] | {p['mean']:.2f} [{p['low']:.2f}, "
                   f"{p['high']:.2f}] | {k['mean']:.3f} [{k['low']:.3f}, {k['high']:.3f}] | {r['ttft_speedup']:.1f}× |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(7 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        mine = [r for r in rows if r["length"] == length]
        names = [f"{r['label']}" + (f" @ {r['ratio']}" if r["ratio"] is not None else "") for r in mine]
        means = [r["strict_retention"]["mean"] for r in mine]
        err = [[m - r["strict_retention"]["low"] for m, r in zip(means, mine)],
               [r["strict_retention"]["high"] - m for m, r in zip(means, mine)]]
        ax.barh(range(len(mine)), means, xerr=err, color="tab:blue", alpha=0.8, capsize=3)
        ax.axvline(0.8, color="tab:red", linestyle="--", label="goal 0.8")
        ax.set_yticks(range(len(mine)), names, fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of full's complete lists kept (Wilson 95%)")
        ax.set_title(f"{length} tokens, n = {mine[0]['n'] if mine else 0}")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="evaluation folders of --profile multichunk")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "quality_multichunk.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "quality_multichunk.png")
    args = ap.parse_args()
    rows = table(load(args.runs))
    args.json.write_text(json.dumps({"runs": [str(r) for r in args.runs], "rows": rows}, indent=1) + "\n")
    plot(rows, args.plot)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
