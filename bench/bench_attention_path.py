"""Attention of many rows on the CPU: this project's `positioned_attention` kernel against torch's paths (the
flash path for a causal prefill, sdpa by blocks of rows under the position mask for recompute rows), in the
default model's whole forward: `full`'s prefill, and CacheClip's recompute forward (0.2 of the prompt's rows at
scattered positions, then the question's 24, over a cache holding the prompt). Issue 70: on CPUs with AMX tiles
torch's paths run their block products on AMX; `cpu_kernels.torch_attention_is_faster` picks them there. The
two alternate, median of `--repeats`. (`attention_path_causal_only.json`: the first run, prefill only.)

    python bench/bench_attention_path.py --lengths 2048,4096 --repeats 3 --json bench/results/attention_path.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import recompute_rows  # noqa: E402
from cacheclip_rag.models import cpu_kernels  # noqa: E402
from cacheclip_rag.models.loading import load_model  # noqa: E402
from cacheclip_rag.stages.load.ingest import new_cache  # noqa: E402
from cacheclip_rag.stages.recompute.forward import forward_at  # noqa: E402

PATHS = {"kernel": lambda: False, "torch": lambda: True}


def prefill_s(lm, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = new_cache(lm, ids.shape[1])
    start = time.perf_counter()
    logits = forward_at(lm.model, cache, ids, torch.arange(ids.shape[1])[None])[0, -1]
    return time.perf_counter() - start, logits.float()


def recompute_s(lm, ids: torch.Tensor, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = new_cache(lm, ids.shape[1])
    forward_at(lm.model, cache, ids, torch.arange(ids.shape[1])[None])  # the loaded caches' stand-in
    start = time.perf_counter()
    logits = forward_at(lm.model, cache, ids[:, rows], rows[None])[0, -1]
    return time.perf_counter() - start, logits.float()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm = load_model(args.model, dtype="auto")
    chosen = cpu_kernels.torch_attention_is_faster()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(1000, 100_000, (1, length), generator=torch.Generator().manual_seed(length))
        rows_picked = recompute_rows(length, torch.Generator().manual_seed(1))
        forwards = {"full prefill": lambda: prefill_s(lm, ids), "recompute rows": lambda: recompute_s(lm, ids, rows_picked)}
        for forward, run in forwards.items():
            times: dict[str, list[float]] = {name: [] for name in PATHS}
            logits = {}
            for r in range(args.repeats + 1):  # the first round warms both paths and is not counted
                for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
                    cpu_kernels.torch_attention_is_faster = PATHS[name]
                    seconds, logits[name] = run()
                    if r:
                        times[name].append(seconds)
            gap = float((logits["kernel"] - logits["torch"]).abs().max() / logits["torch"].abs().max())
            row = {"forward": forward, "tokens": length, **{f"{n}_s": statistics.median(t) for n, t in times.items()},
                   "runs": times,
                   "speedup_torch_over_kernel": statistics.median(times["kernel"]) / statistics.median(times["torch"]),
                   "logits_max_gap_share": gap, "argmax_equal": bool(logits["kernel"].argmax() == logits["torch"].argmax()),
                   "amx": chosen, "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
                   "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}
            rows.append(row)
            print(f"{forward} ~{length}: kernel {row['kernel_s']:.2f} s, torch {row['torch_s']:.2f} s "
                  f"({row['speedup_torch_over_kernel']:.2f}x); logits gap {gap:.4f} of max, same argmax "
                  f"{row['argmax_equal']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
