"""Quality as deployed (issue 67): the families of `cacheclip_rag.evaluation.deployed`, ingested behind the
engine's default system prompt and asked through the chat template (`Engine.plan`/`prefill`/`decode`, the
path `Engine.generate`, the server and the frameworks take), on the default primary with the shipped
request defaults. Per case:

- `full` (the reference) and the default (`RequestOptions()`: cacheclip, ratio 0.2, the spread budget, the
  short-prompt floor): greedy answer (strict score: every value, no other), time to first token, the ratio
  it ran at, teacher-forced KL to `full` along full's answer;
- `before`: the default without the short-prompt floor (`min_recompute_tokens=0`), the default before this
  issue (short family only: elsewhere the floor is below 0.2 of the chunk tokens and the two are the same);
- `shared_prefix` reuse: teacher-forced KL only (the KL goals are ratios to it);
- diagnosis conditions over a fresh blended cache, each the base selection at 0.2 plus extra rows:
  `facts_whole` (every row of the chunks holding the answer: knows where the facts are, not a method),
  `attended_whole` (every row of each chunk whose share of the question's attention over the reused cache is
  at least twice the mean), `ratio_0.5` (the base selection at 0.5); or `no_spread`, the default without the
  spread budget (`spread_ratio=None`), measured as the default is (answer, TTFT, ratio), right after it;
- signals: per chunk, the question's attention share over the reused cache (the default's own scoring pass),
  the lexical spread flag, and the first-token KL between reuse alone and the base 0.2 recompute.

Resumable: one JSON line per case in `--out`. Summaries with `--report`.

    python bench/bench_deployed.py --family short --length 0 --cases 52 --out bench/results/deployed.jsonl
    python bench/bench_deployed.py --family values --length 2048 --cases 52 --out bench/results/deployed.jsonl
    python bench/bench_deployed.py --report bench/results/deployed.jsonl --json bench/results/quality_deployed.json \
        --plot bench/results/quality_deployed.png --into bench/results/quality_multichunk.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import Diagnostics, EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation.deployed import FAMILIES, WORDS_FOR, Case, case, strict_score  # noqa: E402
from cacheclip_rag.evaluation.fidelity import first_token_kl, teacher_forced_fidelity  # noqa: E402
from cacheclip_rag.evaluation.stats import paired_bootstrap_ci, ratio_of_means, wilson_interval  # noqa: E402
from cacheclip_rag.stages.request import Prefill  # noqa: E402
from cacheclip_rag.methods.spread import answer_spread  # noqa: E402
from common import chunk_shares, prefill_with_rows  # noqa: E402

MAX_NEW = 40
ATTENDED = 2.0  # a chunk is attended when its share of the question's attention is at least this x the mean


def decoded(engine: Engine, plan, prefill: Prefill, options: RequestOptions, started: float) -> tuple[str, list[int], float]:
    stream = engine.decode(plan, prefill, options, started)
    text = "".join(stream)
    return text, list(stream.token_ids), stream.answer.timings.ttft_s


def measured(engine: Engine, c: Case, options: RequestOptions, full_tokens: list[int] | None, full_rows) -> dict:
    started = time.perf_counter()
    plan = engine.plan(c.question, c.chunks, options)
    prefill = engine.prefill(plan, options)
    text, tokens, ttft = decoded(engine, plan, prefill, options, started)
    row = {"output": text, "right": strict_score(text, c), "ttft_s": ttft, "ratio": prefill.ratio,
           "recomputed": prefill.recomputed_rows, "chunk_tokens": plan.question_start - plan.prefix_len}
    if full_tokens is not None:
        row["tf_kl"] = teacher_forced_fidelity(full_rows, engine.teacher_forced_logits(plan, prefill, full_tokens),
                                               full_tokens)[0]
    return row | {"_plan": plan, "_prefill": prefill, "_tokens": tokens}


def with_rows(engine: Engine, c: Case, plan, options: RequestOptions, extra) -> dict:
    """The base selection at `options.ratio` over a fresh blended cache, plus `extra(plan, scores)` rows."""
    prefill = prefill_with_rows(engine, plan, options, extra)
    stream = engine.decode(plan, prefill, options)
    text = "".join(stream)
    return {"output": text, "right": strict_score(text, c), "recomputed": int(prefill.recomputed_positions.numel()),
            "_logits": prefill.logits, "_prefill": prefill, "_tokens": list(stream.token_ids)}


SIGNAL_TOKENS = 6  # the answer tokens the sequence signals read (a decision after them costs that many steps)


def answer_signals(engine: Engine, plan, base: dict, reuse: Prefill) -> dict:
    """Model-read signals of the base 0.2 recompute, for the budget decision (issue 67 item 4): its first-token
    confidence (top probability, margin to the second, entropy), whether reuse alone's first token is the
    same, and over its first `SIGNAL_TOKENS` answer tokens its own mean log-probability, reuse alone's mean
    log-probability of them and the mean KL(base || reuse) along them (teacher-forced)."""
    log_p = torch.log_softmax(base["_logits"].double(), dim=-1)
    top = log_p.exp().topk(2)
    out = {"base_p1": float(top.values[0]), "base_margin": float(top.values[0] - top.values[1]),
           "base_entropy": float(-(log_p.exp() * log_p).sum()),
           "same_first": int(base["_logits"].argmax()) == int(reuse.logits.argmax())}
    tokens = base["_tokens"][:SIGNAL_TOKENS]
    if tokens:
        own = torch.log_softmax(engine.teacher_forced_logits(plan, base["_prefill"], tokens).double(), dim=-1)
        other = torch.log_softmax(engine.teacher_forced_logits(plan, reuse, tokens).double(), dim=-1)
        index = torch.tensor(tokens)[:, None]
        out |= {"base_logp": float(own.gather(1, index).mean()), "reuse_logp": float(other.gather(1, index).mean()),
                "seq_kl": float((own.exp() * (own - other)).sum(-1).mean())}
    return out


CONDITIONS = ("base_0.2", "facts_whole", "attended_whole", "ratio_0.5")


def evaluate(engine: Engine, c: Case, conditions: tuple[str, ...] = CONDITIONS) -> dict:
    engine.ingest(c.chunks, progress=False)
    default = RequestOptions(max_new_tokens=MAX_NEW)
    full = measured(engine, c, replace(default, method="full"), None, None)
    plan, full_tokens = full["_plan"], full["_tokens"]
    full_rows = engine.teacher_forced_logits(plan, full["_prefill"], full_tokens)
    rows = {"full": full, "default": measured(engine, c, default, full_tokens, full_rows)}
    if c.family == "short":
        rows["before"] = measured(engine, c, replace(default, min_recompute_tokens=0), full_tokens, full_rows)
    reuse = engine.prefill(plan, replace(default, method="shared_prefix", ratio=0.0))
    rows["shared_prefix"] = {"tf_kl": teacher_forced_fidelity(full_rows, engine.teacher_forced_logits(
        plan, reuse, full_tokens), full_tokens)[0]}
    # signals: the question's attention share per chunk over the reused cache (the default's scoring pass)
    base = replace(default, spread_ratio=None, min_recompute_tokens=0)
    shares = chunk_shares(engine, plan, base)
    signals = {"shares": shares, "spread": answer_spread(c.question, c.chunks).spread}
    if c.family != "short":
        n = len(plan.chunk_ids)
        mean = sum(shares[1:]) / max(1, n - 1)
        whole = lambda chunks: [torch.full((len(ids),), i in chunks, dtype=torch.bool)  # noqa: E731
                                for i, ids in enumerate(plan.chunk_ids)]
        attended = {i for i in range(1, n) if shares[i] >= ATTENDED * mean}
        runs = {"base_0.2": (base, None), "facts_whole": (base, whole(set(c.fact_chunks))),
                "attended_whole": (base, whole(attended)), "ratio_0.5": (replace(base, ratio=0.5), None)}
        for name in conditions:
            if name == "no_spread":  # what the lexical spread budget costs and wins, timed as served
                rows[name] = measured(engine, c, replace(default, spread_ratio=None), full_tokens, full_rows)
            elif name == "words_only":  # the spread budget on the words alone, no question probe (before it shipped)
                rows[name] = measured(engine, c, replace(default, diagnostics=Diagnostics(question_probe=False)),
                                      full_tokens, full_rows)
            else:
                rows[name] = with_rows(engine, c, plan, *runs[name])
        signals["attended"] = sorted(attended)
        if "base_0.2" in rows:
            signals |= answer_signals(engine, plan, rows["base_0.2"], reuse)
            signals["reuse_vs_base_kl"] = first_token_kl(rows["base_0.2"]["_logits"], reuse.logits)
    for row in rows.values():
        for key in ("_plan", "_prefill", "_tokens", "_logits"):
            row.pop(key, None)
    return {"case": asdict(c) | {"chunks": len(c.chunks)}, "prompt_tokens": plan.length, "rows": rows, "signals": signals}


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)["case"]
            done.add((r["family"], r["words"], r["seed"], json.loads(line).get("primary", EngineConfig().primary)))
    words = 0 if args.family == "short" else WORDS_FOR[args.length]
    todo = [s for s in range(args.cases) if (args.family, words, s, args.primary) not in done]
    with tempfile.TemporaryDirectory() as store:
        engine = Engine.from_config(EngineConfig(primary=args.primary, aux=None, store_path=store))
        for seed in tqdm(todo, desc=f"{args.family} {args.length}"):
            row = evaluate(engine, case(args.family, words, seed), tuple(args.conditions.split(",")))
            row["length"], row["primary"] = args.length, args.primary
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def _ci(e) -> dict:
    return {"mean": round(e.mean, 4), "low": round(e.low, 4), "high": round(e.high, 4)}


def report(path: Path) -> list[dict]:
    """Per family and length: full's right answers, and per method the share of them it keeps (Wilson 95%),
    teacher-forced KL as a share of reuse's (bootstrap 95%), escalations, median TTFT."""
    by: dict[tuple[str, int], list[dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        by.setdefault((r["case"]["family"], r["length"], r.get("primary", EngineConfig().primary)), []).append(r)
    table = []
    for (family, length, primary), rs in sorted(by.items()):
        solved = [r for r in rs if r["rows"]["full"]["right"]]
        methods = [m for m in rs[0]["rows"] if m not in ("full", "shared_prefix")]
        for m in methods:
            kept = sum(r["rows"][m]["right"] for r in solved)
            row = {"family": family, "length": length, "primary": primary, "format": "deployed", "method": m, "cases": len(rs),
                   "full_right": len(solved), "n": len(solved), "kept": kept,
                   "strict_retention": _ci(wilson_interval(kept, len(solved))) if solved else None,
                   "recomputed_share": sum(r["rows"][m]["recomputed"] / max(1, r["rows"]["default"]["chunk_tokens"])
                                           for r in rs) / len(rs)}
            if "tf_kl" in rs[0]["rows"][m]:
                row["tf_kl_share_of_reuse"] = ratio_of_means([(r["rows"][m]["tf_kl"], r["rows"]["shared_prefix"]["tf_kl"])
                                                              for r in rs])
            if "ttft_s" in rs[0]["rows"][m]:
                ttft = sorted(r["rows"][m]["ttft_s"] for r in rs)
                full_ttft = sorted(r["rows"]["full"]["ttft_s"] for r in rs)
                row["median_ttft_s"], row["full_median_ttft_s"] = ttft[len(ttft) // 2], full_ttft[len(ttft) // 2]
                row["ttft_minus_full_s"] = _ci(paired_bootstrap_ci([r["rows"][m]["ttft_s"] for r in rs],
                                                                   [r["rows"]["full"]["ttft_s"] for r in rs]))
                row["escalated"] = sum((r["rows"][m]["ratio"] or 0) > 0.2 + 1e-9 for r in rs) / len(rs)
                if m != "default":
                    row["ttft_minus_default_s"] = _ci(paired_bootstrap_ci([r["rows"][m]["ttft_s"] for r in rs],
                                                                          [r["rows"]["default"]["ttft_s"] for r in rs]))
            if m != "default" and solved:
                d = paired_bootstrap_ci([float(r["rows"][m]["right"]) for r in solved],
                                        [float(r["rows"]["default"]["right"]) for r in solved])
                row["vs_default"] = _ci(d)
            table.append(row)
    return table


def signals(path: Path) -> list[dict]:
    """How well each signal tells the requests the larger budget helps (ratio 0.5 right where the base 0.2
    selection is wrong, full right) from the rest, per family: the share each flags among both groups."""
    by: dict[tuple[str, int], list[dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "ratio_0.5" in r["rows"] and "base_0.2" in r["rows"]:
            by.setdefault((r["case"]["family"], r["length"], r.get("primary", EngineConfig().primary)), []).append(r)
    tests = {"spread (lexical)": lambda r: r["signals"]["spread"],
             **{f"KL(reuse, base) > {t}": (lambda t: lambda r: r["signals"]["reuse_vs_base_kl"] > t)(t)
                for t in (0.05, 0.1, 0.2, 0.5)},
             }
    table = []
    for (family, length, primary), rs in sorted(by.items()):
        helps = [r for r in rs if r["rows"]["full"]["right"] and r["rows"]["ratio_0.5"]["right"]
                 and not r["rows"]["base_0.2"]["right"]]
        rest = [r for r in rs if r not in helps]
        for name, test in tests.items():
            table.append({"family": family, "length": length, "primary": primary, "signal": name, "helped": len(helps), "rest": len(rest),
                          "flags_helped": sum(map(test, helps)), "flags_rest": sum(map(test, rest))})
    return table


# continuous signals of `answer_signals`, each oriented so that a larger value says "escalate"
SCORES = {"KL(reuse, base) first token": lambda s: s["reuse_vs_base_kl"],
          "1 - top probability": lambda s: 1 - s["base_p1"], "1 - margin": lambda s: 1 - s["base_margin"],
          "entropy": lambda s: s["base_entropy"], "first token differs from reuse's": lambda s: float(not s["same_first"]),
          "-mean log p (own answer)": lambda s: -s["base_logp"], "-mean log p under reuse": lambda s: -s["reuse_logp"],
          "KL(base, reuse) along the answer": lambda s: s["seq_kl"],
          "chunk mass: 1 - top chunk's share": lambda s: 1 - mass_shape(s["shares"])[0],
          "chunk mass: second chunk / top chunk": lambda s: mass_shape(s["shares"])[1] / mass_shape(s["shares"])[0],
          "chunk mass: entropy": lambda s: entropy(mass_shape(s["shares"]))}


def mass_shape(shares: list[float]) -> list[float]:
    """The question's attention mass per reused chunk (chunk 0, exact, left out), as shares, largest first."""
    rest = shares[1:]
    return sorted((v / sum(rest) for v in rest), reverse=True)


def entropy(shares: list[float]) -> float:
    """Normalised entropy of `shares`: 1 when the mass is even over the chunks, 0 when one chunk holds it."""
    return -sum(v * math.log(v) for v in shares if v > 0) / math.log(len(shares)) if len(shares) > 1 else 0.0


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties half (Mann-Whitney)."""
    pairs = [(p > n) + 0.5 * (p == n) for p in positive for n in negative]
    return sum(pairs) / len(pairs) if pairs else float("nan")


def auc_interval(positive: list[float], negative: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% bootstrap interval of `auc`, each group resampled on its own."""
    rng = random.Random(seed)
    found = sorted(auc(rng.choices(positive, k=len(positive)), rng.choices(negative, k=len(negative)))
                   for _ in range(resamples))
    return [round(found[int(0.025 * resamples)], 3), round(found[int(0.975 * resamples) - 1], 3)]


def readable(score, signals: dict) -> bool:
    try:
        score(signals)
    except KeyError:
        return False
    return True


def separation(path: Path) -> list[dict]:
    """Per family and length, each continuous signal's AUC between the requests where ratio 0.5 wins an
    answer the base 0.2 loses and the rest, and the share flagged among the rest at the threshold that flags
    every such request (what catching them all would cost)."""
    by: dict[tuple, list[dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "base_0.2" in r["rows"] and "ratio_0.5" in r["rows"]:
            by.setdefault((r["case"]["family"], r["length"], r.get("primary", EngineConfig().primary)), []).append(r)
    table = []
    for (family, length, primary), rs in sorted(by.items()):
        helps = [r for r in rs if r["rows"]["full"]["right"] and r["rows"]["ratio_0.5"]["right"]
                 and not r["rows"]["base_0.2"]["right"]]
        rest = [r for r in rs if r not in helps]
        for name, score in SCORES.items():
            if not all(readable(score, r["signals"]) for r in rs):  # a run that did not record this signal
                continue
            pos, neg = [score(r["signals"]) for r in helps], [score(r["signals"]) for r in rest]
            row = {"family": family, "length": length, "primary": primary, "signal": name, "helped": len(pos),
                   "rest": len(neg), "auc": round(auc(pos, neg), 3)}
            if pos and neg:
                row["auc_95"] = auc_interval(pos, neg)
            if pos:
                row["rest_flagged_catching_all"] = sum(n >= min(pos) for n in neg)
            table.append(row)
    return table


def plot(table: list[dict], path: Path) -> None:
    """Strict retention of full's right answers per family (and primary), one bar per method, 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["family"], r["length"], r["primary"]) for r in table if r["n"]})
    methods = list(dict.fromkeys(r["method"] for r in table))
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(groups), 3.6))
    width = 0.8 / len(methods)
    for m_i, method in enumerate(methods):
        for g_i, group in enumerate(groups):
            row = next((r for r in table if (r["family"], r["length"], r["primary"]) == group and r["method"] == method
                        and r["n"]), None)
            if row is None:
                continue
            ret = row["strict_retention"]
            x = g_i + (m_i - (len(methods) - 1) / 2) * width
            ax.bar(x, ret["mean"], width, color=f"C{m_i}", label=method)  # the legend keeps one of each
            ax.errorbar(x, ret["mean"], yerr=[[ret["mean"] - ret["low"]], [ret["high"] - ret["mean"]]], color="black",
                        capsize=2, linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{f}\n{ln or 'short'} {p[-4:]}\nn={next(r['n'] for r in table if (r['family'], r['length'], r['primary']) == (f, ln, p))}"
                        for f, ln, p in groups], fontsize=8)
    ax.set_ylabel("share of full's right answers kept")
    ax.set_ylim(0, 1.05)
    ax.set_title("Asked as deployed: chat template, chunks behind the generic system prompt", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES)
    parser.add_argument("--length", type=int, default=2048, choices=(0, *WORDS_FOR))
    parser.add_argument("--cases", type=int, default=52)
    parser.add_argument("--primary", default=EngineConfig().primary)
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="diagnosis conditions (base_0.2 first), or no_spread: the default without the spread budget, timed beside it, "
                        "or words_only: the spread budget without the question probe")
    parser.add_argument("--out", default="bench/results/deployed.jsonl")
    parser.add_argument("--report")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--into", help="also put the multi-chunk families' rows under 'deployed' in this JSON "
                                       "(bench/results/quality_multichunk.json, whose RULER rows get format 'ruler')")
    args = parser.parse_args()
    if args.report:
        table = report(Path(args.report))
        for row in table:
            ret = row["strict_retention"]
            print(f"{row['family']:8} {row['length']:5} {row['primary'][-4:]} {row['method']:15} n={row['n']:3}/{row['cases']:3} "
                  f"kept {row['kept']:3} {ret['mean'] if ret else float('nan'):.2f} "
                  f"[{ret['low'] if ret else 0:.2f}, {ret['high'] if ret else 0:.2f}] "
                  f"recomputed {row['recomputed_share']:.2f} "
                  f"KL/reuse {row.get('tf_kl_share_of_reuse', {}).get('mean', float('nan')):.2f} "
                  f"ttft {row.get('median_ttft_s', float('nan')):.2f}s (full {row.get('full_median_ttft_s', float('nan')):.2f}) "
                  f"esc {row.get('escalated', float('nan')):.2f}")
        found = signals(Path(args.report))
        for row in found:
            print(f"{row['family']:8} {row['length']:5} {row['primary'][-4:]} {row['signal']:22} flags {row['flags_helped']}/{row['helped']} "
                  f"where 0.5 helps, {row['flags_rest']}/{row['rest']} elsewhere")
        separated = separation(Path(args.report))
        for row in separated:
            print(f"{row['family']:8} {row['length']:5} {row['signal']:36} AUC {row['auc']:.2f} {row.get('auc_95')} (helped {row['helped']}, "
                  f"rest {row['rest']}; catching all flags {row.get('rest_flagged_catching_all', '-')} of the rest)")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": table, "signals": found, "separation": separated}, indent=1))
        if args.plot:
            plot(table, Path(args.plot))
        if args.into:
            merged = json.loads(Path(args.into).read_text())
            for row in merged.get("rows", []):
                row.setdefault("format", "ruler")
            merged["deployed"] = [row for row in table if row["family"] != "short"]
            Path(args.into).write_text(json.dumps(merged, indent=1))
        return 0
    if args.family is None:
        parser.error("--family is required to run")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
