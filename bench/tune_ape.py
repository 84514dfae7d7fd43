"""Held-out tuning of APE's attention temperature and scale for the primary: first-token KL to `full`
on RULER samples no evaluation profile uses (seed 1000, one per task, 1K tokens), over a grid.
Usage: python bench/tune_ape.py [--seed 1000] (prints the grid sorted by mean KL)."""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation import ruler
from cacheclip_rag.evaluation.fidelity import first_token_kl
from cacheclip_rag.evaluation.runner import ruler_engine, token_counter
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.store import LMDBStore

TEMPERATURES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SCALES = (0.9, 0.95, 1.0, 1.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    path = tempfile.mkdtemp()
    engine = Engine(primary=load_model("gemma3-270m"), store=LMDBStore(path), aux=None,
                    config=EngineConfig(store_path=path, aux=None))
    count = token_counter(engine)
    grid = list(itertools.product(TEMPERATURES, SCALES))
    kls: dict[tuple[float, float], list[float]] = {g: [] for g in grid}
    for task in ruler.TASKS:
        sample = ruler.generate(task, args.length, args.seed, count)
        chunks = ruler.sample_chunks(sample, count)
        reader = ruler_engine(engine, sample)
        reader.ingest(chunks, progress=False)
        base = dict(max_new_tokens=1, answer_prefix=sample.answer_prefix, prompt_stops=False)
        full = reader.generate(sample.question, chunks, RequestOptions(method="full", **base))
        for temperature, scale in grid:
            ape = reader.generate(sample.question, chunks, RequestOptions(
                method="ape", ape_temperature=temperature, ape_scale=scale, **base))
            kls[temperature, scale].append(first_token_kl(full.first_logits, ape.first_logits))
    print(f"APE on Gemma 3 270M, {len(ruler.TASKS)} held-out RULER samples at {args.length} tokens (seed {args.seed}): "
          "first-token KL(full || ape), mean and per sample")
    print("| temperature | scale | mean KL | per sample |")
    print("|---|---|---|---|")
    for g in sorted(grid, key=lambda g: statistics.mean(kls[g])):
        print(f"| {g[0]} | {g[1]} | {statistics.mean(kls[g]):.3f} | {' '.join(f'{x:.2f}' for x in kls[g])} |")


if __name__ == "__main__":
    main()
