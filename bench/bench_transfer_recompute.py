"""Cross-model KV transfer repaired by CacheClip's recompute, on the real pair (issue 51): Qwen2.5-Coder-1.5B
answers RULER from chunk caches mapped from the 0.5B's (the 1.5B prefills no chunk), with the default selection
recomputing a share r of the chunk rows at their true positions before it answers.

The use: a store filled for the 0.5B, and the 1.5B brought in (an escalation, an upgraded primary). Each sample's
chunks are ingested by the 0.5B (the source held them already: not counted), mapped into 1.5B entries
(`migrate`, a ridge map per 1.5B layer from every 0.5B layer by default: the best map measured so far), and the
1.5B then runs the evaluation harness's variants over them: `full` (its own prefill of everything: the reference),
`shared_prefix` (the mapped caches as they are: transfer alone) and `cacheclip_requery` (the default selection)
at each ratio. Scores, teacher-forced KL along full's answer and TTFT come from the harness, paired by sample;
retention is score over full's. The saving is full's TTFT over (mapping the request's chunks + the method's TTFT).

    python bench/bench_transfer_recompute.py [--samples 5] [--length 2048] [--ratios 0.1,0.2,0.3] [--top-k 24]

Resumable: the mapper is saved once under the user cache, calibration texts' KV are kept on disk, each sample
is appended to the run folder's records (the harness's), each sample's mapping time to `transfer.jsonl` there.
The store is its own (`--store`): it must never hold the 1.5B's own entries of these chunks. Writes
`bench/results/transfer_qwen.json` rows (mapper `top24+recompute@r`) and the run folder's report and plots.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_transfer import calibration_texts  # noqa: E402
from bench_transfer_qwen import kv_on_disk, mapper_label, write_rows  # noqa: E402

from cacheclip_rag.config import EngineConfig, default_cache_dir  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation import report, ruler, runner  # noqa: E402
from cacheclip_rag.evaluation.profiles import Profile  # noqa: E402
from cacheclip_rag.stages.load.ingest import precompute  # noqa: E402
from cacheclip_rag.models.loading import LoadedModel, load_model  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.transfer import Mapper, TransferConfig, calibrate, migrate  # noqa: E402
from cacheclip_rag.transfer import mapper as mapper_module  # noqa: E402

VARIANTS = ("full", "shared_prefix", "cacheclip_requery")
MAPPED = "cacheclip_requery"


def trained_mapper(source: LoadedModel, target: LoadedModel, config: TransferConfig, texts: int, tokens: int,
                   folder: Path) -> Mapper:
    """The saved mapper of this pair and config, or a new one calibrated on `texts` texts and saved."""
    path = folder / f"{source.fingerprint.digest[:12]}-{target.fingerprint.digest[:12]}-{mapper_label(config)}-t{texts}"
    if path.with_suffix(".json").exists():
        return Mapper.load(path, source, target, force=True)
    mapper_module.text_kv = kv_on_disk(mapper_module.text_kv, folder / "text_kv")
    mapper = calibrate(source, target, calibration_texts(texts, tokens), config)
    folder.mkdir(parents=True, exist_ok=True)
    mapper.save(path)
    return mapper


def transferring(source: LoadedModel, mapper: Mapper, log: Path):
    """The harness's `prepare`: the source ingests the sample's chunks, which are then mapped into the
    target's entries; the mapping time is logged per sample."""
    def prepare(view: Engine, sample: ruler.Sample, chunks: list[str]) -> None:
        src = copy.copy(source)
        src.prompt = view.primary.prompt  # RULER's layout, as the target's view reads it
        system = view.config.system_prompt
        started = time.perf_counter()
        precompute(src, view.store, chunks, system, progress=False)
        ingested = time.perf_counter()
        moved = migrate(view.store, src, view.primary, mapper, chunks, system, force=True, progress=False)
        mapped = time.perf_counter()
        if moved.missing:
            raise RuntimeError(f"{moved.missing} chunks of {sample.task}/{sample.seed} have no source entry")
        row = {"task": sample.task, "length": sample.target_tokens, "seed": sample.seed, "chunks": len(chunks),
               "moved": moved.moved, "already_present": moved.already_present,
               "source_ingest_s": ingested - started, "map_s": mapped - ingested}
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")
    return prepare


def map_times(log: Path) -> dict[tuple[str, int, int], float]:
    """Per sample, the mapping time of its first attempt that moved every chunk (a resumed sample may
    find its entries moved already: its first full move is its cost)."""
    times: dict[tuple[str, int, int], float] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (r["task"], r["length"], r["seed"])
            if r["moved"] == r["chunks"] and key not in times:
                times[key] = r["map_s"]
    return times


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=5, help="per RULER task (8 tasks)")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--ratios", default="0.1,0.2,0.3")
    p.add_argument("--top-k", type=int, default=24, help="source layers per target layer (24: every 0.5B layer)")
    p.add_argument("--texts", type=int, default=200)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "bench" / "eval-transfer-qwen"))
    p.add_argument("--store", default=str(default_cache_dir() / "transfer-store"))
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "transfer_qwen.json"))
    args = p.parse_args()
    ratios = tuple(float(r) for r in args.ratios.split(","))
    small, large = load_model("qwen2.5-coder-0.5b"), load_model("qwen2.5-coder-1.5b")
    config = TransferConfig(top_k=args.top_k)
    mapper = trained_mapper(small, large, config, args.texts, args.tokens, default_cache_dir() / "mappers")
    store = LMDBStore(args.store)
    engine = Engine(primary=large, aux=None, store=store, config=EngineConfig(store_path=args.store, aux=None))
    profile = Profile("transfer", lengths=(args.length,), tasks=ruler.TASKS, samples=args.samples, ratios=ratios,
                      variants=VARIANTS, alignment_lengths=(), alignment_samples=0)
    out = Path(args.out)
    log = out / "transfer.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    label = mapper_label(config)
    identity = {"transfer_from": small.name, "source_weights": small.fingerprint.digest,
                "mapper": f"{label}, {args.texts} texts"}
    records = runner.run(engine, profile, out_dir=out, prepare=transferring(small, mapper, log), identity=identity)
    v = mapper.validation
    meta = {"date": datetime.date.today().isoformat(), "command": "python bench/bench_transfer_recompute.py " +
            " ".join(sys.argv[1:]), "models": f"target {large.name}, chunk caches mapped from {small.name}",
            "mapper": f"{label} ridge on {args.texts} texts: held-out R² keys {statistics.fmean(v['key_r2']):.3f}, "
                      f"values {statistics.fmean(v['value_r2']):.3f}"}
    paths = report.write(out, records, alignment=[], maps={}, meta=meta, headline_ratio=0.2)
    quality = json.loads(paths[f"quality_{args.length}"].read_text())
    mapping = map_times(log)
    rows, samples = [], {}
    full = {(r.task, r.length, r.seed): r for r in records if r.variant == "full"}
    reprefill = next(m for m in quality["methods"] if m["method"] == "full")["score"]["mean"]
    direction = f"{small.name}->{large.name}"
    for entry in quality["methods"]:
        if entry["method"] not in ("shared_prefix", MAPPED):
            continue
        ratio = entry["ratio"]
        mine = [r for r in records if r.variant == entry["method"] and r.ratio == ratio]
        paired = [(full[(r.task, r.length, r.seed)], r) for r in mine if (r.task, r.length, r.seed) in mapping]
        name = f"{label}+recompute@{ratio:g}" if ratio else f"{label}+store"
        rows.append({"source": small.name, "target": large.name, "mapper": name,
                     "r2_keys": statistics.fmean(v["key_r2"]), "r2_values": statistics.fmean(v["value_r2"]),
                     "gate": "pass" if mapper.passes_gate else "refused",
                     "tf_kl": entry["tf_kl"]["mean"], "niah_transfer": entry["score"]["mean"],
                     "niah_reprefill": reprefill,
                     "retention": entry["retention"]["mean"], "recompute_share": entry["recompute_share"],
                     "speedup": statistics.fmean(f.ttft_s for f, _ in paired) /
                     statistics.fmean(mapping[(r.task, r.length, r.seed)] + r.ttft_s for _, r in paired),
                     "n": entry["n"], "length": args.length, "date": datetime.date.today().isoformat(),
                     "retention_ci": [entry["retention"]["low"], entry["retention"]["high"]],
                     "tf_kl_ci": [entry["tf_kl"]["low"], entry["tf_kl"]["high"]]})
        samples[f"{direction} {name}"] = [{"direction": direction, "mapper": name, "task": r.task, "seed": r.seed,
                                            "score": r.score, "full_score": f.score, "tf_kl": r.tf_kl,
                                            "ttft_s": r.ttft_s, "full_ttft_s": f.ttft_s,
                                            "map_s": mapping[(r.task, r.length, r.seed)]} for f, r in paired]
    for r in rows:
        print(f"{r['mapper']}: retention {r['retention']:.2f} {[round(x, 2) for x in r['retention_ci']]}, "
              f"KL {r['tf_kl']:.3f}, speed-up {r['speedup']:.1f}x, n = {r['n']}")
    write_rows(Path(args.json), rows, samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
