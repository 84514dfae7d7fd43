"""End-to-end TTFT on one GPU: a random-weight model in the Qwen2.5-14B shape (no downloads exist on the
GPU machine), 1K-token chunks, 16K context (more lengths in the same process), ratio 0.2: `full`,
`shared_prefix`, `cacheblend` and `cacheclip` (aux in the Qwen2.5-0.5B shape, on the GPU by default),
with chunk caches served from each tier in turn: `device` (GPU-resident), `host` (pinned host RAM,
loaded layer by layer beside the recompute), `lmdb` (the store, page cache warm). Prints one table
and rewrites the JSON after every case, so a run stopped at its time limit keeps what it measured.

    python bench/bench_gpu_e2e.py                      # GPU: the real shapes, bf16
    python bench/bench_gpu_e2e.py --tiny --device cpu  # the same code path on tiny models (a smoke run)

TTFT is the median of `--repeats` unsynchronised requests (stages overlap as they do in service). The
stage columns come from one more request with `sync_timings` (the GPU synchronised at each stage's
end): `load` (chunk caches into the blended cache), `select` (the aux's pass; for cacheclip it runs
in a thread beside `load`, so the two overlap and only the longer counts), `recompute` (the selected
rows and the question through the primary), `other` = that request's TTFT minus the critical path
(tokenisation, planning, the wait for the aux beyond the load, the first token's sampling).
`--json PATH` writes one object per row: context, ratio, method, tier, ttft_s, load_s, select_s,
recompute_s, other_s, recomputed, speedup_vs_full, date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from cacheclip_rag.config import Diagnostics, EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine, default_kernel
from cacheclip_rag.evaluation.ruler import prose_sentence
from cacheclip_rag.models.loading import LoadedModel, PromptFormat
from cacheclip_rag.store import LMDBStore
from cacheclip_rag.testing import tiny_config, tiny_tokenizer
from cacheclip_rag.store.tiers import DeviceTier, HostTier

QWEN25_14B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                  num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-6)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)
PROMPT = PromptFormat(prefix_template="System: {system}\nDocuments:\n", question_template="Question: {question}\nAnswer:")
TIERS = ("device", "host", "lmdb")


def random_model(name: str, shape: dict | None, device: str, dtype: torch.dtype, tokenizer, seed: int) -> LoadedModel:
    """Seeded random weights; its fingerprint is its config and seed (hashing 26 GB would take a minute)."""
    if shape is None:
        config = tiny_config("qwen2", len(tokenizer))
    else:
        config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=1, pad_token_id=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    identity = f"random:{name}:seed{seed}:{json.dumps(shape, sort_keys=True)}:{dtype}"
    return LoadedModel(name, model.eval(), tokenizer, PROMPT, identity=identity)


def chunk_texts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = ""
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
            text += prose_sentence(rng) + " "
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        out.append(text[: offsets[tokens - 1][1]])  # exactly `tokens` tokens
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(engine: Engine, question: str, chunks: list[str], options: RequestOptions, repeats: int) -> dict:
    """Median TTFT of `repeats` requests as served, and the stage breakdown of one synchronised request."""
    ttfts = []
    for _ in range(repeats):
        sync(engine.config.device)
        ttfts.append(engine.generate(question, chunks, options).timings.ttft_s)
    sync(engine.config.device)
    staged = engine.generate(question, chunks, replace(options, diagnostics=Diagnostics(sync_timings=True)))
    t = staged.timings
    overlapped = options.method == "cacheclip"  # aux selection runs beside the load
    critical = (max(t.load_s, t.select_s) if overlapped else t.load_s + t.select_s) + t.recompute_s
    return {"ttft": statistics.median(ttfts), "load": t.load_s, "select": t.select_s, "recompute": t.recompute_s,
            "other": max(0.0, t.ttft_s - critical), "recomputed": staged.recompute_fraction}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke run of the same code)")
    p.add_argument("--lengths", default=None, help="context tokens, comma-separated, first measured first "
                   "(default 16384; the grid: 16384,8192,4096)")
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--ratios", default="0.2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiers", default=",".join(TIERS), help="where chunk caches come from, in order: " + ", ".join(TIERS))
    p.add_argument("--aux", choices=("cpu", "gpu", "both"), default="gpu")
    p.add_argument("--json", default=None, help="rewritten after every case")
    args = p.parse_args()
    chunk_tokens = args.chunk_tokens or (64 if args.tiny else 1024)
    lengths = [int(x) for x in (args.lengths or ("256" if args.tiny else "16384")).split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    tiers = args.tiers.split(",")
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise SystemExit(f"unknown tiers {sorted(unknown)}; choose from {', '.join(TIERS)}")
    dtype = torch.float32 if args.tiny or args.device == "cpu" else torch.bfloat16
    tokenizer = tiny_tokenizer()
    t0 = time.perf_counter()
    primary = random_model("qwen2.5-14b-random", None if args.tiny else QWEN25_14B, args.device, dtype, tokenizer, 0)
    auxes = {}
    if args.aux in ("gpu", "both"):
        auxes["gpu"] = random_model("qwen2.5-0.5b-random", None if args.tiny else QWEN25_05B, args.device, dtype,
                                    tokenizer, 1)
    if args.aux in ("cpu", "both"):
        auxes["cpu"] = random_model("qwen2.5-0.5b-random", None if args.tiny else QWEN25_05B, "cpu", torch.float32,
                                    tokenizer, 1)
    print(f"models built in {time.perf_counter() - t0:.0f} s on {args.device} ({dtype})", flush=True)
    path = tempfile.mkdtemp(prefix="cacheclip-gpu-e2e-")
    store = LMDBStore(path, map_size=64 << 30)
    config = EngineConfig(store_path=path, device=args.device, system_prompt="You answer from the documents.")
    kernel = default_kernel(primary)
    on_gpu = args.device.startswith("cuda")
    front = {"lmdb": store,
             "host": HostTier(store, 40 << 30, pin=on_gpu),
             "device": DeviceTier(store, args.device, 40 << 30) if on_gpu else DeviceTier(store, "cpu", 40 << 30)}
    question = "Which harbour master repaired the northern pier before the autumn storms arrived?"
    rows: list[dict] = []
    today = datetime.date.today().isoformat()

    def write() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))

    for length in lengths:
        chunks = chunk_texts(tokenizer, max(1, length // chunk_tokens), chunk_tokens, seed=length)
        full_ttft = None
        for tier in tiers:
            engines = {a: Engine(primary=primary, store=front[tier], config=config, aux=aux, kernel=kernel)
                       for a, aux in auxes.items()}
            first = next(iter(engines.values()))
            t1 = time.perf_counter()
            for engine in engines.values():
                engine.ingest(chunks, progress=False, direct=False)
            print(f"{length} tokens, {tier} tier: ingest {time.perf_counter() - t1:.1f} s", flush=True)
            cases = ([("full", 0.0, None)] if full_ttft is None else []) + [("shared_prefix", 0.0, None)]
            cases += [(m, r, a) for r in ratios
                      for m, a in (("cacheblend", None), ("requery", None), *(("cacheclip", a) for a in engines))]
            for method, ratio, aux in cases:
                engine = engines[aux] if aux else first
                # "cacheclip": the paper's aux selection; "requery": cacheclip's default, the question's attention
                options = RequestOptions(method="cacheclip" if method == "requery" else method, ratio=ratio,
                                         max_new_tokens=1, selection="question" if method == "requery" else "aux")
                engine.generate(question, chunks, options)  # warm-up: kernels compiled, the tier filled
                r = measure(engine, question, chunks, options, args.repeats)
                if method == "full":
                    full_ttft = r["ttft"]
                label = {"cacheclip": f"cacheclip (aux {(aux or '').upper()})",
                         "requery": "cacheclip (default: requery)"}.get(method, method)
                rows.append({"context": length, "ratio": ratio, "method": label, "tier": "-" if method == "full" else tier,
                             "ttft_s": r["ttft"], "load_s": r["load"], "select_s": r["select"],
                             "recompute_s": r["recompute"], "other_s": r["other"], "recomputed": r["recomputed"],
                             "speedup_vs_full": full_ttft / r["ttft"], "date": today})
                row = rows[-1]
                print(f"| {length} | {row['tier']} | {label} | {ratio:g} | {row['recomputed']:.2f} | "
                      f"{1e3 * row['ttft_s']:.1f} | {row['speedup_vs_full']:.2f}x | {1e3 * row['load_s']:.1f} | "
                      f"{1e3 * row['select_s']:.1f} | {1e3 * row['recompute_s']:.1f} | {1e3 * row['other_s']:.1f} |",
                      flush=True)
                write()
    print(f"\nprimary {primary.name} {dtype}, aux {', '.join(auxes)}, chunks of {chunk_tokens} tokens, "
          f"median of {args.repeats}, kernel={'triton' if kernel else 'sdpa'}; stages from one synchronised request "
          "(cacheclip: select overlaps load)")
    print("| context | tier | method | ratio | recomputed | TTFT ms | speedup vs full | load ms | select ms | "
          "recompute ms | other ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['tier']} | {r['method']} | {r['ratio']:g} | {r['recomputed']:.2f} | "
              f"{1e3 * r['ttft_s']:.1f} | {r['speedup_vs_full']:.2f}x | {1e3 * r['load_s']:.1f} | "
              f"{1e3 * r['select_s']:.1f} | {1e3 * r['recompute_s']:.1f} | {1e3 * r['other_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
