"""Plot a `bench/bench_scaleout.py` result: per workload and router, where each request's chunks came from
(replica memory, its local disk, the bucket), and p50/p95 TTFT; the cold tier's TTFT beside recomputing.

    python bench/plot_scaleout.py [bench/results/scaleout.json] [--out bench/results/scaleout.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = (("memory_hit_rate", "replica memory"), ("local_disk_rate", "replica's LMDB"), ("bucket_rate", "bucket (S3)"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default="bench/results/scaleout.json")
    p.add_argument("--out", default=None, help="default: the result's name with .png")
    args = p.parse_args()
    data = json.loads(Path(args.result).read_text())
    runs = sorted(name for name in data if name.startswith("routers_"))
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(7 * len(runs) + 5, 5), width_ratios=[1.6] * len(runs) + [1])
    for ax, name in zip(axes, runs):
        rows = [r for r in data[name]["rows"] if r["part"] == "routers"]
        labels = [f"{r['workload']}\n{r['router']}" for r in rows]
        bottom = [0.0] * len(rows)
        for i, (field, label) in enumerate(SOURCES):
            values = [r[field] for r in rows]
            ax.bar(range(len(rows)), values, bottom=bottom, color=f"C{i}", label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        twin = ax.twinx()
        twin.plot(range(len(rows)), [r["p50_ttft_s"] * 1e3 for r in rows], "ko", label="p50 TTFT")
        twin.plot(range(len(rows)), [r["p95_ttft_s"] * 1e3 for r in rows], "k^", label="p95 TTFT")
        twin.set(ylabel="TTFT (ms)", ylim=(0, 1.35 * max(r["p95_ttft_s"] for r in rows) * 1e3))
        share = rows[0]["fast_share"]
        ax.set(ylabel="share of recognised chunks", ylim=(0, 1.35),
               title=f"4 replicas of the {'default' if rows[0].get('model') == 'default' else 'tiny'} model, "
                     f"{rows[0]['requests']} requests a run\nmemory tier {share:.3g} of the corpus")
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
        ax.legend(fontsize=7, loc="upper left")
        twin.legend(fontsize=7, loc="upper right")
    ax = axes[-1]
    rows = [r for r in data.get("cold_ttft", {}).get("rows", []) if "length" in r]
    lengths = sorted({r["length"] for r in rows})
    conditions = ["full", "miss", "cold", "hot"]
    for i, condition in enumerate(conditions):
        values = [next((r["median_ttft_s"] for r in rows if r["length"] == n and r["condition"] == condition), 0)
                  for n in lengths]
        ax.bar([j + i * 0.2 for j in range(len(lengths))], values, width=0.2, color=f"C{i}", label=condition)
    ax.set_xticks([j + 0.3 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set(ylabel="median TTFT (s)", title="chunks from the bucket (cold) vs recomputed (full)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.result).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
