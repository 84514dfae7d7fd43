"""Cross-model KV transfer vs re-prefill: speed and quality, for the model pairs available here.

Pairs: SmolLM2-135M -> Gemma 3 270M (cross-family: other tokenizer, layer count, heads and head dim;
the post covers same-family pairs only), the same with the residual MLP, and SmolLM2-135M ->
"SmolLM2-pruned" (the same model with 4 of its 30 layers removed: a same-architecture pair we can
build here).

Per pair: calibrate (CPU profile: --texts x ~--tokens), then for RULER single2 samples at each
length: the source holds the document's cache (it was serving the conversation); the target either
re-prefills the document or takes the transferred cache (`Conversation.hand_off`); then it reads
the question and answers. Timed: the target's re-prefill of the document vs the hand-off. Quality:
next-token agreement and KL(re-prefill || transfer) after the question, NIAH accuracy of both.

    python bench/bench_transfer.py [--texts 40] [--tokens 512] [--lengths 1024,2048,4096] [--samples 2]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cacheclip_rag.cli import demo_chunks  # noqa: E402
from cacheclip_rag.evaluation import ruler  # noqa: E402
from cacheclip_rag.evaluation.fidelity import first_token_kl  # noqa: E402
from cacheclip_rag.models.loading import LoadedModel, load_model  # noqa: E402
from cacheclip_rag.transfer import Conversation, TransferConfig, calibrate  # noqa: E402


def pruned(lm: LoadedModel, drop: range) -> LoadedModel:
    """The same model without the layers in `drop`."""
    model = copy.deepcopy(lm.model)
    kept = [layer for i, layer in enumerate(model.model.layers) if i not in drop]
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    model.model.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [t for i, t in enumerate(model.config.layer_types) if i not in drop]
    return LoadedModel(f"{lm.name}-pruned", model, lm.tokenizer, lm.prompt)


def calibration_texts(count: int, tokens: int, seed: int = 0) -> list[str]:
    """Prose, handbook sections and needle sentences mixed, ~`tokens` tokens each (~4 chars a token)."""
    rng = random.Random(seed)
    sections = demo_chunks()
    out = []
    for i in range(count):
        parts: list[str] = []
        while sum(map(len, parts)) < tokens * 4:
            kind = rng.random()
            if kind < 0.5:
                parts.append(ruler.prose_sentence(rng))
            elif kind < 0.8:
                parts.append(rng.choice(sections)[: rng.randint(200, 800)])
            else:
                parts.append(ruler.needle_sentence(f"{rng.choice('abcdef')}-{i}", str(rng.randint(10**6, 10**7)), "numbers"))
        out.append(" ".join(parts))
    return out


@dataclass
class Switch:
    """A RULER sample whose context the source holds, handed to the target and, beside it, re-prefilled there."""

    sample: ruler.Sample
    question: str
    held: Conversation  # the source's conversation, after the context
    handed: Conversation  # the target's, with the transferred cache
    fresh: Conversation  # the target's, re-prefilled
    transfer_s: float
    prefill_s: float


def switch(source: LoadedModel, target: LoadedModel, mapper, task: str, length: int, seed: int) -> Switch:
    """Time the hand-off of a held RULER context against the target's own prefill of it."""
    count = lambda s: len(target.encode(s))  # noqa: E731
    sample = ruler.generate(task, length, seed, count)
    question = f"\n\nQuestion: {sample.question}\nAnswer:{sample.answer_prefix}"
    capacity = length * 2 + 256
    held = Conversation.start(source, capacity)
    held.add(sample.context)  # the source already holds this cache when the switch happens
    t0 = time.perf_counter()
    handed = held.hand_off(target, mapper, force=True)
    transfer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh = Conversation.start(target, capacity)
    fresh.add(sample.context)
    prefill_s = time.perf_counter() - t0
    return Switch(sample, question, held, handed, fresh, transfer_s, prefill_s)


def measure(source: LoadedModel, target: LoadedModel, mapper, length: int, seed: int) -> dict:
    run = switch(source, target, mapper, "single2", length, seed)
    sample, question, handed, fresh = run.sample, run.question, run.handed, run.fresh
    transfer_s, prefill_s = run.transfer_s, run.prefill_s
    handed.add(question)
    fresh.add(question)
    agree = int(handed.logits.argmax()) == int(fresh.logits.argmax())
    kl = first_token_kl(fresh.logits, handed.logits)
    answer_t, answer_f = handed.reply(12), fresh.reply(12)
    return {"tokens": len(fresh.ids), "prefill_s": prefill_s, "transfer_s": transfer_s, "agree": agree, "kl": kl,
            "niah_transfer": ruler.score(answer_t, sample.references),
            "niah_prefill": ruler.score(answer_f, sample.references)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=40)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--mlp-hidden", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    smollm2 = load_model("smollm2-135m")
    gemma = load_model("gemma3-270m")
    linear = TransferConfig(top_k=args.top_k)
    mlp = TransferConfig(top_k=args.top_k, mlp_hidden=args.mlp_hidden, mlp_steps=200)
    pairs = [("SmolLM2 -> Gemma 3", smollm2, gemma, linear),
             ("SmolLM2 -> Gemma 3, +MLP", smollm2, gemma, mlp),
             ("SmolLM2 -> SmolLM2-pruned", smollm2, pruned(smollm2, range(20, 24)), linear)]
    texts = calibration_texts(args.texts, args.tokens)
    lengths = [int(x) for x in args.lengths.split(",")]
    calib_rows, rows = [], []
    for name, source, target, config in pairs:
        t0 = time.perf_counter()
        mapper = calibrate(source, target, texts, config)
        v = mapper.validation
        calib_rows.append((name, time.perf_counter() - t0, statistics.fmean(v["key_r2"]), min(v["key_r2"]),
                           statistics.fmean(v["value_r2"]), min(v["value_r2"]), mapper.passes_gate))
        for length in lengths:
            results = [measure(source, target, mapper, length, seed) for seed in range(args.samples)]
            rows.append((name, length, results))
    print(f"calibration: {args.texts} texts x ~{args.tokens} tokens, top-{args.top_k} source layers, "
          f"20% held out; gate: mean R² (keys and values) >= {TransferConfig().min_r2}; +MLP: residual MLP "
          f"(hidden {args.mlp_hidden}, 200 Adam steps) per target layer\n")
    print("| pair | calibration s | key R² mean (min) | value R² mean (min) | gate |\n|---|---|---|---|---|")
    for name, secs, km, kmin, vm, vmin, ok in calib_rows:
        print(f"| {name} | {secs:.0f} | {km:.3f} ({kmin:.3f}) | {vm:.3f} ({vmin:.3f}) | {'pass' if ok else 'refused'} |")
    print("\n| pair | tokens | re-prefill s | transfer s | speedup | next-token agree | KL | NIAH re-prefill | NIAH transfer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, length, results in rows:
        mean = lambda k: statistics.fmean(r[k] for r in results)  # noqa: E731
        print(f"| {name} | {int(mean('tokens'))} | {mean('prefill_s'):.2f} | {mean('transfer_s'):.3f} | "
              f"{mean('prefill_s') / mean('transfer_s'):.1f}× | {mean('agree'):.2f} | {mean('kl'):.3f} | "
              f"{mean('niah_prefill'):.2f} | {mean('niah_transfer'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
