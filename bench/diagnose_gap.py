"""Where CacheClip's remaining error lives (the quality-gap issue): repair one part of the reused cache
at a time and see how much of the error goes.

Per RULER sample (2K, the power run's seeds; the embedded Gemma 3 270M primary, SmolLM2 aux), the
shared-prefix cache (every chunk as stored, keys re-rotated; no recompute) is copied and, in the copy,
the rows of one class are replaced by full attention's own rows (exact values, not a recompute), then
the question and `full`'s greedy answer are read teacher-forced; the KL(full || repaired) averaged over
the answer's steps says how much of the error that class carried. Classes: chunk seams (the separator
tokens between chunks), each chunk's first 4 tokens, the rest; each chunk by its index; the sliding-
window layers' rows alone, the global layers' rows alone; bands of layers by depth (the first 20%, the
first and the last half); everything (a sanity check: KL 0). Also CacheClip's own cache at 0.2 and 0.5
(recomputed, not repaired), and each with its seams repaired.
Chunk 0 sits behind the prefix exactly as stored, so it is never in error.

Also the relative deviation ||K - K_full|| / ||K_full|| (and V) per class and layer kind of the reused
cache and of CacheClip's at 0.2. Per-sample rows go to a JSONL (resumable); the summary (mean, 95%
bootstrap interval, n, and the paired share of the shared-prefix KL each repair removes) to
bench/results/gap_diagnosis.json.

    python bench/diagnose_gap.py [--samples 13] [--length 2048] [--answer-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.stages.cache import BlendedCache  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.runner import decode_budget, ruler_engine, token_counter  # noqa: E402
from cacheclip_rag.evaluation.stats import bootstrap_ci  # noqa: E402
from cacheclip_rag.models.loading import layer_types  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402

FIRST = 4


def forced_logits(engine: Engine, cache: BlendedCache, plan, answer: list[int]) -> torch.Tensor:
    """[len(answer), V]: the question then the answer read teacher-forced over a copy of `cache`."""
    c = cache.copy()
    ids = list(plan.question_ids) + answer[:-1]
    positions = torch.arange(plan.question_start, plan.question_start + len(ids))
    return forward_at(engine.primary.model, c, torch.tensor([ids]), positions[None], logits_to_keep=len(answer))[0]


def mean_kl(p_rows: torch.Tensor, q_rows: torch.Tensor) -> float:
    log_p, log_q = torch.log_softmax(p_rows.double(), -1), torch.log_softmax(q_rows.double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0).mean())


def row_classes(plan) -> dict[str, torch.Tensor]:
    """Absolute cache rows of each class, over the chunks after the first."""
    seams, first, rest, by_chunk = [], [], [], {}
    for c in range(1, len(plan.chunk_ids)):
        offset, text = plan.chunk_offsets[c], plan.texts[c]
        rows = []
        for t, (start, _) in enumerate(plan.char_spans[c]):
            row = offset + t
            rows.append(row)
            (seams if start >= len(text) else first if t < FIRST else rest).append(row)
        by_chunk[f"chunk{c}"] = torch.tensor(rows, dtype=torch.long)
    classes = {"seams": seams, "first4": first, "rest": rest, "seams+first4": seams + first}
    return {**{k: torch.tensor(v, dtype=torch.long) for k, v in classes.items()}, **by_chunk}


def repaired(base: BlendedCache, full: BlendedCache, rows: torch.Tensor | None, layers: list[int] | None) -> BlendedCache:
    c = base.copy()
    rows = torch.arange(c.capacity) if rows is None else rows
    for layer in range(c.key_buffer.shape[0]) if layers is None else layers:
        c.key_buffer[layer, :, :, rows] = full.key_buffer[layer, :, :, rows]
        c.value_buffer[layer, :, :, rows] = full.value_buffer[layer, :, :, rows]
    return c


def depth_bands(layers: int) -> list[tuple[str, list[int]]]:
    """Every chunk row repaired in a band of layers by depth: the first 20% (what running every chunk row through
    those layers alone, and no further, would make exact: the price of recomputing 20% of the rows in every
    layer), the first half, the last half."""
    first20, half = -(-layers // 5), layers // 2
    return [("first20_layers", list(range(first20))), ("first50_layers", list(range(half))),
            ("last50_layers", list(range(half, layers)))]


def deviation(cache: BlendedCache, full: BlendedCache, rows: torch.Tensor, layers: list[int]) -> tuple[float, float]:
    out = []
    for a, b in ((cache.key_buffer, full.key_buffer), (cache.value_buffer, full.value_buffer)):
        x, y = a[layers][:, 0, :, rows].double(), b[layers][:, 0, :, rows].double()  # [L, KV, R, D]
        out.append(float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp(min=1e-12)).mean()))
    return out[0], out[1]


def measure(engine: Engine, sample: ruler.Sample, answer_tokens: int) -> dict:
    count = token_counter(engine)
    chunks = ruler.sample_chunks(sample, count)
    view = ruler_engine(engine, sample)
    view.ingest(chunks, progress=False)
    base = dict(max_new_tokens=max(answer_tokens, decode_budget(view, sample)), answer_prefix=sample.answer_prefix,
                prompt_stops=False)
    plan = view.plan(sample.question, chunks, RequestOptions(method="full", **base))
    full = view.prefill(plan, RequestOptions(method="full", **base))
    full_cache = full.cache.copy()
    stream = view.decode(plan, full, RequestOptions(method="full", **base))
    for _ in stream:
        if len(stream.token_ids) >= answer_tokens:
            break
    answer = list(stream.token_ids[:answer_tokens])
    reference = forced_logits(view, full_cache, plan, answer)
    kinds = layer_types(view.primary.model)
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    global_ = [i for i, k in enumerate(kinds) if k != "sliding_attention"]
    shared = view.prefill(plan, RequestOptions(method="shared_prefix", **base))
    classes = row_classes(plan)
    chunk_rows = torch.arange(plan.chunk_offsets[1], plan.question_start) if len(plan.chunk_ids) > 1 else torch.zeros(0, dtype=torch.long)
    row = {"task": sample.task, "seed": sample.seed, "tokens": plan.length, "chunks": len(chunks),
           "answer_tokens": len(answer), "rows": {k: int(v.numel()) for k, v in classes.items()},
           "needle_chunks": needle_chunks(sample, chunks)}
    kl = {"shared_prefix": mean_kl(reference, forced_logits(view, shared.cache, plan, answer))}
    kl["repair_all"] = mean_kl(reference, forced_logits(view, repaired(shared.cache, full_cache, None, None), plan, answer))
    for name, rows in classes.items():
        kl[f"repair_{name}"] = mean_kl(reference, forced_logits(view, repaired(shared.cache, full_cache, rows, None), plan, answer))
    for name, layers in (("sliding_layers", sliding), ("global_layers", global_), *depth_bands(len(kinds))):
        if layers:
            kl[f"repair_{name}"] = mean_kl(reference, forced_logits(view, repaired(shared.cache, full_cache, chunk_rows, layers), plan, answer))
    dev = {}
    for name in ("seams", "first4", "rest"):
        for kind, layers in (("sliding", sliding), ("global", global_)):
            if layers and classes[name].numel():
                dev[f"shared_{name}_{kind}"] = deviation(shared.cache, full_cache, classes[name], layers)
    for ratio in (0.2, 0.5):
        clip = view.prefill(plan, RequestOptions(method="cacheclip", ratio=ratio, selection="aux", **base))
        kl[f"cacheclip_{ratio}"] = mean_kl(reference, forced_logits(view, clip.cache, plan, answer))
        kl[f"cacheclip_{ratio}+repair_seams"] = mean_kl(
            reference, forced_logits(view, repaired(clip.cache, full_cache, classes["seams"], None), plan, answer))
        recomputed = set(clip.recomputed_positions.tolist())
        row[f"cacheclip_{ratio}_seams_recomputed"] = sum(int(r) in recomputed for r in classes["seams"])
        if ratio == 0.2:
            for name in ("seams", "first4", "rest"):
                for kind, layers in (("sliding", sliding), ("global", global_)):
                    if layers and classes[name].numel():
                        dev[f"cacheclip0.2_{name}_{kind}"] = deviation(clip.cache, full_cache, classes[name], layers)
    row["kl"], row["deviation"] = kl, dev
    return row


def needle_chunks(sample: ruler.Sample, chunks: list[str]) -> list[int]:
    """Indices of the chunks that hold a value the answer must contain (the needles the question asks for)."""
    return [i for i, text in enumerate(chunks) if any(ref in text for ref in sample.references)]


def by_needle(rows: list[dict]) -> dict:
    """Repairing the chunks that hold the asked-for needles against repairing the others, one chunk at a time:
    per sample, the mean KL after repairing one needle chunk, and after repairing one other chunk (chunk 0,
    exact behind the prefix, excluded); also the last chunk, the one next to the question."""
    needle, other, last = [], [], []
    for r in rows:
        chunks = [int(k[len("repair_chunk"):]) for k in r["kl"] if k.startswith("repair_chunk")]
        inside = [c for c in chunks if c in r["needle_chunks"]]
        outside = [c for c in chunks if c not in r["needle_chunks"]]
        if inside and outside:
            needle.append(sum(r["kl"][f"repair_chunk{c}"] for c in inside) / len(inside) / r["kl"]["shared_prefix"])
            other.append(sum(r["kl"][f"repair_chunk{c}"] for c in outside) / len(outside) / r["kl"]["shared_prefix"])
        if chunks:
            last.append(r["kl"][f"repair_chunk{max(chunks)}"] / r["kl"]["shared_prefix"])
    return {"kl_left_after_repairing_a_needle_chunk": vars(bootstrap_ci(needle)) if needle else None,
            "kl_left_after_repairing_another_chunk": vars(bootstrap_ci(other)) if other else None,
            "kl_left_after_repairing_the_last_chunk": vars(bootstrap_ci(last)) if last else None,
            "n_with_both": len(needle)}


def summarise(rows: list[dict]) -> dict:
    out = {"n": len(rows), "kl": {}, "share_of_shared_prefix_kl_removed": {}, "deviation": {}}
    for name in dict.fromkeys(k for r in rows for k in r["kl"]):  # rows of older runs may lack newer classes
        values = [r["kl"][name] for r in rows if name in r["kl"]]
        out["kl"][name] = vars(bootstrap_ci(values))
        if name != "shared_prefix":
            removed = [1 - r["kl"][name] / r["kl"]["shared_prefix"] for r in rows if name in r["kl"] and r["kl"]["shared_prefix"] > 0]
            out["share_of_shared_prefix_kl_removed"][name] = vars(bootstrap_ci(removed))
    for name in rows[0]["deviation"]:
        ks = [r["deviation"][name][0] for r in rows if name in r["deviation"]]
        vs = [r["deviation"][name][1] for r in rows if name in r["deviation"]]
        out["deviation"][name] = {"keys": vars(bootstrap_ci(ks)), "values": vars(bootstrap_ci(vs))}
    if all("needle_chunks" in r for r in rows):
        out["by_needle"] = by_needle([r for r in rows if r["kl"]["shared_prefix"] > 0])
    out["rows_per_sample"] = {k: sum(r["rows"][k] for r in rows) / len(rows) for k in ("seams", "first4", "rest")}
    out["chunk_tokens_per_sample"] = sum(r["tokens"] for r in rows) / len(rows)
    out["seams_recomputed_by_cacheclip"] = {str(ratio): sum(r[f"cacheclip_{ratio}_seams_recomputed"] for r in rows) /
                                            max(1, sum(r["rows"]["seams"] for r in rows)) for ratio in (0.2, 0.5)}
    return out


def plot(summary: dict, out: Path) -> None:
    """Horizontal bars: the share of the shared-prefix KL each repair (or CacheClip) removes, with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = {k: v for k, v in summary["share_of_shared_prefix_kl_removed"].items()
              if not k.startswith("repair_chunk") and k != "repair_all"}
    names = list(shares)
    means = [shares[k]["mean"] for k in names]
    errors = [[shares[k]["mean"] - shares[k]["low"] for k in names], [shares[k]["high"] - shares[k]["mean"] for k in names]]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.2))
    ax.barh(range(len(names)), means, xerr=errors, color=["C1" if k.startswith("cacheclip") else "C0" for k in names])
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.5)
    ax.set(xlabel="share of the shared-prefix KL removed (95% CI)", xlim=(-0.1, 1.0),
           title=f"Where the error lives (RULER {summary['length']}, n = {summary['n']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=13, help="per task (13 x 8 tasks = the power run's 104)")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--primary", default="gemma3-270m")
    p.add_argument("--rows", default=str(ROOT / "bench" / "results" / "gap_diagnosis.jsonl"))
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "gap_diagnosis.json"))
    args = p.parse_args()
    engine = Engine.from_config(EngineConfig(primary=args.primary))
    path = Path(args.rows)
    done = {(r["task"], r["seed"]) for r in map(json.loads, path.read_text().splitlines())} if path.exists() else set()
    jobs = [(task, seed) for seed in range(args.samples) for task in ruler.TASKS]
    count = token_counter(engine)
    with path.open("a") as out:
        for task, seed in tqdm(jobs, desc="gap diagnosis", initial=sum(j in done for j in jobs), total=len(jobs)):
            if (task, seed) in done:
                continue
            row = measure(engine, ruler.generate(task, args.length, seed, count), args.answer_tokens)
            out.write(json.dumps(row) + "\n")
            out.flush()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:  # rows written before the needle chunks were recorded: the samples are regenerated (seeded)
        if "needle_chunks" not in r:
            sample = ruler.generate(r["task"], args.length, r["seed"], count)
            r["needle_chunks"] = needle_chunks(sample, ruler.sample_chunks(sample, count))
    summary = summarise(rows)
    summary.update(primary=engine.primary.name, aux=engine.aux.name if engine.aux else None, length=args.length,
                   answer_tokens=args.answer_tokens, date=date.today().isoformat())
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, Path(args.json).with_suffix(".png"))
    print(f"n = {summary['n']}; teacher-forced KL to full over {args.answer_tokens} answer tokens, mean [95% CI]; "
          "share of the shared-prefix KL removed (paired)")
    for name, est in summary["kl"].items():
        share = summary["share_of_shared_prefix_kl_removed"].get(name)
        print(f"| {name} | {est['mean']:.4f} [{est['low']:.4f}, {est['high']:.4f}] | "
              + (f"{share['mean']:.2f} [{share['low']:.2f}, {share['high']:.2f}] |" if share else "- |"))
    for name, est in summary.get("by_needle", {}).items():
        if isinstance(est, dict):
            print(f"{name} (share of the shared-prefix KL): {est['mean']:.2f} [{est['low']:.2f}, {est['high']:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
