"""`cacheclip demo`: the bundled observatory handbook, ingested, then every method on its questions."""

from __future__ import annotations

import argparse
from importlib.resources import files

from ..config import RequestOptions
from .args import engine_config

DEMO_QUESTIONS = (
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What is the name of the archive server that releases the data?", "Gull"),
    ("In which year did the Lantern programme announce its first confirmed planet?", "2016"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
)


def demo_chunks() -> list[str]:
    from ..chunking import split_sections

    text = files("cacheclip_rag").joinpath("data/observatory_handbook.md").read_text(encoding="utf-8")
    return [c for c in split_sections(text) if c.startswith("## ")]  # the handbook's preamble is its title alone


def run(args: argparse.Namespace) -> int:
    from ..engine import Engine

    engine = Engine.from_config(engine_config(args))
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


