"""Plot a `bench/bench_serve.py` result: TTFT p50 per stream quarter for each method and concurrency (does the
gap hold over the stream as chunk orders change?), and the share of each prompt read from the store, request
by request (the reuse hit rate over time).

    python bench/plot_serve.py [bench/results/serve.json] [--out bench/results/serve.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default="bench/results/serve.json")
    p.add_argument("--out", default=None, help="default: the result's name with .png")
    args = p.parse_args()
    data = json.loads(Path(args.result).read_text())
    rows, timeline = data["rows"], data["timeline"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    levels = sorted({row["clients"] for row in rows})
    for row in rows:
        color = f"C{levels.index(row['clients'])}"  # one colour per concurrency, solid cacheclip, dashed full
        quarters = row["ttft_p50_by_quarter_s"]
        style = "-" if row["method"] == "cacheclip" else "--"
        left.plot(range(1, len(quarters) + 1), quarters, style, marker="o", color=color,
                  label=f"{row['method']}, {row['clients']} client{'s' if row['clients'] > 1 else ''}")
    left.set(xlabel="quarter of the request stream", ylabel="TTFT p50 (s)", yscale="log",
             title="TTFT over the stream (new chunk order per request)")
    left.set_xticks(range(1, 5))
    left.legend(fontsize=7)
    for clients in sorted({t["clients"] for t in timeline if t["method"] == "cacheclip"}):
        points = [t["reused"] for t in timeline if t["method"] == "cacheclip" and t["clients"] == clients]
        right.plot(range(len(points)), points, marker=".", label=f"{clients} clients")
    right.set(xlabel="request", ylabel="share of prompt tokens read from the store", ylim=(0, 1),
              title="cacheclip: reuse per request")
    right.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.result).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
