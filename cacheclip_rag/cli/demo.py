"""`cacheclip demo`: the bundled observatory handbook, ingested, then every method on its questions."""

from __future__ import annotations

import argparse
import statistics
from importlib.resources import files

from ..config import RequestOptions
from .args import engine_config, requery_of

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
          f"chunks={len(chunks)} selection={args.selection} store={engine.store.path}")
    engine.ingest(chunks)
    methods = args.methods.split(",")
    engine.generate(DEMO_QUESTIONS[0][0], chunks, RequestOptions(method="full", max_new_tokens=1))  # warm-up
    header = f"{'method':<14} {'ratio':>5} {'recomp%':>7} {'TTFT s':>7} {'speedup':>7}  answer"
    right: dict[str, int] = dict.fromkeys(methods, 0)
    ttfts: dict[str, list[float]] = {m: [] for m in methods}
    for question, expected in DEMO_QUESTIONS[: args.questions]:
        print(f"\nQ: {question}   (expected: {expected})\n{header}")
        full_ttft = None
        for method in methods:
            options = RequestOptions(method=method, ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                                     requery=requery_of(args))
            answer = engine.generate(question, chunks, options)
            ttft = answer.timings.ttft_s
            full_ttft = ttft if method == "full" else full_ttft
            speedup = f"{full_ttft / ttft:6.2f}x" if full_ttft else "    n/a"
            mark = "+" if expected.lower() in answer.text.lower() else "-"
            right[method] += mark == "+"
            ttfts[method].append(ttft)
            print(f"{method:<14} {args.ratio:>5.2f} {100 * answer.recompute_fraction:>6.1f}% {ttft:>7.3f} {speedup:>7}  "
                  f"{mark} {answer.text.strip()[:70]!r}")
    print(summary(right, ttfts))
    return 0


def summary(right: dict[str, int], ttfts: dict[str, list[float]]) -> str:
    """Per method: right answers, median time to first token, and its speed-up over `full`'s median."""
    asked = len(next(iter(ttfts.values())))
    medians = {m: statistics.median(t) for m, t in ttfts.items()}
    lines = [f"\nSummary over {asked} questions (+ = the expected answer is in the output)",
             f"{'method':<14} {'right':>5} {'median TTFT s':>13} {'speedup':>7}"]
    for method, median in medians.items():
        speedup = f"{medians['full'] / median:6.2f}x" if "full" in medians else "    n/a"
        lines.append(f"{method:<14} {right[method]:>2}/{asked:<2} {median:>13.3f} {speedup:>7}")
    return "\n".join(lines)


