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
from cacheclip_rag.evaluation.deployed import cases  # noqa: E402

DATA = ROOT / "bench" / "data"
SEVERAL = {"values", "compare", "link", "multivalue", "multiquery"}


def questions(count_tokens) -> list[tuple[str, str, bool]]:
    """(source, question, combines several passages) for the training set and every test set."""
    items = [("train", r["question"], r["several"]) for r in map(json.loads, (DATA / "router_train.jsonl").open())]
    for family in ("short", "topical", "values", "compare", "link"):
        seen: set[str] = set()
        for words in (0,) if family == "short" else (1500, 3000):
            for c in cases(family, words, 52):
                if c.question not in seen:
                    seen.add(c.question)
                    items.append((f"deployed/{family}", c.question, family in SEVERAL))
    for task in ruler.TASKS:
        for seed in range(4):
            items.append((f"ruler/{task}", ruler.generate(task, 2048, seed, count_tokens).question, task in SEVERAL))
    items += [("docs_qa", q, False) for q, _ in QUESTIONS]
    items += [("heldout", r["question"], r["several"]) for r in map(json.loads, (DATA / "router_heldout.jsonl").open())]
    return items


def features(items, lm) -> torch.Tensor:
    """Per question: the last position's hidden state at every layer of `lm` (question asked with no chunk)."""
    tok = lm.tokenizer
    out = []
    for _, question, _ in tqdm(items, desc="questions"):
        chat = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), return_tensors="pt").input_ids
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
            "scores": {q["question"]: q["score"] for rs in sets.values() for q in rs}}


def routed(rows_path: Path, scores: dict[str, float], primary: str) -> list[dict]:
    """Per family and length of a bench_deployed run: the default's and the routed default's share of full's
    right answers, the share of requests routed to full, and the median time to first token of each."""
    by = defaultdict(list)
    for line in rows_path.read_text().splitlines():
        r = json.loads(line)
        if r.get("primary", "qwen2.5-coder-0.5b") == primary:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--primary", default="qwen2.5-coder-0.5b")
    parser.add_argument("--features", default="question_features.pt", help="cache of the hidden states (made if absent)")
    parser.add_argument("--rows", help="a bench_deployed.py run to compose the routing over")
    parser.add_argument("--json")
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
    if args.rows:
        result["routed"] = routed(Path(args.rows), result["scores"], args.primary)
    print(f"layer {result['layer']} (cv AUC {result['cv_auc_by_layer'][result['layer']]})")
    for group, t in result["tests"].items():
        print(f"  {group}: AUC {t['auc']} {t['auc_95']}, flags {t['flagged_several']}/{t['n'][0]} several, "
              f"{t['flagged_one']}/{t['n'][1]} one")
    for source, (f, n) in result["flagged_by_source"].items():
        print(f"  {source:20s} flagged {f}/{n}")
    for row in result.get("routed", []):
        print(f"  {row['family']:8s} {row['length']}: kept {row['default_kept']} -> {row['routed_kept']} of "
              f"{row['full_right']}; to full {row['routed_to_full']}/{row['cases']}; "
              f"median TTFT {row['median_ttft_default_s']} -> {row['median_ttft_routed_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
