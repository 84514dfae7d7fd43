"""Retention and teacher-forced KL against prompt length, per method, from the harness's quality files
(issue 51): `bench/results/quality_qwen_{1k,2k,4k,8k}.json` (whichever exist), at one ratio. Prints the
table (markdown) and writes `bench/results/quality_by_length.png`: retention of full's score (95% interval)
and KL as a share of shared-prefix reuse's (95% interval), with the issue's goals drawn in.

    python bench/quality_by_length.py [--ratio 0.2] [--files quality_qwen_1k.json,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cacheclip_rag.evaluation.profiles import is_default  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {"shared_prefix": "shared-prefix reuse", "cacheblend": "CacheBlend", "cacheclip": "CacheClip, aux selection",
          "cacheclip_requery": "CacheClip, question selection alone (the default before issue 54)",
          "cacheclip_spread": "CacheClip default (question selection + spread budget)"}
COLORS = {"shared_prefix": "tab:blue", "cacheblend": "tab:orange", "cacheclip": "tab:green",
          "cacheclip_requery": "tab:purple", "cacheclip_spread": "tab:red"}
RETENTION_GOAL, RETENTION_FLOOR, KL_GOAL = 0.95, 0.88, 0.25  # issue 51's goals at 4K and 8K


def rows_at(quality: dict, ratio: float) -> dict[str, dict]:
    """The methods' rows at `ratio` (shared-prefix reuse takes none), by method."""
    return {m["method"]: m for m in quality["methods"]
            if m["method"] in LABELS and (m["ratio"] is None or abs(m["ratio"] - ratio) < 1e-9)}


def table(files: list[Path], ratio: float) -> tuple[str, dict[str, list[tuple[int, dict]]]]:
    series: dict[str, list[tuple[int, dict]]] = {m: [] for m in LABELS}
    lines = ["| length | method | n | retention [95% CI] | KL ÷ shared-prefix reuse's [95% CI] | default |",
             "|---|---|---|---|---|---|"]
    for path in files:
        quality = json.loads(path.read_text())
        for method, row in rows_at(quality, ratio).items():
            series[method].append((quality["length"], row))
            ret, kl = row.get("retention"), row.get("kl_share_of_shared_prefix")
            cells = [f"{e['mean']:.2f} [{e['low']:.2f}, {e['high']:.2f}]" if e else "–" for e in (ret, kl)]
            lines.append(f"| {quality['length']} | {LABELS[method]} | {row['n']} | {cells[0]} | {cells[1]} | "
                         f"{'yes' if row.get('default', is_default(method, row['ratio'])) else ''} |")
    return "\n".join(lines), series


def plot(series: dict[str, list[tuple[int, dict]]], ratio: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, points in series.items():
        for axis, metric in ((left, "retention"), (right, "kl_share_of_shared_prefix")):
            got = sorted((length, row[metric]) for length, row in points if metric in row)
            if not got:
                continue
            x = [length for length, _ in got]
            y = [e["mean"] for _, e in got]
            err = [[e["mean"] - e["low"] for _, e in got], [e["high"] - e["mean"] for _, e in got]]
            axis.errorbar(x, y, yerr=err, marker="o", capsize=3, label=LABELS[method], color=COLORS[method])
    left.axhline(RETENTION_GOAL, color="grey", ls="--", lw=0.8)
    left.axhline(RETENTION_FLOOR, color="grey", ls=":", lw=0.8)
    right.axhline(KL_GOAL, color="grey", ls="--", lw=0.8)
    left.set(title=f"score retention (÷ full attention's), ratio {ratio:g}", ylabel="retention", xlabel="prompt tokens")
    right.set(title="teacher-forced KL ÷ shared-prefix reuse's", ylabel="KL share", xlabel="prompt tokens")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--files", default="quality_qwen_1k.json,quality_qwen_2k.json,quality_qwen_4k.json,"
                                      "quality_qwen_8k.json")
    p.add_argument("--png", default=str(RESULTS / "quality_by_length.png"))
    args = p.parse_args()
    files = [RESULTS / f for f in args.files.split(",") if (RESULTS / f).exists()]
    if not files:
        raise SystemExit(f"none of {args.files} is in {RESULTS}")
    text, series = table(files, args.ratio)
    print(text)
    plot(series, args.ratio, Path(args.png))
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
