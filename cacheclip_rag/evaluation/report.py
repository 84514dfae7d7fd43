"""The evaluation's outputs: results.json, report.md (scores, retention, fidelity, efficiency,
alignment) and PNG plots (score vs ratio as the paper's Figure 6, per-task bars as Figure 5,
character attention maps as Figure 3)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .profiles import is_default
from .runner import AlignmentRow, Record, cross_budget_differences, paired_differences, records_as_dicts, summary
from .stats import bootstrap_ci, ratio_of_means

ORDER = ["full", "direct", "shared_prefix", "ape", "ape_tuned", "cacheblend", "cacheclip", "oracle", "cacheclip_nogroup",
         "cacheclip_noprefix", "cacheclip_nominal", "cacheclip_seams", "cacheclip_boundary4", "recompute_sliding_only",
         "recompute_global_only"]


# The quality-gap issue's must-hold for a reuse method: score retention >= 0.95 with the interval's low end
# >= 0.85, and a teacher-forced KL to full at most 0.25x shared-prefix reuse's (both ratios of paired means).
RETENTION_TARGET, RETENTION_FLOOR, KL_SHARE_TARGET = 0.95, 0.85, 0.25


def _label(row: dict) -> str:
    return row["variant"] if row["ratio"] is None else f"{row['variant']} @ {row['ratio']:g}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def _ci(e: dict, fmt: str = ".3f") -> str:
    return f"{e['mean']:{fmt}} [{e['low']:{fmt}}, {e['high']:{fmt}}]"


def _difference_cells(d: dict) -> str:
    """The metric, n, interval, sign-test counts, p and mark of one paired-difference row."""
    return (f"{d['metric']} | {d['n']} | {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | {d['wins']}/{d['losses']} "
            f"| {d['p']:.3g} | {'✓' if d['excludes_zero'] else ''} |")


def _sorted_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r.get("length", 0), ORDER.index(r["variant"]) if r["variant"] in ORDER else 99,
                                       r["ratio"] or 0.0))


def differences(records: Sequence[Record]) -> dict[str, list[dict]]:
    """The paired differences at equal ratios and across budgets (10,000 bootstrap resamples each)."""
    return {"paired": paired_differences(records), "cross_budget": cross_budget_differences(records)}


@dataclass(frozen=True)
class Estimates:
    """What the report derives from the records by resampling, computed once and shared by the
    JSON files, the markdown and the plots."""

    summary: dict  # runner.summary's body
    rows: list[dict]  # its rows in report order
    diffs: dict[str, list[dict]]
    quality: dict[int, dict]  # per context length
    tasks: list[str]


def estimate(records: Sequence[Record]) -> Estimates:
    body = summary(records)
    rows = _sorted_rows(body["rows"])
    diffs = differences(records)
    per_length = {length: quality(records, length, diffs, rows) for length in sorted({r.length for r in records})}
    return Estimates(summary=body, rows=rows, diffs=diffs, quality=per_length,
                     tasks=sorted({r.task for r in records}, key=lambda t: ("single" not in t, t)))


def markdown(records: Sequence[Record], alignment: Sequence[AlignmentRow], headline_ratio: float,
             est: Estimates | None = None) -> str:
    est = est or estimate(records)
    rows, diffs, tasks = est.rows, est.diffs, est.tasks
    out = []
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        out += [f"### {length}-token contexts: means with bootstrap 95% intervals (n samples each)", "",
                "| variant | n | score | retention vs full | solved (Wilson) | KL(full‖m) over full's answer | "
                "top-1 agreement | first-token KL | Δ log p(gold) vs full, nats | recomputed share | TTFT s | speedup |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        methods = {m["method"] if m["ratio"] is None else (m["method"], m["ratio"]): m
                   for m in est.quality[length]["methods"]}
        for r in mine:
            q = methods.get(r["variant"] if r["ratio"] is None else (r["variant"], r["ratio"]), {})
            retention = _ci(q["retention"], ".2f") if "retention" in q else "–"
            out.append(
                f"| {_label(r)} | {r['n']} | {_ci(r['score'], '.2f')} | {retention} | {_ci(r['solved'], '.2f')} | {_ci(r['tf_kl'])} "
                f"| {_ci(r['tf_top1'], '.2f')} | {_ci(r['kl'])} | {_ci(r['gold_ll_delta'], '.2f')} "
                f"| {r['recomputed_share']:.3f} | {r['ttft_s']:.2f} | {_num(r['speedup'], '.2f')}× |")
        judged = [m for m in est.quality[length]["methods"] if "must_hold" in m]
        if judged:
            out += ["", f"Against the must-hold ({length} tokens): retention ≥ {RETENTION_TARGET:g} with its low end ≥ "
                    f"{RETENTION_FLOOR:g}, KL ≤ {KL_SHARE_TARGET:g}× shared-prefix reuse's (ratios of paired means)", "",
                    "| variant | n | retention vs full | KL / shared-prefix KL | retention | KL | both |",
                    "|---|---|---|---|---|---|---|"]
            for m in judged:
                verdict = m["must_hold"]
                out.append(f"| {_label({'variant': m['method'], 'ratio': m['ratio']})} | {m['n']} | "
                           f"{_ci(m['retention'], '.2f')} | {_ci(m['kl_share_of_shared_prefix'], '.2f')} | "
                           + " | ".join("met" if verdict[k] else "not met" for k in ("retention", "kl", "met")) + " |")
        out += ["", f"Scores per task ({length} tokens; mean over samples)", "",
                "| variant | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for r in mine:
            if r["ratio"] in (None, headline_ratio):
                out.append(f"| {_label(r)} | " + " | ".join(_num(r["per_task"].get(t), ".2f") for t in tasks) + " |")
        out.append("")
    paired = diffs["paired"]
    if paired:
        out += ["### Paired differences, cacheclip − other (same samples; bootstrap 95% interval; sign test)", "",
                "Lower is better for the KLs; higher for score, top-1 agreement and Δ log p(gold). ✓: the interval "
                "excludes zero.", "",
                "| length | ratio | other | metric | n | mean difference [95% CI] | cacheclip higher / lower | p | |",
                "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {d['length']} | {d['ratio']:g} | {d['other']} | {_difference_cells(d)}" for d in paired]
    cross = diffs["cross_budget"]
    if cross:
        out += ["", "### Less recompute: cacheclip at a ratio − cacheblend at a larger one (same samples; paired "
                "bootstrap 95% interval; sign test)", "",
                "| length | cacheclip ratio | cacheblend ratio | metric | n | mean difference [95% CI] "
                "| cacheclip higher / lower | p | |", "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {d['length']} | {d['ratio']:g} | {d['other_ratio']:g} | {_difference_cells(d)}" for d in cross]
    out += ["", f"### Efficiency breakdown at ratio {headline_ratio:g} (mean seconds; cacheclip overlaps select with load)", "",
            "| length | variant | select | load | recompute | other | TTFT | speedup vs full |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ratio"] not in (None, headline_ratio):
            continue
        overlapped = r["variant"].startswith("cacheclip")
        before = max(r["select_s"], r["load_s"]) if overlapped else r["select_s"] + r["load_s"]
        other = max(0.0, r["ttft_s"] - before - r["recompute_s"])
        out.append(f"| {r['length']} | {_label(r)} | {r['select_s']:.3f} | {r['load_s']:.3f} | {r['recompute_s']:.3f} "
                   f"| {other:.3f} | {r['ttft_s']:.3f} | {_num(r['speedup'], '.2f')}× |")
    if alignment:
        out += ["", "### Attention alignment (last token, characters; reference = primary last layer; "
                "mean [bootstrap 95% CI] over samples)", "",
                "| length | pair | n | Jaccard top-20% | KL | Pearson | Spearman |", "|---|---|---|---|---|---|---|"]
        for (length, pair), group in _alignment_groups(alignment).items():
            cells = [_ci(_as_dict(bootstrap_ci([getattr(a, m) for a in group]))) for m in ("jaccard", "kl", "pearson", "spearman")]
            out.append(f"| {length} | {pair} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _as_dict(e) -> dict:
    return {"mean": e.mean, "low": e.low, "high": e.high, "n": e.n}


def _alignment_groups(alignment: Sequence[AlignmentRow]) -> dict[tuple[int, str], list[AlignmentRow]]:
    groups: dict[tuple[int, str], list[AlignmentRow]] = {}
    for a in alignment:
        groups.setdefault((a.length, a.pair), []).append(a)
    return groups


def _pyplot():
    """matplotlib's pyplot on the file-only backend (imported lazily: only reports need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metric_vs_ratio(rows: list[dict], metric: str, ylabel: str, path: Path) -> None:
    """One panel per context length of the summary `rows`: ratio-taking methods as curves with 95% error
    bars, ratio-free methods as horizontal lines with their interval shaded."""
    plt = _pyplot()
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        mine = [r for r in rows if r["length"] == length]
        baselines = iter([("black", "-"), ("gray", "--"), ("tab:brown", ":"), ("tab:olive", "-."), ("tab:cyan", "--")])
        curves = iter(f"C{i}" for i in range(10))
        curved = [v for v in dict.fromkeys(r["variant"] for r in mine) if any(r["ratio"] is not None for r in mine
                                                                              if r["variant"] == v)]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            own = [r for r in mine if r["variant"] == variant]
            if own[0]["ratio"] is None:
                color, style = next(baselines)
                e = own[0][metric]
                ax.axhline(e["mean"], linestyle=style, linewidth=1.2, color=color, label=f"{variant} (n={own[0]['n']})")
                ax.axhspan(e["low"], e["high"], color=color, alpha=0.08)
            else:
                dodge = (curved.index(variant) - (len(curved) - 1) / 2) * 0.006  # curves at one ratio side by side
                xs = [r["ratio"] + dodge for r in own]
                ys = [r[metric]["mean"] for r in own]
                err = [[r[metric]["mean"] - r[metric]["low"] for r in own], [r[metric]["high"] - r[metric]["mean"] for r in own]]
                ns = sorted({r["n"] for r in own})
                n = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"  # runs merged at some ratios
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=next(curves), label=f"{variant} (n={n})")
        ax.set_xlim(0.0, max(0.55, max((r["ratio"] or 0.0) for r in mine) + 0.05))
        ax.set_xlabel("recompute ratio (share of chunk tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{length}-token contexts, 95% intervals")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_score_vs_ratio(rows: list[dict], path: Path) -> None:
    plot_metric_vs_ratio(rows, "score", "RULER score (mean over samples)", path)


def plot_paired(diffs: dict[str, list[dict]], path: Path) -> None:
    """Forest plot: cacheclip − other on teacher-forced KL and on score, with paired 95% intervals; at
    equal ratios (blue), then against cacheblend at larger ratios (orange)."""
    plt = _pyplot()
    rows = diffs["paired"] + diffs["cross_budget"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * max(4, len(rows) // 5) + 1.5))
    for ax, metric, title in ((axes[0], "tf_kl", "KL(full‖m) over full's answer (lower = closer)"),
                              (axes[1], "score", "RULER score (higher = better)")):
        mine = [d for d in rows if d["metric"] == metric]
        labels = [f"{d['length']} @ {d['ratio']:g} vs {d['other']}"
                  + (f" @ {d['other_ratio']:g}" if "other_ratio" in d else "") + f" (n={d['n']})" for d in mine]
        ys = list(range(len(mine)))
        for across, color in ((False, "C0"), (True, "C1")):
            group = [(y, d) for y, d in zip(ys, mine) if ("other_ratio" in d) == across]
            ax.errorbar([d["mean"] for _, d in group], [y for y, _ in group],
                        xerr=[[d["mean"] - d["low"] for _, d in group], [d["high"] - d["mean"] for _, d in group]],
                        fmt="o", capsize=3, color=color)
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.set_yticks(ys, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"cacheclip − other: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tasks(est: Estimates, ratio: float, path: Path) -> None:
    plt = _pyplot()
    length = min(r["length"] for r in est.rows)
    rows = [r for r in est.rows if r["length"] == length and r["ratio"] in (None, ratio)]
    tasks = est.tasks
    fig, ax = plt.subplots(figsize=(max(7, len(tasks) * 1.1), 4))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        xs = [t + i * width for t in range(len(tasks))]
        ax.bar(xs, [r["per_task"].get(t, 0.0) for t in tasks], width, label=_label(r))
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"RULER per task, {length} tokens, ratio {ratio:g} (n={rows[0]['n'] // max(1, len(tasks))} per task)")
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


def quality(records: Sequence[Record], length: int, diffs: dict[str, list[dict]] | None = None,
            rows: list[dict] | None = None) -> dict:
    """Per method and ratio at one context length: n, score with its interval, teacher-forced KL with
    its interval, achieved recompute share; the paired differences at equal ratios, and cacheclip against
    cacheblend at larger ratios (for scripts that check claims). `diffs` and the sorted summary `rows`
    are computed when not given."""
    rows = [r for r in rows or _sorted_rows(summary(records)["rows"]) if r["length"] == length]
    full = next((r for r in rows if r["variant"] == "full"), None)
    base = {(x.task, x.seed): x.score for x in records if x.length == length and x.variant == "full"}
    shared = {(x.task, x.seed): x.tf_kl for x in records if x.length == length and x.variant == "shared_prefix"}
    diffs = diffs or differences(records)
    out = {"length": length, "methods": [],
           **{k: [d for d in found if d["length"] == length] for k, found in diffs.items()}}
    for r in rows:
        mine = [x for x in records if x.length == length and x.variant == r["variant"] and x.ratio == r["ratio"]]
        entry = {"method": r["variant"], "ratio": r["ratio"], "n": r["n"], "score": r["score"], "solved": r["solved"],
                 "tf_kl": r["tf_kl"], "tf_top1": r["tf_top1"], "first_token_kl": r["kl"],
                 "gold_ll_delta": r["gold_ll_delta"], "recompute_share": r["recomputed_share"],
                 "recompute_share_range": [min(x.recomputed_share for x in mine),
                                           max(x.recomputed_share for x in mine)],
                 "default": is_default(r["variant"], r["ratio"])}
        if full is not None and full["score"]["mean"] > 0:
            pairs = [(x.score, base[(x.task, x.seed)]) for x in mine if (x.task, x.seed) in base]
            entry["retention"] = ratio_of_means(pairs)  # mean(method) / mean(full), resampled jointly
        kl_pairs = [(x.tf_kl, shared[(x.task, x.seed)]) for x in mine if (x.task, x.seed) in shared]
        if r["variant"] not in ("full", "shared_prefix") and len(kl_pairs) > 1 and sum(b for _, b in kl_pairs) > 0:
            entry["kl_share_of_shared_prefix"] = ratio_of_means(kl_pairs)
        if "retention" in entry and "kl_share_of_shared_prefix" in entry:
            entry["must_hold"] = must_hold(entry["retention"], entry["kl_share_of_shared_prefix"])
        out["methods"].append(entry)
    return out


def must_hold(retention: dict, kl_share: dict) -> dict:
    """The quality-gap issue's verdicts for one method (see RETENTION_TARGET): each part, and both."""
    kept = retention["mean"] >= RETENTION_TARGET and retention["low"] >= RETENTION_FLOOR
    close = kl_share["mean"] <= KL_SHARE_TARGET
    return {"retention": kept, "kl": close, "met": kept and close}


def write(out_dir: Path, records: Sequence[Record], *, alignment: Sequence[AlignmentRow], maps: dict,
          meta: dict, headline_ratio: float) -> dict[str, Path]:
    """results.json, report.md and the PNGs into `out_dir`; returns their paths by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json", "markdown": out_dir / "report.md",
        "score_vs_ratio": out_dir / "score_vs_ratio.png", "fidelity_vs_ratio": out_dir / "fidelity_vs_ratio.png",
        "paired": out_dir / "paired.png", "tasks": out_dir / "tasks.png",
    }
    est = estimate(records)
    body = {"meta": meta, "summary": est.summary, "paired": est.diffs["paired"],
            "records": records_as_dicts(records), "alignment": [asdict(a) for a in alignment]}
    paths["json"].write_text(json.dumps(body, indent=1))
    for length in sorted({r.length for r in records}):
        paths[f"quality_{length}"] = out_dir / f"quality_{length // 1024}k.json" if length % 1024 == 0 else \
            out_dir / f"quality_{length}.json"
        paths[f"quality_{length}"].write_text(json.dumps(est.quality[length], indent=1))
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    paths["markdown"].write_text(header + "\n\n" + markdown(records, alignment, headline_ratio, est))
    plot_score_vs_ratio(est.rows, paths["score_vs_ratio"])
    plot_metric_vs_ratio(est.rows, "tf_kl", "KL(full‖method) over full's answer, nats", paths["fidelity_vs_ratio"])
    if est.diffs["paired"]:
        plot_paired(est.diffs, paths["paired"])
    else:
        del paths["paired"]
    plot_tasks(est, headline_ratio, paths["tasks"])
    if maps:
        paths["alignment"] = out_dir / "alignment.png"
        plot_alignment(maps, paths["alignment"])
    return paths
