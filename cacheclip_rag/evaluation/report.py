"""The evaluation's outputs: results.json, report.md (scores, retention, fidelity, efficiency,
alignment) and PNG plots (score vs ratio as the paper's Figure 6, per-task bars as Figure 5,
character attention maps as Figure 3)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from .runner import AlignmentRow, Record, records_as_dicts, summary


def _label(row: dict) -> str:
    return row["variant"] if row["ratio"] is None else f"{row['variant']} @ {row['ratio']:g}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _sorted_rows(rows: list[dict]) -> list[dict]:
    order = ["full", "direct", "shared_prefix", "cacheblend", "cacheclip", "oracle", "cacheclip_nogroup", "cacheclip_noprefix"]
    return sorted(rows, key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99, r["ratio"] or 0.0))


def markdown(records: Sequence[Record], alignment: Sequence[AlignmentRow], headline_ratio: float) -> str:
    s = summary(records)
    rows = _sorted_rows(s["rows"])
    tasks = sorted({r.task for r in records}, key=lambda t: ("single" not in t, t))
    out = ["### RULER scores (fraction of reference values found; retention = score / full)", ""]
    out.append("| variant | " + " | ".join(tasks) + " | mean | retention | KL(full‖m) | greedy agree | recomputed |")
    out.append("|---" * (len(tasks) + 6) + "|")
    for r in rows:
        cells = [_num(r["per_task"].get(t), ".2f") for t in tasks]
        out.append(
            f"| {_label(r)} | " + " | ".join(cells)
            + f" | {r['score']:.3f} | {_num(r['retention'], '.2f')} | {r['kl']:.3f} | {r['agreement']:.2f} | {r['recompute_fraction']:.2f} |"
        )
    out += ["", f"### Efficiency breakdown at ratio {headline_ratio:g} (mean seconds; cacheclip overlaps select with load)", ""]
    out.append("| variant | select | load | recompute | other | TTFT | speedup vs full |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["ratio"] not in (None, headline_ratio):
            continue
        overlapped = r["variant"].startswith("cacheclip")
        before = max(r["select_s"], r["load_s"]) if overlapped else r["select_s"] + r["load_s"]
        other = max(0.0, r["ttft_s"] - before - r["recompute_s"])
        out.append(
            f"| {_label(r)} | {r['select_s']:.3f} | {r['load_s']:.3f} | {r['recompute_s']:.3f} | {other:.3f} "
            f"| {r['ttft_s']:.3f} | {_num(r['speedup'], '.2f')}× |"
        )
    if alignment:
        out += ["", "### Attention alignment (last token, characters; reference = primary last layer)", ""]
        out.append("| length | pair | Jaccard top-20% | KL | Pearson | Spearman |")
        out.append("|---|---|---|---|---|---|")
        for a in alignment:
            out.append(f"| {a.length} | {a.pair} | {a.jaccard:.3f} | {a.kl:.3f} | {a.pearson:.3f} | {a.spearman:.3f} |")
    return "\n".join(out) + "\n"


def _pyplot():
    """matplotlib's pyplot on the file-only backend (imported lazily: only reports need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_ratio(records: Sequence[Record], path: Path) -> None:
    plt = _pyplot()
    rows = _sorted_rows(summary(records)["rows"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    baselines = iter([("black", "-"), ("gray", "--"), ("darkgray", ":"), ("silver", "-.")])
    curves = iter(f"C{i}" for i in range(10))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        if mine[0]["ratio"] is None:  # ratio-free methods: horizontal lines
            color, style = next(baselines)
            ax.axhline(mine[0]["score"], linestyle=style, linewidth=1.2, label=variant, color=color)
        else:
            ax.plot([r["ratio"] for r in mine], [r["score"] for r in mine], marker="o", label=variant, color=next(curves))
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.set_title("Score vs recompute ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tasks(records: Sequence[Record], ratio: float, path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in _sorted_rows(summary(records)["rows"]) if r["ratio"] in (None, ratio)]
    tasks = sorted({r.task for r in records}, key=lambda t: ("single" not in t, t))
    fig, ax = plt.subplots(figsize=(max(7, len(tasks) * 1.1), 4))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        xs = [t + i * width for t in range(len(tasks))]
        ax.bar(xs, [r["per_task"].get(t, 0.0) for t in tasks], width, label=_label(r))
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"RULER per task, ratio {ratio:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alignment(maps: dict, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 5), sharex=True)
    for ax, name in zip(axes, ("aux_last", "pri_first", "pri_last")):
        chars = maps[name].float()
        smooth = torch.nn.functional.avg_pool1d(chars[None, None], 31, 1, 15)[0, 0]  # 31-character window
        ax.plot(smooth.numpy(), linewidth=0.8)
        ax.set_ylabel(name, fontsize=8)
    axes[-1].set_xlabel(f"character of the context ({maps['length']} tokens)")
    fig.suptitle("Last-token attention projected onto characters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out_dir: Path, records: Sequence[Record], alignment: Sequence[AlignmentRow], maps: dict,
          meta: dict, headline_ratio: float) -> dict[str, Path]:
    """results.json, report.md and the PNGs into `out_dir`; returns their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json", "markdown": out_dir / "report.md",
        "score_vs_ratio": out_dir / "score_vs_ratio.png", "tasks": out_dir / "tasks.png",
    }
    body = {"meta": meta, "summary": summary(records), "records": records_as_dicts(records),
            "alignment": [asdict(a) for a in alignment]}
    paths["json"].write_text(json.dumps(body, indent=1))
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    paths["markdown"].write_text(header + "\n\n" + markdown(records, alignment, headline_ratio))
    plot_score_vs_ratio(records, paths["score_vs_ratio"])
    plot_tasks(records, headline_ratio, paths["tasks"])
    if maps:
        paths["alignment"] = out_dir / "alignment.png"
        plot_alignment(maps, paths["alignment"])
    return paths
