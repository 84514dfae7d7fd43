"""`cacheclip demo`: the bundled observatory handbook, ingested, then every method on its questions."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from ..config import RequestOptions
from .args import engine_config

# the handbook's facts, one question each (the examples look them up)
DEMO_QUESTIONS = (
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What is the name of the archive server that releases the data?", "Gull"),
    ("In which year did the Lantern programme announce its first confirmed planet?", "2016"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
)

# the demo's questions: two need two chunks at once (the instrument Ekwueme added is in one, what uses it
# in another), the kind where reuse without recompute loses answers; chosen from 16 candidates measured
# with each method (bench/RESULTS.md, "The demo shows the trade-off"), misses kept in
DEMO_SET = (
    ("Which research programme uses the instrument that Tomas Ekwueme added?", "Saltmarsh"),
    ("In which town is the nearest hospital?", "Keel"),
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What frequency, in megahertz, does the instrument added by the second director observe?", "1420"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
)


def demo_chunks() -> list[str]:
    from ..stages.load.chunking import split_sections
    from ..handbook import handbook_text

    return [c for c in split_sections(handbook_text()) if c.startswith("## ")]  # the handbook's preamble is its title alone


@dataclass
class Tally:
    """One method's results over the questions."""

    right: int = 0
    ttfts: list[float] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)  # top-1 agreement with full along full's answer


def run(args: argparse.Namespace) -> int:
    from ..engine.core import Engine
    from ..evaluation.fidelity import teacher_forced_fidelity

    engine = Engine.from_config(engine_config(args))
    chunks = demo_chunks()
    print(f"primary={engine.primary.name} aux={engine.aux.name if engine.aux else None} "
          f"chunks={len(chunks)} selection={args.selection} store={engine.store.path}")
    engine.ingest(chunks)
    methods = ["full", *(m for m in args.methods.split(",") if m != "full")]  # full first: the others follow it
    engine.generate(DEMO_SET[0][0], chunks, RequestOptions(method="full", max_new_tokens=1))  # warm-up
    header = f"{'method':<14} {'recomp%':>7} {'TTFT s':>7} {'speedup':>7} {'agree':>6}  answer"
    tallies = {m: Tally() for m in methods}
    for question, expected in DEMO_SET[: args.questions]:
        print(f"\nQ: {question}   (the handbook: {expected})\n{header}")
        full_rows = full_tokens = None
        for method in methods:
            options = RequestOptions(method=method, ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                                     selection=args.selection)
            started = time.perf_counter()
            plan = engine.plan(question, chunks, options)
            prefill = engine.prefill(plan, options)
            stream = engine.decode(plan, prefill, options, started)
            text = "".join(stream)
            answer = stream.answer
            if full_tokens is None:  # full: the reference every method is read against
                full_tokens = list(answer.token_ids) or [min(engine.primary.eos_token_ids)]
                full_rows = engine.teacher_forced_logits(plan, prefill, full_tokens)
            rows = engine.teacher_forced_logits(plan, prefill, full_tokens)
            _, agree = teacher_forced_fidelity(full_rows, rows, full_tokens)
            tally = tallies[method]
            mark = "+" if expected.lower() in text.lower() else "-"
            tally.right += mark == "+"
            tally.ttfts.append(answer.timings.ttft_s)
            tally.agreement.append(agree)
            speedup = tallies["full"].ttfts[-1] / answer.timings.ttft_s
            print(f"{method:<14} {100 * answer.recompute_fraction:>6.1f}% {answer.timings.ttft_s:>7.3f} {speedup:>6.2f}x "
                  f"{100 * agree:>5.0f}%  {mark} {text.strip()[:60]!r}")
    print(summary(tallies, args.ratio))
    return 0


def summary(tallies: dict[str, Tally], ratio: float) -> str:
    """Per method: right answers, median time to first token, its speed-up over `full`'s median, and the
    mean share of `full`'s answer tokens the method would have produced itself (teacher-forced top-1)."""
    asked = len(tallies["full"].ttfts)
    medians = {m: statistics.median(t.ttfts) for m, t in tallies.items()}
    lines = [f"\nSummary over {asked} questions at ratio {ratio} (+ = the handbook's answer is in the output; "
             "agree = full's answer tokens the method ranks first, read along full's answer)",
             f"{'method':<14} {'right':>5} {'median TTFT s':>13} {'speedup':>7} {'agree':>6}"]
    for method, tally in tallies.items():
        lines.append(f"{method:<14} {tally.right:>2}/{asked:<2} {medians[method]:>13.3f} "
                     f"{medians['full'] / medians[method]:>6.2f}x {100 * statistics.fmean(tally.agreement):>5.0f}%")
    return "\n".join(lines)
