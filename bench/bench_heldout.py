"""Held-out cases built unlike the project's RULER generator, so a selection's gain is the method's and
not the benchmark's: the haystack is real documentation (the long descriptions of installed packages,
cut into sentences), the needle one of four formats unlike RULER's "special magic number" sentence, the
chunk size drawn per case (80 / 160 / 320 tokens, no overlap), and the question asked in the engine's
own prompt layout (its system prompt and question template, not RULER's raw layout). Per case, every
method answers the same question over the same stored chunks at ratio 0.2 (exact budgets), judged as
the quality-gap issue judges: teacher-forced KL(full || method) over `full`'s greedy answer (48
tokens), and whether the answer holds the needle's value. Resumable (one JSON line per case).

    python bench/bench_heldout.py [--primary gemma3-270m] [--aux smollm2-135m] [--length 2048] [--cases 40]
        [--methods shared_prefix,cacheblend,cacheclip,cacheclip_requery] [--out bench/results/heldout.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import Diagnostics, EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation.fidelity import teacher_forced_fidelity  # noqa: E402
from cacheclip_rag.evaluation.ruler import chunk_sentences  # noqa: E402
from cacheclip_rag.evaluation.runner import VARIANTS  # noqa: E402
from cacheclip_rag.evaluation.stats import bootstrap_ci, paired_bootstrap_ci, sign_test  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402

PACKAGES = ("torch", "transformers", "tqdm", "openai", "fastapi", "pydantic", "redis", "langsmith", "numpy",
            "sentence-transformers", "accelerate", "regex", "charset-normalizer", "psutil", "xxhash", "safetensors",
            "faiss-cpu", "requests", "jinja2")  # dependencies of the project's test extras: on every test machine
PLACES = ("north", "harbour", "granite", "cedar", "willow", "copper", "amber", "lantern")
NAMES = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Ferreira", "Novak", "Haddad", "Brennan")
COLOURS = ("teal", "crimson", "ochre", "lilac", "indigo", "saffron", "olive", "coral")
ANSWER_TOKENS = 48


def haystack_sentences() -> list[str]:
    """Prose sentences of the installed packages' descriptions (code, tables, links and headings dropped)."""
    sentences = []
    for name in PACKAGES:
        try:
            text = metadata.metadata(name).get_payload() or metadata.metadata(name).get("Description", "")
        except metadata.PackageNotFoundError:
            continue
        text = re.sub(r"```.*?```", " ", text, flags=re.S)
        for line in text.splitlines():
            line = line.strip()
            if not line or line[0] in "#|<>![-*=`.:" or "http" in line or "    " in line:
                continue
            for s in re.split(r"(?<=[.!?])\s+", line):
                if 40 <= len(s) <= 300 and s[-1] in ".!?" and sum(c.isalpha() for c in s) > 0.7 * len(s):
                    sentences.append(s)
    if len(sentences) < 200:
        raise SystemExit(f"only {len(sentences)} prose sentences in the installed packages' descriptions")
    return sentences


def needle(rng: random.Random) -> tuple[str, str, str]:
    """(sentence, question, value) in one of four formats."""
    kind = rng.randrange(4)
    if kind == 0:
        place, code = rng.choice(PLACES), f"{rng.randrange(10**5, 10**6)}"
        return (f"The access code for the {place} vault is {code}.", f"What is the access code for the {place} vault?",
                code)
    if kind == 1:
        name, colour = rng.choice(NAMES), rng.choice(COLOURS)
        return (f"According to the staff survey, Dr. {name}'s favourite colour is {colour}.",
                f"What is Dr. {name}'s favourite colour according to the staff survey?", colour)
    if kind == 2:
        ident, crates = f"{rng.choice('KMRTX')}{rng.choice('ABLQZ')}-{rng.randrange(1000, 9999)}", str(rng.randrange(13, 97))
        return (f"Shipment {ident} left the depot carrying {crates} crates.",
                f"How many crates did shipment {ident} carry?", crates)
    ledger, room = rng.randrange(100, 999), f"{rng.choice('BCDFG')}{rng.randrange(10, 99)}"
    return (f"In the archive, ledger number {ledger} is kept in room {room}.", f"In which room is ledger {ledger} kept?",
            room)


def build_case(pool: list[str], seed: int, length: int, count) -> dict:
    rng = random.Random(f"heldout/{seed}")
    sentence, question, value = needle(rng)
    order = rng.sample(range(len(pool)), len(pool))
    chosen, total = [], 0
    for i in order:
        if total >= length:
            break
        chosen.append(pool[i])
        total += count(pool[i]) + 1
    chosen.insert(rng.randrange(len(chosen) + 1), sentence)
    size = rng.choice((80, 160, 320))
    return {"seed": seed, "question": question, "value": value, "chunk_size": size,
            "chunks": chunk_sentences(chosen, count, size, 0)}


def run_case(engine: Engine, case: dict, methods: list[str], ratio: float) -> dict:
    engine.ingest(case["chunks"], progress=False)
    rows, result = {}, {"seed": case["seed"], "chunk_size": case["chunk_size"], "chunks": len(case["chunks"])}
    for name in ["full", *methods]:
        v = VARIANTS[name]
        options = RequestOptions(method=v.method, ratio=ratio, selection=v.selection, aux_share=v.aux_share,
                                 diagnostics=Diagnostics(grouping=v.grouping, exact_budget=v.exact_budget),
                                 max_new_tokens=ANSWER_TOKENS, prompt_stops=False)
        plan = engine.plan(case["question"], case["chunks"], options)
        prefill = engine.prefill(plan, options)
        if name == "full":
            stream = engine.decode(plan, prefill, options)
            text = "".join(stream)
            tokens = list(stream.token_ids)
            rows["full"] = engine.teacher_forced_logits(plan, prefill, tokens)
            result["tokens"] = plan.length
            kl, top1 = 0.0, 1.0
        else:
            kl, top1 = teacher_forced_fidelity(rows["full"], engine.teacher_forced_logits(plan, prefill, tokens), tokens)
            text = "".join(engine.decode(plan, prefill, options))  # overwrites the forced answer rows first
        share = prefill.recomputed_rows / max(1, plan.question_start - plan.prefix_len)
        result[name] = {"tf_kl": kl, "tf_top1": top1, "right": float(case["value"].lower() in text.lower()),
                        "share": 1.0 if name == "full" else share, "answer": text}
    return result


def report(done: list[dict], methods: list[str]) -> None:
    print(f"n = {len(done)} held-out cases; mean [bootstrap 95% CI]")
    print("| method | right | KL(full‖m) | KL / shared-prefix KL | recomputed share |")
    print("|---|---|---|---|---|")
    base = [c["shared_prefix"]["tf_kl"] for c in done] if "shared_prefix" in methods else None
    for name in ["full", *methods]:
        right = bootstrap_ci([c[name]["right"] for c in done])
        kl = bootstrap_ci([c[name]["tf_kl"] for c in done])
        ratio = f"{kl.mean / max(1e-12, sum(base) / len(base)):.2f}" if base else "—"
        share = sum(c[name]["share"] for c in done) / len(done)
        print(f"| {name} | {right} | {kl} | {ratio} | {share:.3f} |")
    for a, b in (("cacheclip_requery", "cacheclip"), ("cacheclip_requery", "cacheblend"), ("cacheclip", "cacheblend")):
        if a in methods and b in methods:
            x, y = [c[a]["tf_kl"] for c in done], [c[b]["tf_kl"] for c in done]
            wins, losses, p = sign_test(y, x)
            print(f"- paired KL {a} − {b}: {paired_bootstrap_ci(x, y)}; {a} lower in {wins}, higher in {losses} "
                  f"(sign test p = {p:.3g})")


def plot(done: list[dict], methods: list[str], path: Path) -> None:
    """Mean teacher-forced KL per method with its bootstrap 95% interval (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    est = [bootstrap_ci([c[m]["tf_kl"] for c in done]) for m in methods]
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(methods)))
    ax.errorbar([e.mean for e in est], range(len(methods)), capsize=3, fmt="o",
                xerr=[[e.mean - e.low for e in est], [e.high - e.mean for e in est]])
    ax.set_yticks(range(len(methods)), methods)
    ax.invert_yaxis()
    ax.set_xlabel("KL(full || method) per answer token, nats (95% CI)")
    ax.set_title(f"held-out cases (n = {len(done)}), ratio 0.2")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--primary", default="gemma3-270m")
    ap.add_argument("--aux", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--methods", default="shared_prefix,cacheblend,cacheclip,cacheclip_requery")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "heldout.jsonl"))
    args = ap.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}")
    out = Path(args.out)
    done = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    path = tempfile.mkdtemp()
    engine = Engine(primary=load_model(args.primary), aux=load_model(args.aux), store=LMDBStore(path),
                    config=EngineConfig(store_path=path))
    count = lambda text: len(engine.primary.encode(text))  # noqa: E731
    pool = haystack_sentences()
    seen = {c["seed"] for c in done}
    for seed in tqdm([s for s in range(args.cases) if s not in seen], desc="held-out", unit="case"):
        result = run_case(engine, build_case(pool, seed, args.length, count), methods, args.ratio)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        done.append(result)
    report(done, methods)
    plot(done, methods, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
