"""RULER's samples asked in two layouts (issue 67, item 1): one run folder in RULER's format (its task preamble
as the shared prefix, raw prompt) and one in the deployed format (the engine's chat template, chunks ingested
behind its generic system prompt), over the same (task, seed) samples. Per variant and format: the samples
answered in full ("solved", strict: every part), how many of `full`'s solved ones it keeps (Wilson 95%), its
retention (solved ÷ `full`'s solved in the same format, paired bootstrap 95%), teacher-forced KL ÷ shared-prefix reuse's, the achieved recompute share and median TTFT; then
per variant what moved: the deployed minus RULER retention of `full`'s solved samples, paired by sample.
Retention and the KL share are ratios within one run, so they compare across runs made in other dtypes or on
other machines; raw scores and TTFTs do not (each row states its run's dtype and when it was made).

The RULER runs hold the shipped default (`cacheclip_spread`) only on the samples its spread budget flags:
`--ruler-spread DIR [--from-ratio R]` composes its rows as `compose_default.py` does (measured rows only).

    python bench/compare_formats.py bench/eval-qwen-2k bench/eval-deployed-2k --ruler-spread bench/eval-qwen-2k-requery-budget \
        --from-ratio 0.5 --json bench/results/quality_formats_2k.json --plot bench/results/quality_formats_2k.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.evaluation.records import Record  # noqa: E402
from cacheclip_rag.evaluation.runner import load_records  # noqa: E402
from cacheclip_rag.evaluation.stats import ratio_of_means, wilson_interval  # noqa: E402

Key = tuple[str, int, int]


def records_of(folder: Path) -> list[Record]:
    return [r for rows in load_records(folder).values() for r in rows]


def with_default(records: list[Record], spread: Path, from_ratio: float | None, tokenizer: str) -> list[Record]:
    """`records` with the shipped default's rows composed from them and the `spread` run (compose_default.py)."""
    from compose_default import compose, spread_flags

    composed, _ = compose(records, records_of(spread), spread_flags(tokenizer), from_ratio)
    return composed


def by_variant(records: list[Record], variants: set[str], ratio: float) -> tuple[str, dict[str, dict[Key, Record]]]:
    """(the records' format, per variant its rows by (task, length, seed)), at `ratio` for methods that take one."""
    rows: dict[str, dict[Key, Record]] = {}
    formats = set()
    for r in records:
        if r.variant in variants and (r.ratio is None or abs(r.ratio - ratio) < 1e-9):
            rows.setdefault(r.variant, {})[(r.task, r.length, r.seed)] = r
            formats.add(r.format)
    if len(formats) != 1:
        raise SystemExit(f"expected one format in a folder, found {sorted(formats) or 'no rows'}")
    return formats.pop(), rows


def _estimate(e) -> dict:
    return {"mean": e.mean, "low": e.low, "high": e.high, "n": e.n}


def solved(r: Record) -> float:
    """Strict: every part of the answer (RULER's score 1.0), as a user reads it."""
    return float(r.score >= 1.0 - 1e-9)


def retention_change(a: dict[Key, Record], a_full: dict[Key, Record], b: dict[Key, Record], b_full: dict[Key, Record],
                     keys: list[Key], resamples: int = 10_000, seed: int = 0) -> dict:
    """(solved b ÷ b's full) − (solved a ÷ a's full) over the same samples, resampled jointly: 95% interval."""
    x = np.array([[solved(a[k]), solved(a_full[k]), solved(b[k]), solved(b_full[k])] for k in keys])
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(resamples, len(keys)))
    m = x[idx].mean(axis=1)  # [resamples, 4]
    ok = (m[:, 1] > 0) & (m[:, 3] > 0)
    diffs = m[ok, 2] / m[ok, 3] - m[ok, 0] / m[ok, 1]
    point = x[:, 2].mean() / x[:, 3].mean() - x[:, 0].mean() / x[:, 1].mean()
    return {"mean": float(point), "low": float(np.quantile(diffs, 0.025)), "high": float(np.quantile(diffs, 0.975)),
            "n": len(keys)}


def compare(ruler_records: list[Record], deployed_records: list[Record], variants: list[str], ratio: float) -> dict:
    wanted = set(variants) | {"full", "shared_prefix"}
    (fa, ra), (fb, rb) = by_variant(ruler_records, wanted, ratio), by_variant(deployed_records, wanted, ratio)
    for name, rows in (("first", ra), ("second", rb)):
        missing = wanted - set(rows)
        if missing:
            raise SystemExit(f"the {name} folder has no rows of {sorted(missing)}")
    keys = sorted(set.intersection(*(set(r[v]) for r in (ra, rb) for v in wanted)))
    if not keys:
        raise SystemExit("the two folders share no finished sample")
    table = []
    for variant in variants:
        row = {"variant": variant, "ratio": None if variant in ("full", "shared_prefix") else ratio, "n": len(keys)}
        for fmt, rows in ((fa, ra), (fb, rb)):
            mine, full, reuse = rows[variant], rows["full"], rows["shared_prefix"]
            right = [k for k in keys if solved(full[k])]
            kept = int(sum(solved(mine[k]) for k in right))
            cell = {"solved": sum(solved(mine[k]) for k in keys), "full_solved": len(right), "kept_of_full": kept,
                    "kept_of_full_share": _estimate(wilson_interval(kept, len(right))) if right else None,
                    "retention": ratio_of_means([(solved(mine[k]), solved(full[k])) for k in keys]),
                    "recomputed_share": statistics.mean(mine[k].recomputed_share for k in keys),
                    "median_ttft_s": statistics.median(mine[k].ttft_s for k in keys)}
            cell["kept_by_task"] = {task: [int(sum(solved(mine[k]) for k in right if k[0] == task)),
                                           sum(k[0] == task for k in right)] for task in sorted({k[0] for k in keys})}
            if variant not in ("full", "shared_prefix"):
                cell["tf_kl_share_of_reuse"] = ratio_of_means([(mine[k].tf_kl, reuse[k].tf_kl) for k in keys])
            row[fmt] = cell
        row["retention_deployed_minus_ruler"] = retention_change(ra[variant], ra["full"], rb[variant], rb["full"], keys)
        table.append(row)
    return {"formats": [fa, fb], "ratio": ratio, "rows": table}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["variant"] != "full"]
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(rows), 3.4))
    for f_i, fmt in enumerate(result["formats"]):
        for v_i, row in enumerate(rows):
            ret = row[fmt]["retention"]
            x = v_i + (f_i - 0.5) * 0.38
            ax.bar(x, ret["mean"], 0.38, color=f"C{f_i}", label=fmt if v_i == 0 else None)
            ax.errorbar(x, ret["mean"], yerr=[[ret["mean"] - ret["low"]], [ret["high"] - ret["mean"]]], color="black",
                        capsize=2, linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["variant"] for r in rows], fontsize=8)
    ax.set_ylabel("strict answers kept, ÷ full's")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"RULER's samples in two layouts, n = {result['rows'][0]['n']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ruler", type=Path, help="a run folder in RULER's format")
    parser.add_argument("deployed", type=Path, help="a run folder over the same samples in the deployed format")
    parser.add_argument("--variants", default="full,shared_prefix,cacheclip_requery,cacheclip_spread")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--ruler-spread", type=Path, help="the spread run that completes the RULER folder's default")
    parser.add_argument("--from-ratio", type=float, help="read it from that run's question selection at this ratio")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="the primary whose tokens sized the chunks")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    ruler_records = records_of(args.ruler)
    if args.ruler_spread:
        ruler_records = with_default(ruler_records, args.ruler_spread, args.from_ratio, args.tokenizer)
    result = compare(ruler_records, records_of(args.deployed), args.variants.split(","), args.ratio)
    result["folders"] = [str(args.ruler), str(args.deployed)] + ([str(args.ruler_spread)] if args.ruler_spread else [])
    for row in result["rows"]:
        cells = "  ".join(f"{fmt}: solved {row[fmt]['solved']:.0f}, keeps {row[fmt]['kept_of_full']}/{row[fmt]['full_solved']}, "
                          f"retention {row[fmt]['retention']['mean']:.2f} "
                          f"[{row[fmt]['retention']['low']:.2f}, {row[fmt]['retention']['high']:.2f}], KL/reuse "
                          f"{row[fmt].get('tf_kl_share_of_reuse', {}).get('mean', float('nan')):.2f}, "
                          f"ttft {row[fmt]['median_ttft_s']:.2f}s" for fmt in result["formats"])
        d = row["retention_deployed_minus_ruler"]
        print(f"{row['variant']:18} n={row['n']}  {cells}  moved {d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
