"""Cross-model KV transfer on a real same-family pair: Qwen2.5-Coder-0.5B-Instruct <-> -1.5B-Instruct
(identical tokenizers; 24 vs 28 layers, 2 KV heads, head dim 64 vs 128), both directions.

Calibration as the post does it: both models prefill the same texts (a few hundred, ~`--tokens` each),
keys RoPE-stripped, the top-k source layers per target layer by R², a closed-form ridge map per target
layer; held-out R² for keys and values; the gate's verdict. Then on RULER samples (`--length`, several
tasks): the source holds the document's cache (it was serving the conversation) and the target either
re-prefills it or takes the transferred cache (`Conversation.hand_off`), reads the question, answers.
Measured: next-token agreement after the question; KL(re-prefill || transfer) teacher-forced along the
re-prefill's greedy answer; NIAH score of both answers (retention = transfer / re-prefill); the speed-up
of the hand-off over the target's re-prefill. Writes bench/results/transfer_qwen.json.

    python bench/bench_transfer_qwen.py [--texts 200] [--tokens 256] [--length 1024] [--samples 12]
                                        [--top-k 3] [--mlp-hidden 0] [--directions up,down]

A ridge map over many source layers holds one (k·F_source)² float64 accumulator per target layer, keys and
values: every layer of the 1.5B as the source of the 0.5B (24 × 2 × 7,169²) is ~20 GB, so run such a map
with `--directions up` (0.5B -> 1.5B) alone.

Resumable: each calibration text's KV is kept under `--kv-cache` (one file per model and text, written
atomically), and each measured sample is appended to `--rows` (a jsonl keyed by direction and seed), so a
killed run continues where it stopped and a rerun with more `--samples` measures only the new ones.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_transfer import calibration_texts, switch  # noqa: E402

from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.stats import wilson_interval  # noqa: E402
from cacheclip_rag.models.loading import LoadedModel, load_model  # noqa: E402
from cacheclip_rag.transfer import Conversation, TransferConfig, calibrate  # noqa: E402
from cacheclip_rag.transfer import mapper as mapper_module  # noqa: E402

TASKS = ("single1", "single2", "single3", "multikey1")


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def greedy(conv: Conversation, budget: int) -> tuple[list[int], list[torch.Tensor]]:
    """The conversation's greedy answer, and its logits before each answer token."""
    tokens, logits = [], []
    for _ in range(budget):
        step = conv.logits.clone()
        token = int(step.argmax())
        tokens.append(token)
        logits.append(step)
        if token in conv.lm.eos_token_ids or "\n" in conv.lm.tokenizer.decode(tokens):
            break
        conv._run([token], conv.length)
        conv.ids.append(token)
    return tokens, logits


def measure(source: LoadedModel, target: LoadedModel, mapper, task: str, length: int, seed: int) -> dict:
    run = switch(source, target, mapper, task, length, seed)
    sample, question, held, handed, fresh = run.sample, run.question, run.held, run.handed, run.fresh
    transfer_s, prefill_s = run.transfer_s, run.prefill_s
    again = held.hand_off(target, mapper, force=True)  # a second copy, teacher-forced below
    for conv in (handed, fresh, again):
        conv.add(question)
    agree = int(handed.logits.argmax()) == int(fresh.logits.argmax())
    budget = max(len(target.encode(r)) for r in sample.references) + 8
    answer, fresh_logits = greedy(fresh, budget)
    forced = []
    for token, reference in zip(answer, fresh_logits):  # along the re-prefill's own answer
        forced.append(kl(reference, again.logits))
        again._run([token], again.length)
        again.ids.append(token)
    transferred = handed.reply(budget)
    return {"task": task, "seed": seed, "tokens": fresh.length, "prefill_s": prefill_s, "transfer_s": transfer_s,
            "agree": agree, "tf_kl": statistics.fmean(forced),
            "niah_transfer": ruler.score(transferred, sample.references),
            "niah_reprefill": ruler.score(target.tokenizer.decode(answer), sample.references)}


def kv_on_disk(text_kv, folder: Path):
    """`text_kv` that keeps each (model, text) result in `folder`: computed once, across runs too."""
    folder.mkdir(parents=True, exist_ok=True)

    def cached(lm, text):
        # keyed by the weights' fingerprint, not the name: other weights under one name are a miss
        path = folder / f"{lm.fingerprint.digest[:16]}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.pt"
        if path.exists():
            try:
                return torch.load(path, weights_only=False)
            except Exception:  # a damaged file is recomputed, never trusted
                path.unlink()
        kv = text_kv(lm, text)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(kv, tmp)
        os.replace(tmp, path)
        return kv

    return cached


def mapper_label(config: TransferConfig) -> str:
    """The mapper a sample was measured with, as its rows name it: "top3", "top24+mlp256"."""
    return f"top{config.top_k}" + (f"+mlp{config.mlp_hidden}" if config.mlp_hidden else "")


def measured_rows(path: Path) -> dict[tuple, dict]:
    """Samples already measured, by (direction, mapper, length, texts, seed); rows written before the mapper was
    recorded were measured with the default top-3 ridge map; a torn last line is dropped."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[(r["direction"], r.get("mapper", "top3"), r["length"], r["texts"], r["seed"])] = r
    return rows


def interval(e) -> list[float]:
    return [e.low, e.high]


def retention_interval(results: list[dict], draws: int = 4000) -> list[float]:
    """Bootstrap 95% interval of NIAH(transfer) / NIAH(re-prefill), resampling samples."""
    rng = torch.Generator().manual_seed(0)
    t = torch.tensor([[r["niah_transfer"], r["niah_reprefill"]] for r in results], dtype=torch.float64)
    idx = torch.randint(len(results), (draws, len(results)), generator=rng)
    sums = t[idx].sum(1)
    ratio = (sums[:, 0] / sums[:, 1].clamp(min=1e-12)).sort().values
    return [float(ratio[int(0.025 * draws)]), float(ratio[int(0.975 * draws) - 1])]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=200)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--samples", type=int, default=12, help="RULER samples per direction (over the tasks)")
    p.add_argument("--top-k", type=int, default=3, help="source layers per target layer (more than it has: all)")
    p.add_argument("--mlp-hidden", type=int, default=0, help="> 0: a residual MLP of this width on the ridge map")
    p.add_argument("--directions", default="up,down", help="up: 0.5B -> 1.5B, down: 1.5B -> 0.5B")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "transfer_qwen.json"))
    p.add_argument("--rows", default=str(ROOT / "bench" / "results" / "transfer_qwen_samples.jsonl"))
    p.add_argument("--kv-cache", default=str(Path.home() / ".cache" / "cacheclip" / "transfer_kv"))
    args = p.parse_args()
    directions = args.directions.split(",")
    if not directions or set(directions) - {"up", "down"}:
        p.error(f"--directions takes up and/or down, got {args.directions!r}")
    torch.manual_seed(0)
    small, large = load_model("qwen2.5-coder-0.5b"), load_model("qwen2.5-coder-1.5b")
    mapper_module.text_kv = kv_on_disk(mapper_module.text_kv, Path(args.kv_cache))
    done = measured_rows(Path(args.rows))
    texts = calibration_texts(args.texts, args.tokens)
    config = TransferConfig(top_k=args.top_k, mlp_hidden=args.mlp_hidden)
    label = mapper_label(config)
    rows, samples = [], {}
    for source, target in [pair for name, pair in (("up", (small, large)), ("down", (large, small))) if name in directions]:
        t0 = time.perf_counter()
        mapper = calibrate(source, target, texts, config)
        calibration_s = time.perf_counter() - t0
        v = mapper.validation
        direction = f"{source.name}->{target.name}"
        keys = [(direction, label, args.length, args.texts, i) for i in range(args.samples)]
        for key in (k for k in keys if k not in done):
            seed = key[-1]
            done[key] = {"direction": direction, "mapper": label, "length": args.length, "texts": args.texts,
                         **measure(source, target, mapper, TASKS[seed % len(TASKS)], args.length, seed)}
            with open(args.rows, "a") as f:
                f.write(json.dumps(done[key]) + "\n")
        results = [done[k] for k in keys]
        samples[f"{source.name}->{target.name}"] = results
        reprefill = statistics.fmean(r["niah_reprefill"] for r in results)
        transferred = statistics.fmean(r["niah_transfer"] for r in results)
        rows.append({"source": source.name, "target": target.name, "mapper": label, "r2_keys": statistics.fmean(v["key_r2"]),
                     "r2_values": statistics.fmean(v["value_r2"]), "gate": "pass" if mapper.passes_gate
                     else "refused", "next_token_agree": statistics.fmean(r["agree"] for r in results),
                     "tf_kl": statistics.fmean(r["tf_kl"] for r in results), "niah_transfer": transferred,
                     "niah_reprefill": reprefill, "retention": transferred / reprefill if reprefill else math.nan,
                     "speedup": statistics.fmean(r["prefill_s"] for r in results) /
                     statistics.fmean(r["transfer_s"] for r in results),
                     "n": len(results), "date": datetime.date.today().isoformat(),
                     "_calibration_s": calibration_s,
                     "_retention_ci": retention_interval(results),
                     "_niah_transfer_ci": interval(wilson_interval(sum(r["niah_transfer"] for r in results), len(results))),
                     "_niah_reprefill_ci": interval(wilson_interval(sum(r["niah_reprefill"] for r in results), len(results))),
                     "_min_r2": mapper.min_r2,
                     "_key_r2_min": min(v["key_r2"]), "_value_r2_min": min(v["value_r2"])})
        print(rows[-1], flush=True)
    print(f"\ncalibration: {args.texts} texts x ~{args.tokens} tokens, mapper {label}, 20% held out; "
          f"RULER {args.length} tokens, tasks {', '.join(TASKS)}; n = {args.samples} per direction")
    print("| source -> target | key R² mean (min) | value R² mean (min) | gate | next-token agree | teacher-forced KL | "
          "NIAH re-prefill | NIAH transfer | retention | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} -> {r['target']} | {r['r2_keys']:.3f} ({r['_key_r2_min']:.3f}) | {r['r2_values']:.3f} "
              f"({r['_value_r2_min']:.3f}) | {r['gate']} | {r['next_token_agree']:.2f} | {r['tf_kl']:.3f} | "
              f"{r['niah_reprefill']:.2f} | {r['niah_transfer']:.2f} | {r['retention']:.2f} {r['_retention_ci']} | {r['speedup']:.1f}x |")
    if args.json:
        write_rows(Path(args.json), rows, samples)
    return 0


def write_rows(path: Path, rows: list[dict], samples: dict[str, list[dict]]) -> None:
    """Write rows into the JSON, replacing earlier rows of the same (source, target, mapper), keeping the rest."""
    old = json.loads(path.read_text()) if path.exists() else {"rows": [], "samples": {}, "details": []}
    key = lambda r: (r["source"], r["target"], r.get("mapper", "top3"))  # noqa: E731
    new_keys = {key(r) for r in rows}
    kept = [(r, d) for r, d in zip(old["rows"], old["details"]) if key(r) not in new_keys]
    fresh = [({k: v for k, v in r.items() if not k.startswith("_")}, {k: v for k, v in r.items() if k.startswith("_")})
             for r in rows]
    merged_samples = {direction: [s for s in runs if (s["direction"], s.get("mapper", "top3")) not in
                                  {(f"{a}->{b}", m) for a, b, m in new_keys}]
                      for direction, runs in old["samples"].items()}
    for direction, runs in samples.items():
        merged_samples.setdefault(direction, []).extend(runs)
    path.write_text(json.dumps({"rows": [r for r, _ in kept + fresh], "samples": merged_samples,
                                "details": [d for _, d in kept + fresh]}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
