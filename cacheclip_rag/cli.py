"""Command line: `cacheclip demo | ingest | query | inspect | eval`.

Environment variables are read here only (CACHECLIP_CACHE moves the model cache and default store).
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.resources import files
from pathlib import Path

from .chunking import split_sections
from .config import METHODS, EngineConfig, RequestOptions
from .engine import Engine
from .store import LMDBStore

DEMO_QUESTIONS = (
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What is the name of the archive server that releases the data?", "Gull"),
    ("In which year did the Lantern programme announce its first confirmed planet?", "2016"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
)


def demo_chunks() -> list[str]:
    text = files("cacheclip_rag").joinpath("data/observatory_handbook.md").read_text(encoding="utf-8")
    return split_sections(text)


def _config(args: argparse.Namespace) -> EngineConfig:
    overrides = {"primary": args.primary, "aux": args.aux, "device": args.device, "aux_device": args.aux_device}
    if args.store:
        overrides["store_path"] = Path(args.store)
    return EngineConfig(**overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    engine = Engine.from_config(_config(args))
    chunks = demo_chunks()
    print(f"primary={engine.primary.name} aux={engine.aux.name if engine.aux else None} "
          f"chunks={len(chunks)} store={engine.store.path}")
    engine.ingest(chunks)
    methods = args.methods.split(",")
    engine.generate(DEMO_QUESTIONS[0][0], chunks, RequestOptions(method="full", max_new_tokens=1))  # warm-up
    header = f"{'method':<14} {'ratio':>5} {'recomp%':>7} {'TTFT s':>7} {'speedup':>7}  answer"
    for question, expected in DEMO_QUESTIONS[: args.questions]:
        print(f"\nQ: {question}   (expected: {expected})\n{header}")
        full_ttft = None
        for method in methods:
            options = RequestOptions(method=method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
            answer = engine.generate(question, chunks, options)
            ttft = answer.timings.ttft_s
            full_ttft = ttft if method == "full" else full_ttft
            speedup = f"{full_ttft / ttft:6.2f}x" if full_ttft else "    n/a"
            mark = "+" if expected.lower() in answer.text.lower() else "-"
            print(f"{method:<14} {args.ratio:>5.2f} {100 * answer.recompute_fraction:>6.1f}% {ttft:>7.3f} {speedup:>7}  "
                  f"{mark} {answer.text.strip()[:70]!r}")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    engine = Engine.from_config(_config(args))
    chunks: list[str] = []
    for path in map(Path, args.paths):
        for file in sorted(path.rglob("*") if path.is_dir() else [path]):
            if file.suffix in {".md", ".txt"}:
                text = file.read_text(encoding="utf-8")
                chunks.extend(split_sections(text) or [text])
    engine.ingest(chunks)
    print(f"ingested {len(chunks)} chunks into {engine.store.path}")
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    engine = Engine.from_config(_config(args))
    chunks = [Path(p).read_text(encoding="utf-8") for p in args.chunk_files] if args.chunk_files else demo_chunks()
    stream = engine.stream(args.question, chunks, RequestOptions(method=args.method, ratio=args.ratio,
                                                                  max_new_tokens=args.max_new_tokens))
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    assert stream.answer is not None
    print({k: round(v, 4) for k, v in stream.answer.timings.as_dict().items()}, file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.store) if args.store else EngineConfig().store_path
    with LMDBStore(path, readonly=True) as store:
        stats = store.stats()
    print(f"store   {stats['path']}\nentries {stats['entries']}\nbytes   {stats['bytes']:,}")
    for model, count in stats["models"].items():
        print(f"model   {model}: {count} entries")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import datetime
    import os
    import platform
    from dataclasses import replace

    import torch

    from .evaluation import report, runner
    from .models import cache_dir

    profile = runner.PROFILES[args.profile]
    if args.tasks:
        profile = replace(profile, tasks=tuple(args.tasks.split(",")))
    if args.lengths:
        profile = replace(profile, lengths=tuple(int(x) for x in args.lengths.split(",")))
    config = _config(args)
    if not args.store:
        config = replace(config, store_path=cache_dir() / "eval-store")
    engine = Engine.from_config(config)
    records = runner.run(engine, profile, seed=args.seed)
    alignment, maps = runner.alignment_study(engine, profile.alignment_lengths, seed=args.seed) if engine.aux else ([], {})
    meta = {
        "date": datetime.date.today().isoformat(), "command": "cacheclip " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, device {config.device}",
        "models": f"primary {engine.primary.name}, aux {engine.aux.name if engine.aux else None}",
        "profile": f"{profile.name}: lengths {profile.lengths}, {len(profile.tasks)} tasks x {profile.samples} samples, "
                   f"ratios {profile.ratios}, greedy, {profile.max_new_tokens} new tokens, answer primed",
    }
    paths = report.write(Path(args.out), records, alignment, maps, meta, profile.headline_ratio)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheclip", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    def with_models(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--primary", default=EngineConfig.primary)
        sp.add_argument("--aux", default=EngineConfig.aux)
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--aux-device", default="cpu")
        sp.add_argument("--store", default=None, help="LMDB directory (default: user cache)")
        return sp

    demo = with_models(sub.add_parser("demo", help="ingest the bundled handbook and compare methods"))
    demo.add_argument("--methods", default=",".join(METHODS))
    demo.add_argument("--ratio", type=float, default=0.2)
    demo.add_argument("--questions", type=int, default=len(DEMO_QUESTIONS))
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(func=cmd_demo)

    ingest = with_models(sub.add_parser("ingest", help="precompute KV for files or folders (.md/.txt)"))
    ingest.add_argument("paths", nargs="+")
    ingest.set_defaults(func=cmd_ingest)

    query = with_models(sub.add_parser("query", help="answer a question over chunk files (default: the handbook)"))
    query.add_argument("question")
    query.add_argument("--chunk-files", nargs="*")
    query.add_argument("--method", default="cacheclip", choices=METHODS)
    query.add_argument("--ratio", type=float, default=0.2)
    query.add_argument("--max-new-tokens", type=int, default=32)
    query.set_defaults(func=cmd_query)

    evaluate = with_models(sub.add_parser("eval", help="RULER retrieval, fidelity and alignment evaluation"))
    evaluate.add_argument("--profile", default="quick", choices=("quick", "full"))
    evaluate.add_argument("--tasks", default=None, help="comma-separated subset of the RULER tasks")
    evaluate.add_argument("--lengths", default=None, help="comma-separated context lengths in tokens")
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--out", default="eval-results")
    evaluate.set_defaults(func=cmd_eval)

    inspect = sub.add_parser("inspect", help="store statistics: entries, bytes, models")
    inspect.add_argument("--store", default=None)
    inspect.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
