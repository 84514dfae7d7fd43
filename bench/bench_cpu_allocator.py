"""What glibc's allocator setting (`models/cpu_allocator.keep_freed_memory`, applied by `load_model` on the CPU)
does to time to first token: the same requests with it and with glibc's defaults, in alternating processes (the
setting is process-wide), `full` and the default method, the anchors' fresh-order workload at ~2K and ~4K.

Each process loads the engine on the default models and store (the anchors' chunk pool is ingested once, by the
first), warms up, then runs every request of each cell once (greedy, one token: the time to it is the prefill).
Per cell: p50 TTFT of each setting with a bootstrap 95% interval, their ratio (paired over the same requests), and
the answers' first tokens, which must agree between the settings (an allocator changes no arithmetic).

    python bench/bench_cpu_allocator.py [--rounds 2] [--requests 8] [--json bench/results/cpu_allocator.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "anchors"))

SETTINGS = ("glibc", "kept")
METHODS = ("full", "cacheclip")
PROMPTS = ("2k", "4k")


def one_process(setting: str, requests: int) -> list[dict]:
    """Rows of one process under `setting`: every (prompt, method, request) once."""
    from anchor_workload import requests_for
    from bench_serve import corpus

    import cacheclip_rag.models.loading as loading
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine import Engine

    if setting == "glibc":
        loading.keep_freed_memory = lambda: {}  # glibc's defaults: the setting skipped
    engine = Engine.from_config(EngineConfig())
    pool = corpus(42, 1200)
    engine.ingest(pool, progress=False)
    rows = []
    for prompt in PROMPTS:
        cell = requests_for("fresh", prompt, 1, requests, pool)
        for method in METHODS:
            options = RequestOptions(method=method, max_new_tokens=1)
            engine.generate(cell[0][1], cell[0][0], options)  # warm this shape
            for index, (chunks, question) in enumerate(cell):
                answer = engine.generate(question, chunks, options)
                rows.append({"setting": setting, "prompt": prompt, "method": method, "request": index,
                             "ttft_s": answer.timings.ttft_s, "first_token": answer.token_ids[:1],
                             "prompt_tokens": answer.prompt_tokens})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    import statistics

    from cacheclip_rag.evaluation.stats import median_ci, ratio_of_medians

    out = []
    for prompt in PROMPTS:
        for method in METHODS:
            cell = {s: sorted((r for r in rows if (r["setting"], r["prompt"], r["method"]) == (s, prompt, method)),
                              key=lambda r: (r["round"], r["request"])) for s in SETTINGS}
            times = {s: [r["ttft_s"] for r in cell[s]] for s in SETTINGS}
            ratio = ratio_of_medians(times["kept"], times["glibc"])
            same = sum(a["first_token"] == b["first_token"] for a, b in zip(cell["kept"], cell["glibc"]))
            out.append({"prompt": prompt, "method": method, "n": len(times["kept"]),
                        **{f"{s}_p50_s": vars(median_ci(times[s])) for s in SETTINGS},
                        "ratio_p50": vars(ratio), "same_first_token": same,
                        "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in cell["kept"])})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2, help="processes per setting, alternating")
    p.add_argument("--requests", type=int, default=8, help="requests per (prompt, method) a process")
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child, args.requests)))
        return 0
    from tqdm import tqdm

    rows = []
    runs = [(r, s) for r in range(args.rounds) for s in (SETTINGS if r % 2 == 0 else SETTINGS[::-1])]
    for round_, setting in tqdm(runs, desc="processes"):
        out = subprocess.run([sys.executable, __file__, "--child", setting, "--requests", str(args.requests)],
                             capture_output=True, text=True, check=True)
        rows += [dict(row, round=round_) for row in json.loads(out.stdout.strip().splitlines()[-1])]
    table = summary(rows)
    print("| prompt | method | n | glibc defaults p50 s [95%] | freed memory kept p50 s [95%] | kept / glibc [95%] | same first token |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        g, k, r = t["glibc_p50_s"], t["kept_p50_s"], t["ratio_p50"]
        print(f"| {t['prompt']} | {t['method']} | {t['n']} | {g['mean']:.2f} [{g['low']:.2f}, {g['high']:.2f}] | "
              f"{k['mean']:.2f} [{k['low']:.2f}, {k['high']:.2f}] | {r['mean']:.2f} [{r['low']:.2f}, {r['high']:.2f}] | "
              f"{t['same_first_token']}/{t['n']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "rounds": args.rounds,
                                               "cells": table, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
