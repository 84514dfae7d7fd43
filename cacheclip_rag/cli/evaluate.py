"""`cacheclip eval` (the RULER evaluation, resumable) and `cacheclip bench NAME` (a benchmark script of
the source checkout)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .args import engine_config


def run(args: argparse.Namespace) -> int:
    import datetime
    import os
    import platform
    from dataclasses import replace

    import torch

    from ..engine.core import Engine
    from ..evaluation import report, runner

    profile = runner.PROFILES[args.profile]
    if args.tasks:
        profile = replace(profile, tasks=tuple(args.tasks.split(",")))
    if args.lengths:
        profile = replace(profile, lengths=tuple(int(x) for x in args.lengths.split(",")))
    if args.ratios:
        profile = replace(profile, ratios=tuple(float(x) for x in args.ratios.split(",")))
    if args.variants:
        profile = replace(profile, variants=tuple(args.variants.split(",")))
    if args.samples:
        samples = tuple(int(x) for x in args.samples.split(","))
        profile = replace(profile, samples=samples[0] if len(samples) == 1 else samples)
    if args.alignment_samples is not None:
        profile = replace(profile, alignment_samples=args.alignment_samples)
    if args.alignment_lengths:
        profile = replace(profile, alignment_lengths=tuple(int(x) for x in args.alignment_lengths.split(",")))
    config = engine_config(args)
    if not args.store:
        config = replace(config, store_path=Path(config.cache_dir) / "eval-store")
    for length in profile.lengths:
        profile.samples_at(length)  # one count per length, checked before the models load
    unknown = [v for v in profile.variants if v not in runner.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(runner.VARIANTS)}")
    if args.limit_minutes is not None and not args.limit_minutes >= 0:
        raise SystemExit(f"--limit-minutes must be >= 0 (0 runs one sample), got {args.limit_minutes}")
    out = Path(args.out)
    merged = []  # other run folders' samples, read (and checked) before any model loads
    for folder in args.merge or ():
        done = runner.load_records(Path(folder))
        if not done:
            raise SystemExit(f"--merge {folder}: no finished samples there")
        merged.append((folder, [r for rows in done.values() for r in rows]))
    if args.report_only:  # the report of what the run folder holds, no model loaded
        done = runner.load_records(out)
        records = [r for job in runner.jobs_of(profile, args.seed) if job in done for r in done[job]]
        if not records:
            raise SystemExit(f"{out} holds no finished samples of this profile")
        engine = None
    else:
        engine = Engine.from_config(config)
        limit = None if args.limit_minutes is None else args.limit_minutes * 60  # 0: one sample, not no limit
        records = runner.run(engine, profile, seed=args.seed, out_dir=out, limit_s=limit, format=args.format)
    if not records:
        print(f"no sample finished within the time limit; rerun the same command to resume {out}")
        return 0
    alignment, maps = [], {}
    if engine is not None and engine.aux and profile.alignment_lengths and profile.alignment_samples:
        alignment, maps = runner.alignment_study(engine, profile.alignment_lengths, seed=args.seed,
                                                 samples=profile.alignment_samples, progress=True)
    meta = {
        "date": datetime.date.today().isoformat(), "command": "cacheclip " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, device {config.device}",
        "models": f"primary {config.primary}, aux {config.aux}",
        "profile": f"{profile.name}: lengths {profile.lengths}, {len(profile.tasks)} tasks x {profile.samples} samples "
                   f"per length, ratios {profile.ratios}, greedy, RULER wording, {records[0].format} layout; decode budget per sample fits its "
                   f"references (+8 tokens), ending once every reference is out",
        "samples done": f"{len({(r.task, r.length, r.seed) for r in records})} of {len(runner.jobs_of(profile, args.seed))}",
    }
    if merged:
        meta["merged"] = ", ".join(f"{folder} ({len(rows)} rows)" for folder, rows in merged) + \
            ": same samples, their shared rows checked equal"
        records = runner.merge_runs([(str(out), records), *merged])
    paths = report.write(out, records, alignment=alignment, maps=maps, meta=meta, headline_ratio=profile.headline_ratio)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run `bench/bench_<name>.py` of the source checkout with the remaining arguments."""
    import runpy

    script = Path(__file__).resolve().parents[2] / "bench" / f"bench_{args.name}.py"
    if not script.exists():
        raise SystemExit(f"no benchmark {script}: benchmarks live in the source checkout's bench/ folder")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


