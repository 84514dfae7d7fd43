"""A causal prefill's attention on the CPU: this project's `positioned_attention` kernel against torch's flash
path, in the whole `full` prefill of the default model (issue 70: on CPUs with AMX tiles torch's path runs its
block products on AMX; `cpu_kernels.torch_causal_is_faster` picks it there). The two alternate, median of
`--repeats`.

    python bench/bench_causal_path.py --lengths 2048,4096 --repeats 3 --json bench/results/causal_path.json
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    lm = load_model(args.model, dtype="auto")
    chosen = cpu_kernels.torch_causal_is_faster()
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(1000, 100_000, (1, length), generator=torch.Generator().manual_seed(length))
        times: dict[str, list[float]] = {name: [] for name in PATHS}
        logits = {}
        for r in range(args.repeats + 1):  # the first round warms both paths and is not counted
            for name in (list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]):
                cpu_kernels.torch_causal_is_faster = PATHS[name]
                seconds, logits[name] = prefill_s(lm, ids)
                if r:
                    times[name].append(seconds)
        gap = float((logits["kernel"] - logits["torch"]).abs().max() / logits["torch"].abs().max())
        row = {"tokens": length, **{f"{n}_s": statistics.median(t) for n, t in times.items()},
               "runs": times, "speedup_torch_over_kernel": statistics.median(times["kernel"]) / statistics.median(times["torch"]),
               "logits_max_gap_share": gap, "argmax_equal": bool(logits["kernel"].argmax() == logits["torch"].argmax()),
               "amx": chosen, "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
               "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}
        rows.append(row)
        print(f"~{length}: kernel {row['kernel_s']:.2f} s, torch {row['torch_s']:.2f} s "
              f"({row['speedup_torch_over_kernel']:.2f}x); logits gap {gap:.4f} of max, same argmax {row['argmax_equal']}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
