"""Does the small model attend where the large one does? Last-token attention projected onto
characters, over many prose samples: each aux's last layer, the primary's first layer and its first
global (full-attention) layer, each against the primary's last layer; means with bootstrap 95%
intervals. The primary is read once per sample for all auxes. Usage:
    python bench/bench_alignment.py [--primary gemma3-270m] [--aux smollm2-135m[,qwen2.5-coder-0.5b]]
        [--lengths 1024,2048] [--samples 50] [--json bench/results/alignment.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from cacheclip_rag.config import EngineConfig
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation.runner import alignment_study
from cacheclip_rag.evaluation.stats import bootstrap_ci
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.store import LMDBStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--primary", default="gemma3-270m")
    ap.add_argument("--aux", default="smollm2-135m", help="comma-separated embedded names; the first is the engine's")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    auxes = args.aux.split(",")
    path = tempfile.mkdtemp()
    engine = Engine(primary=load_model(args.primary), aux=load_model(auxes[0]), store=LMDBStore(path),
                    config=EngineConfig(store_path=path))
    others = {name: load_model(name) for name in auxes[1:]}
    rows, _ = alignment_study(engine, [int(x) for x in args.lengths.split(",")], seed=3000, samples=args.samples,
                              progress=True, other_auxes=others)
    groups: dict[tuple[int, str], list] = {}
    for r in rows:
        pair = r.pair.replace("aux_last", f"{auxes[0]}_last") if r.pair.startswith("aux_last") else r.pair
        groups.setdefault((r.length, pair), []).append(r)
    print(f"primary {args.primary}, auxes {', '.join(auxes)}; RULER prose (single2) samples, seeds 3000+; "
          "reference: primary last layer; mean [bootstrap 95% CI]")
    print("| length | pair | n | Jaccard top-20% | KL | Pearson | Spearman |")
    print("|---|---|---|---|---|---|---|")
    for (length, pair), group in groups.items():
        cells = []
        for metric in ("jaccard", "kl", "pearson", "spearman"):
            e = bootstrap_ci([getattr(r, metric) for r in group])
            cells.append(f"{e.mean:.3f} [{e.low:.3f}, {e.high:.3f}]")
        print(f"| {length} | {pair} | {len(group)} | " + " | ".join(cells) + " |")
    if args.json:
        meta = {"primary": args.primary, "auxes": auxes, "seed": 3000}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
