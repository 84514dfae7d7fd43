"""Can the primary tell from the question alone that its answer combines several passages? (issue 67)

A linear probe on the primary's hidden state: the question asked as deployed but without any chunk (the
engine's system prompt, the question as the user turn, the assistant turn opened), the last position's
hidden state at each layer, L2-normalised. The probe is fitted on `bench/data/router_train.jsonl` (199
questions written by hand, 100 answered by one passage, 99 that combine several: lists, comparisons, totals,
links); its layer is the one of the best 5-fold cross-validated AUC *on those questions only*. It is then
scored, once, on sets it never saw: the deployed families' questions (`evaluation.deployed`), RULER's
(every task asks "What are all the special magic numbers for X"), bench_docs_qa's, and
`bench/data/router_heldout.jsonl` (80 questions written before any probe was tried). The natural threshold
(decision 0) flags.

`--rows` composes what routing the flagged requests to `full` would give on a `bench_deployed.py` run:
a flagged request gets full's answer (the same engine path, so the same tokens) and full's time to first
token, the rest the default's. The probe's own forward is not added to either: its cost is measured
separately and stated beside.

    python bench/question_probe.py --features /tmp/question_features.pt --rows bench/results/deployed.jsonl \
        --json bench/results/question_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_deployed import auc, auc_interval  # noqa: E402
from bench_docs_qa import QUESTIONS  # noqa: E402
from cacheclip_rag.config import DEFAULT_SYSTEM_PROMPT  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.deployed import WORDS_FOR, cases  # noqa: E402
from cacheclip_rag.methods.spread import answer_spread  # noqa: E402
from cacheclip_rag.stages.select.question_kind import question_prompt_ids  # noqa: E402

DATA = ROOT / "bench" / "data"
SEVERAL = {"values", "compare", "link", "multivalue", "multiquery", "spread2", "spread3", "spread4", "older"}
RUNS = ("eval-deployed-2k", "eval-deployed-4k", "eval-multichunk-deployed-2k", "eval-multichunk-deployed-4k")
ROWS_PRIMARY = "qwen2.5-coder-0.5b"  # bench_deployed rows stored before they named their primary are this model's


def deployed_cells() -> list[tuple[str, int]]:
    """(family, words) of every deployed family's set: short prompts without filler, the rest at 2K and 4K."""
    return [(family, words) for family in ("short", "topical", "values", "compare", "link")
            for words in ((0,) if family == "short" else tuple(WORDS_FOR.values()))]


def _run_records(run: str) -> list[list[dict]]:
    return [json.loads(line) for line in (ROOT / "bench" / run / "records.jsonl").read_text().splitlines()]


def _asked_in(items, run: str) -> list[tuple[str, list[dict]]]:
    """(question, the run's records of it) for every request of a deployed-format RULER run; none where the
    features were made without that run's questions."""
    asked = [q for source, q, _ in items if source.startswith(f"run/{run}/")]
    return list(zip(asked, _run_records(run), strict=True)) if asked else []


def _run_family(run: str, task: str) -> str:
    return ("ruler-multichunk/" if "multichunk" in run else "ruler/") + task


def _escalated_by_words(record: dict) -> bool:
    """Whether the words-only spread budget escalated a run's request (ratio 0.5's share against the base 0.2)."""
    return record["recomputed_share"] > 0.35


def questions(count_tokens) -> list[tuple[str, str, bool]]:
    """(source, question, combines several passages) for the training set and every test set."""
    items = [("train", r["question"], r["several"]) for r in map(json.loads, (DATA / "router_train.jsonl").open())]
    seen: set[tuple[str, str]] = set()
    for family, words in deployed_cells():
        for c in cases(family, words, 52):
            if (family, c.question) not in seen:
                seen.add((family, c.question))
                items.append((f"deployed/{family}", c.question, family in SEVERAL))
    for task in ruler.TASKS:
        for seed in range(4):
            items.append((f"ruler/{task}", ruler.generate(task, 2048, seed, count_tokens).question, task in SEVERAL))
    for run in RUNS:  # the deployed-format RULER runs' own requests (every sample, both lengths)
        for records in _run_records(run):
            r = records[0]
            sample = ruler.generate(r["task"], r["length"], r["seed"], count_tokens)
            assert list(sample.references) == r["references"], (run, r["task"], r["seed"])
            items.append((f"run/{run}/{r['task']}", sample.question, r["task"] in SEVERAL))
    items += [("docs_qa", q, False) for q, _ in QUESTIONS]
    items += [("heldout", r["question"], r["several"]) for r in map(json.loads, (DATA / "router_heldout.jsonl").open())]
    return items


def features(items, lm) -> torch.Tensor:
    """Per question: the last position's hidden state at every layer of `lm`, the question asked as the library's
    probe asks it (`question_kind.question_prompt_ids`: no chunk, the default system prompt)."""
    out = []
    for _, question, _ in tqdm(items, desc="questions"):
        ids = torch.tensor([question_prompt_ids(lm, DEFAULT_SYSTEM_PROMPT, question)])
        with torch.inference_mode():
            states = lm.model(ids, output_hidden_states=True).hidden_states
        out.append(torch.stack([h[0, -1] for h in states]).float())
    return torch.stack(out)


def fit(items, feats: torch.Tensor) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import cross_val_predict

    train = [i for i, it in enumerate(items) if it[0] == "train"]
    labels = np.array([it[2] for it in items])

    def at(layer: int) -> np.ndarray:
        x = feats[:, layer].numpy()
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    cv = {}
    for layer in range(1, feats.shape[1]):
        guess = cross_val_predict(LogisticRegression(max_iter=2000), at(layer)[train], labels[train], cv=5,
                                  method="decision_function")
        cv[layer] = round(float(roc_auc_score(labels[train], guess)), 3)
    layer = max(cv, key=cv.get)
    probe = LogisticRegression(max_iter=2000).fit(at(layer)[train], labels[train])
    scores = probe.decision_function(at(layer))
    sets = defaultdict(list)
    for i, (source, question, several) in enumerate(items):
        sets[source].append({"question": question, "several": several, "score": round(float(scores[i]), 3)})
    tests = {}
    for group in ("deployed", "ruler", "heldout"):
        rows = [r for s, rs in sets.items() if s.startswith(group) or (group == "heldout" and s == "docs_qa") for r in rs]
        pos, neg = [r["score"] for r in rows if r["several"]], [r["score"] for r in rows if not r["several"]]
        tests[group] = {"n": [len(pos), len(neg)], "auc": round(auc(pos, neg), 3), "auc_95": auc_interval(pos, neg, 1000),
                        "flagged_several": sum(s > 0 for s in pos), "flagged_one": sum(s > 0 for s in neg)}
    flagged = {s: [sum(r["score"] > 0 for r in rs), len(rs)] for s, rs in sets.items()}
    return {"cv_auc_by_layer": cv, "layer": layer, "tests": tests, "flagged_by_source": flagged,
            "scores": {q["question"]: q["score"] for rs in sets.values() for q in rs},
            "probe": {"layer": layer, "weight": [round(float(w), 7) for w in probe.coef_[0]],
                      "bias": round(float(probe.intercept_[0]), 7), "cv_auc": cv[layer]}}


def routed(rows_path: Path, scores: dict[str, float], primary: str) -> list[dict]:
    """Per family and length of a bench_deployed run: the default's and the routed default's share of full's
    right answers, the share of requests routed to full, and the median time to first token of each."""
    by = defaultdict(list)
    for line in rows_path.read_text().splitlines():
        r = json.loads(line)
        if r.get("primary", ROWS_PRIMARY) == primary:
            by[(r["case"]["family"], r["length"])].append(r)
    table = []
    for (family, length), rs in sorted(by.items()):
        flag = [scores[r["case"]["question"]] > 0 for r in rs]
        solved = [(r, f) for r, f in zip(rs, flag) if r["rows"]["full"]["right"]]
        kept = sum(r["rows"]["default"]["right"] for r, _ in solved)
        kept_routed = sum(f or r["rows"]["default"]["right"] for r, f in solved)
        ttft = sorted(r["rows"]["default"]["ttft_s"] for r in rs)
        ttft_routed = sorted(r["rows"]["full" if f else "default"]["ttft_s"] for r, f in zip(rs, flag))
        escalated = sum(f or (r["rows"]["default"]["ratio"] or 0) > 0.2 + 1e-9 for r, f in zip(rs, flag))
        table.append({"family": family, "length": length, "cases": len(rs), "full_right": len(solved),
                      "default_kept": kept, "routed_kept": kept_routed, "routed_to_full": sum(flag),
                      "routed_or_escalated": escalated,
                      "median_ttft_default_s": round(ttft[len(ttft) // 2], 3),
                      "median_ttft_routed_s": round(ttft_routed[len(ttft_routed) // 2], 3)})
    return table


class Composed(NamedTuple):
    """One request of a stored run, as the confirmation composes it."""

    family: str
    length: int
    full_right: bool
    words_right: bool  # the words-only default (the spread budget before the probe)
    escalated: bool  # by the words
    base_right: bool  # the same request without the budget
    question: str
    words_s: float
    base_s: float | None  # None: not timed


def confirmed(items, scores: dict[str, float], rows_paths: list[Path], primary: str, probe_s: float) -> list[dict]:
    """What the shipped rule gives, composed from stored runs: the spread budget escalates a request only when its
    words flag it and the probe agrees. An escalated request is the words-only default's (the same engine path:
    the same tokens), plus the probe's forward `probe_s`; any other, the same request without the budget. Per
    family and length: full's right answers (strict), how many each rule keeps, how many each escalates, and the
    median time to first token (None where a vetoed request's time without the budget was not measured)."""
    requests: dict[tuple, Composed] = {}  # a later run's row replaces an earlier one's
    for line in (line for path in rows_paths for line in path.read_text().splitlines()):
        r = json.loads(line)
        rows = r["rows"]
        base = rows.get("no_spread") or rows.get("base_0.2")  # the latter untimed: the default's time where equal
        if r.get("primary", ROWS_PRIMARY) != primary or base is None:
            continue
        escalated = (rows["default"]["ratio"] or 0) > 0.2 + 1e-9
        requests[(r["case"]["family"], r["length"], r["case"]["seed"])] = Composed(
            r["case"]["family"], r["length"], rows["full"]["right"], rows["default"]["right"], escalated, base["right"],
            r["case"]["question"], rows["default"]["ttft_s"], base.get("ttft_s", None if escalated else rows["default"]["ttft_s"]))
    cases = list(requests.values())
    for run in (run for run in RUNS if _run_primary(run) == primary):  # another model's answers are not composed
        for question, records in _asked_in(items, run):
            by = {rec["variant"]: rec for rec in records}
            words = by["cacheclip_spread"]
            base = by.get("cacheclip_nospread") or by["cacheclip_requery"]
            cases.append(Composed(_run_family(run, words["task"]), words["length"], by["full"]["score"] == 1.0,
                                  words["score"] == 1.0, _escalated_by_words(words), base["score"] == 1.0, question,
                                  words["ttft_s"], base["ttft_s"]))
    by_cell = defaultdict(list)
    for c in cases:
        by_cell[(c.family, c.length)].append(c)
    table = []
    for (family, length), cs in sorted(by_cell.items()):
        flag = [c.escalated and scores[c.question] > 0 for c in cs]
        kept = [c.words_right if f else c.base_right for c, f in zip(cs, flag)]
        ttft_words = sorted(c.words_s for c in cs)
        # confirmed: the words' row and the probe; vetoed: the row without the budget and the probe; unflagged: as before
        both = [c.words_s + probe_s if f else (None if c.base_s is None else c.base_s + probe_s) if c.escalated
                else c.words_s for c, f in zip(cs, flag)]
        ttft_both = None if None in both else sorted(both)
        table.append({"family": family, "length": length, "cases": len(cs), "full_right": sum(c.full_right for c in cs),
                      "words_kept": sum(c.full_right and c.words_right for c in cs),
                      "confirmed_kept": sum(c.full_right and k for c, k in zip(cs, kept)),
                      "words_escalated": sum(c.escalated for c in cs), "confirmed_escalated": sum(flag),
                      "median_ttft_words_s": round(ttft_words[len(cs) // 2], 3),
                      "median_ttft_confirmed_s": ttft_both and round(ttft_both[len(cs) // 2], 3)})
    return table


def _run_primary(run: str) -> str:
    return json.loads((ROOT / "bench" / run / "run.json").read_text())["primary"]


def flags(items, scores: dict[str, float], n: int = 52) -> list[dict]:
    """Which requests the spread budget escalates, from the questions alone (no answer is run): per deployed
    family and length, the requests the words flag (`answer_spread` over the case's chunks) and those the probe
    then confirms; per RULER task of the deployed-format runs, the same, the words' flag read from the run (its
    escalated share). What a probe changes for a model whose answers were not run with it."""
    table = []
    for family, words in deployed_cells():
        cs = cases(family, words, n)
        worded = [answer_spread(c.question, c.chunks).spread for c in cs]
        table.append({"family": family, "words": words, "cases": len(cs), "several": family in SEVERAL,
                      "words_flagged": sum(worded),
                      "confirmed": sum(w and scores[c.question] > 0 for w, c in zip(worded, cs))})
    for run in RUNS:  # the words' flag depends on no model: every run counts
        by_task = defaultdict(lambda: [0, 0, 0])  # requests, flagged by the words, confirmed
        for question, records in _asked_in(items, run):
            words = next(rec for rec in records if rec["variant"] == "cacheclip_spread")
            cell = by_task[(words["task"], words["length"])]
            cell[0] += 1
            cell[1] += _escalated_by_words(words)
            cell[2] += _escalated_by_words(words) and scores[question] > 0
        for (task, length), (requests, worded, confirmed) in sorted(by_task.items()):
            table.append({"family": _run_family(run, task), "words": length, "cases": requests,
                          "several": task in SEVERAL, "words_flagged": worded, "confirmed": confirmed})
    return table


def plot(table: list[dict], path: Path) -> None:
    """Per family and length: the share of requests the spread budget escalates on the words alone and with the
    probe's confirmation, and the share of full's right answers each keeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['family']} {r['length'] // 1024}K" for r in table]
    x = np.arange(len(table))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.45 * len(table)), 6), sharex=True)
    for ax, (key_a, key_b, over, title) in zip((top, bottom), (
            ("words_escalated", "confirmed_escalated", "cases", "share of requests escalated to spread_ratio"),
            ("words_kept", "confirmed_kept", "full_right", "share of full's right answers kept (strict)"))):
        for offset, key, name in ((-0.2, key_a, "words alone (before)"), (0.2, key_b, "words + question probe (now)")):
            ax.bar(x + offset, [r[key] / max(1, r[over]) for r in table], 0.4, label=name)
        ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=9)
    top.legend(fontsize=8)
    bottom.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primary", default="qwen2.5-coder-0.5b")
    parser.add_argument("--features", default="question_features.pt", help="cache of the hidden states (made if absent)")
    parser.add_argument("--rows", help="a bench_deployed.py run to compose the routing over")
    parser.add_argument("--plot", help="a PNG of the confirmation table")
    parser.add_argument("--confirm-rows", nargs="*", default=[], help="further bench_deployed.py runs for --rows' confirmation")
    parser.add_argument("--probe-s", type=float, default=0.44, help="the probe's measured cost, added where it runs")
    parser.add_argument("--json")
    parser.add_argument("--export", help="write the fitted probe for the library (cacheclip_rag/data/question_probes.json)")
    args = parser.parse_args()
    cache = Path(args.features)
    if cache.exists():
        saved = torch.load(cache)
        items, feats = saved["items"], saved["feats"]
    else:
        from cacheclip_rag.models.loading import load_model

        lm = load_model(args.primary)  # loaded once: its tokenizer counts RULER's tokens, its states are the features
        items = questions(lambda text: len(lm.tokenizer(text).input_ids))
        feats = features(items, lm)
        torch.save({"items": items, "feats": feats}, cache)
    result = {"primary": args.primary, **fit(items, feats)}
    result["flags"] = flags(items, result["scores"])
    if args.rows:
        result["routed"] = routed(Path(args.rows), result["scores"], args.primary)
        result["confirmed"] = confirmed(items, result["scores"], [Path(args.rows), *map(Path, args.confirm_rows)],
                                        args.primary, args.probe_s)
    print(f"layer {result['layer']} (cv AUC {result['cv_auc_by_layer'][result['layer']]})")
    for group, t in result["tests"].items():
        print(f"  {group}: AUC {t['auc']} {t['auc_95']}, flags {t['flagged_several']}/{t['n'][0]} several, "
              f"{t['flagged_one']}/{t['n'][1]} one")
    for source, (f, n) in result["flagged_by_source"].items():
        print(f"  {source:20s} flagged {f}/{n}")
    for row in result["flags"]:
        print(f"  flags {row['family']:28s} {row['words']}: words {row['words_flagged']} -> confirmed "
              f"{row['confirmed']} of {row['cases']}")
    for row in result.get("routed", []):
        print(f"  {row['family']:8s} {row['length']}: kept {row['default_kept']} -> {row['routed_kept']} of "
              f"{row['full_right']}; to full {row['routed_to_full']}/{row['cases']}; "
              f"median TTFT {row['median_ttft_default_s']} -> {row['median_ttft_routed_s']} s")
    for row in result.get("confirmed", []):
        print(f"  words+probe {row['family']:28s} {row['length']}: kept {row['words_kept']} -> {row['confirmed_kept']} of "
              f"{row['full_right']}; escalated {row['words_escalated']} -> {row['confirmed_escalated']}/{row['cases']}; "
              f"median TTFT {row['median_ttft_words_s']} -> {row['median_ttft_confirmed_s']} s")
    if args.plot and result.get("confirmed"):
        plot(result["confirmed"], Path(args.plot))
    probe = result.pop("probe")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.export:
        path = Path(args.export)
        probes = json.loads(path.read_text()) if path.exists() else {}
        probes[args.primary] = {**probe, "system_prompt": DEFAULT_SYSTEM_PROMPT,
                                "fitted_on": "bench/data/router_train.jsonl (bench/question_probe.py)"}
        path.write_text(json.dumps(probes, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
