"""End-to-end TTFT on one GPU: a random-weight model in the Qwen2.5-14B shape (no downloads exist on the
GPU machine), 1K-token chunks, 4K/8K/16K contexts, ratios 10/20/30%: `full`, `shared_prefix`,
`cacheblend`, `cacheclip` with the aux (Qwen2.5-0.5B shape) on the CPU and on the GPU, with the
breakdown (load, select, recompute). Chunk caches come through the GPU-resident tier (`DeviceTier`).
Prints one table; speedups are against `full` at the same length, measured in the same run.

    python bench/bench_gpu_e2e.py                      # GPU: the real shapes, bf16
    python bench/bench_gpu_e2e.py --tiny --device cpu  # the same code path on tiny models (a smoke run)

`--tier host` reads chunk caches from the store on every request (LMDB pages in the OS cache, copied
to the GPU: the issue's "KV from the host tier"); `--tier device` keeps them GPU-resident. Stage
times are synchronised (`sync_timings`), so load/select/recompute are each stage's own GPU time.
`--json PATH` writes one object per row: context, ratio, method, ttft_s, load_s, select_s,
recompute_s, speedup_vs_full, tier, date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine import Engine, default_kernel
from cacheclip_rag.evaluation.ruler import prose_sentence
from cacheclip_rag.models import LoadedModel, PromptFormat
from cacheclip_rag.store import LMDBStore
from cacheclip_rag.testing import tiny_config, tiny_tokenizer
from cacheclip_rag.tier import DeviceTier

QWEN25_14B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                  num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-6)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)
PROMPT = PromptFormat(prefix_template="System: {system}\nDocuments:\n", question_template="Question: {question}\nAnswer:")


def random_model(name: str, shape: dict | None, device: str, dtype: torch.dtype, tokenizer) -> LoadedModel:
    if shape is None:
        config = tiny_config("qwen2", len(tokenizer))
    else:
        config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=1, pad_token_id=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LoadedModel(name, model.eval(), tokenizer, PROMPT)


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


def run(engine: Engine, question: str, chunks: list[str], options: RequestOptions, repeats: int) -> dict:
    """The median-TTFT run of `repeats`, with its stage breakdown."""
    answers = []
    for _ in range(repeats):
        sync(engine.config.device)
        answers.append(engine.generate(question, chunks, options))
    pick = sorted(answers, key=lambda a: a.timings.ttft_s)[len(answers) // 2]  # the median run
    t = pick.timings
    return {"ttft": t.ttft_s, "load": t.load_s, "select": t.select_s, "recompute": t.recompute_s,
            "recomputed": pick.recompute_fraction}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny random models (CPU smoke run of the same code)")
    p.add_argument("--lengths", default=None, help="context tokens, comma-separated (default 4096,8192,16384)")
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--ratios", default="0.1,0.2,0.3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tier", choices=("host", "device"), default="host")
    p.add_argument("--aux", choices=("cpu", "gpu", "both"), default="both")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    chunk_tokens = args.chunk_tokens or (64 if args.tiny else 1024)
    lengths = [int(x) for x in (args.lengths or ("256,512" if args.tiny else "4096,8192,16384")).split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    dtype = torch.float32 if args.tiny or args.device == "cpu" else torch.bfloat16
    tokenizer = tiny_tokenizer()
    t0 = time.perf_counter()
    primary = random_model("qwen2.5-14b-random", None if args.tiny else QWEN25_14B, args.device, dtype, tokenizer)
    aux_gpu = random_model("qwen2.5-0.5b-random", None if args.tiny else QWEN25_05B, args.device, dtype, tokenizer)
    aux_cpu = LoadedModel("qwen2.5-0.5b-random-cpu", aux_gpu.model.to(torch.float32).to("cpu") if args.device == "cpu"
                          else random_model("x", None if args.tiny else QWEN25_05B, "cpu", torch.float32, tokenizer).model,
                          tokenizer, PROMPT)
    print(f"models built in {time.perf_counter() - t0:.0f} s on {args.device} ({dtype})", flush=True)
    path = tempfile.mkdtemp(prefix="cacheclip-gpu-e2e-")
    store = LMDBStore(path, map_size=64 << 30)
    config = EngineConfig(store_path=path, device=args.device, system_prompt="You answer from the documents.")
    tier = DeviceTier(store, args.device, 40 << 30) if args.device.startswith("cuda") and args.tier == "device" else store
    kernel = default_kernel(primary)
    engines = {
        "cpu": Engine(primary=primary, store=tier, config=config, aux=aux_cpu, kernel=kernel),
        "gpu": Engine(primary=primary, store=tier, config=config, aux=aux_gpu, kernel=kernel),
    }
    auxes = ("cpu", "gpu") if args.aux == "both" else (args.aux,)
    question = "Which harbour master repaired the northern pier before the autumn storms arrived?"
    rows = []
    for length in lengths:
        chunks = chunk_texts(tokenizer, max(1, length // chunk_tokens), chunk_tokens, seed=length)
        for aux in auxes:
            engines[aux].ingest(chunks, progress=False, direct=False)
        cases = [("full", 0.0, "gpu"), ("shared_prefix", 0.0, "gpu")]
        cases += [(m, r, a) for r in ratios for m, a in (("cacheblend", "gpu"), *(("cacheclip", a) for a in auxes))]
        for method, ratio, aux in cases:  # warm-up (kernels compiled, tier filled)
            engines[aux].generate(question, chunks, RequestOptions(method=method, ratio=ratio, max_new_tokens=1))
        results = {}
        for method, ratio, aux in cases:
            options = RequestOptions(method=method, ratio=ratio, max_new_tokens=1, sync_timings=True)
            results[(method, ratio, aux)] = run(engines[aux], question, chunks, options, args.repeats)
        full = results[("full", 0.0, "gpu")]["ttft"]
        for (method, ratio, aux), r in results.items():
            label = f"{method} (aux {aux.upper()})" if method == "cacheclip" else method
            rows.append((length, label, ratio, r, full / r["ttft"]))
    print(f"\nprimary {primary.name} {dtype}, aux {aux_gpu.name}, chunks of {chunk_tokens} tokens, "
          f"median of {args.repeats}, kernel={'triton' if kernel else 'sdpa'}, device tier={'on' if tier is not store else 'off'}")
    print("| context | method | ratio | recomputed | TTFT ms | speedup vs full | load ms | select ms | recompute ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length, label, ratio, r, speedup in rows:
        print(f"| {length} | {label} | {ratio:g} | {r['recomputed']:.2f} | {1e3 * r['ttft']:.1f} | {speedup:.2f}× | "
              f"{1e3 * r['load']:.1f} | {1e3 * r['select']:.1f} | {1e3 * r['recompute']:.1f} |")
    if args.json:
        today = datetime.date.today().isoformat()
        records = [{"context": length, "ratio": ratio, "method": label, "ttft_s": r["ttft"], "load_s": r["load"],
                    "select_s": r["select"], "recompute_s": r["recompute"], "recomputed": r["recomputed"],
                    "speedup_vs_full": speedup, "tier": args.tier, "date": today}
                   for length, label, ratio, r, speedup in rows]
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print("\nmedian TTFT over lengths: " + ", ".join(
        f"{label}@{ratio:g}: {statistics.median(s for _, l, rr, _, s in rows if l == label and rr == ratio):.2f}×"
        for label, ratio in dict.fromkeys((l, rr) for _, l, rr, _, _ in rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
