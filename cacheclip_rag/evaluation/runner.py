"""The evaluation run: methods x ratios x lengths x tasks on RULER samples, in one engine.

Every sample is ingested once (its chunk KV for the primary and for the aux) and answered by `full`
first: its greedy answer is the reference for fidelity. Every other variant and ratio then runs over
the same stored caches, and from each one prefill come
- the RULER score of its own greedy answer (decoded to a budget that fits every reference; decoding
  ends early once every reference is in the output, which cannot change the score);
- teacher-forced fidelity along `full`'s answer: mean per-step KL(full || method) and top-1
  agreement, plus first-token KL;
- the log-likelihood of the gold answer, and its difference to `full`'s.
Prompts use RULER's own wording; the layout is RULER's raw one with its task preamble as the shared prefix
(`format="ruler"`), or the deployed one (`format="deployed"`): the engine's chat template, the chunks ingested
behind its generic system prompt before any question, no answer priming, as `Engine.generate`, the server
and the frameworks ask. A preamble that says what will be asked primes every chunk's cache and flatters reuse.

A run is resumable: each finished sample's records are appended as one JSON line to
`records.jsonl` in the run's folder, and a rerun skips the samples found there.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path

from tqdm.auto import tqdm

from ..config import RequestOptions
from ..engine.core import Engine
from ..models.loading import PromptFormat, layer_types
from . import ruler
from .fidelity import first_token_kl, sequence_log_likelihood, teacher_forced_fidelity
from .records import Record, token_counter


def decode_budget(engine: Engine, sample: ruler.Sample, margin: int = 8) -> int:
    """New tokens that fit every reference of the sample written out in the answer model's tokens,
    plus a margin: a budget that cuts the answer off would score truncation, not retrieval (Gemma
    writes one digit per token: a UUID is 37 tokens, four 7-digit values 36)."""
    return len(engine.primary.encode(" " + ", ".join(sample.references))) + margin


def gold_answer(sample: ruler.Sample) -> str:
    """The reference answer as RULER's answer prefix continues: " v1, v2, v3, and v4." """
    refs = list(sample.references)
    listed = refs[0] if len(refs) == 1 else ", ".join(refs[:-1]) + ", and " + refs[-1]
    return f" {listed}."


def ruler_engine(engine: Engine, sample: ruler.Sample) -> Engine:
    """`engine` as RULER reads: the primary in RULER's raw layout with the sample's preamble as the
    shared prefix. A view over the same weights, aux and store; `engine` itself is left as it is, so
    other threads may go on using it."""
    primary = copy.copy(engine.primary)
    primary.prompt = PromptFormat.ruler()
    view = copy.copy(engine)
    view.primary = primary
    view.aux = primary if engine.aux is engine.primary else engine.aux
    view.config = replace(engine.config, system_prompt=sample.preamble or engine.config.system_prompt)
    return view


def _answer_until_complete(engine: Engine, plan, prefill, options: RequestOptions, *, references, started: float,
                           wrong: tuple[str, ...] = ()):
    """Greedy decode that ends once every reference is in the output (the score cannot change after)."""
    stream = engine.decode(plan, prefill, options, started)
    text = ""
    for piece in stream:
        text += piece
        if ruler.score(text, references, wrong) == 1.0:
            break
    return text, list(stream.token_ids), prefill.timings


# called with the sample's engine view (RULER's layout), the sample and its chunks before they are ingested:
# e.g. to put entries mapped from another model's caches in the store (a transferred store is then read as is)
Prepare = Callable[[Engine, ruler.Sample, list[str]], None]


FORMATS = ("deployed", "ruler")


def evaluate_sample(engine: Engine, sample: ruler.Sample, profile: Profile, count: Callable[[str], int],
                    prepare: Prepare | None = None, format: str = "ruler") -> list[Record]:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    chunks = ruler.sample_chunks(sample, count)
    gold = engine.primary.encode(gold_answer(sample))
    if format == "ruler":
        engine = ruler_engine(engine, sample)  # a view in RULER's layout; the caller's engine is untouched
    if prepare is not None:
        prepare(engine, sample, chunks)
    engine.ingest(chunks, progress=False, direct="direct" in profile.variants)
    budget = max(profile.max_new_tokens, decode_budget(engine, sample), len(gold))
    # RULER decodes to its budget, primed with its answer prefix: no prompt-format stop string ends an answer
    # early; deployed, an answer ends as the engine's do
    base = (dict(max_new_tokens=budget, answer_prefix=sample.answer_prefix, prompt_stops=False) if format == "ruler"
            else dict(max_new_tokens=budget))

    def measure(variant: Variant, ratio: float | None):
        options = variant.options(ratio, **base)
        started = time.perf_counter()
        plan = engine.plan(sample.question, chunks, options)
        prefill = engine.prefill(plan, options)
        text, tokens, timings = _answer_until_complete(engine, plan, prefill, options, references=sample.references,
                                                       started=started, wrong=sample.wrong)
        return plan, prefill, text, tokens, timings

    plan, full_prefill, full_text, full_tokens, full_timings = measure(VARIANTS["full"], None)
    full_rows = engine.teacher_forced_logits(plan, full_prefill, full_tokens)
    full_gold = sequence_log_likelihood(engine.teacher_forced_logits(plan, full_prefill, gold), gold)
    chunk_tokens = plan.question_start - plan.prefix_len
    records = []
    for name in ("full", *(v for v in profile.variants if v != "full")):
        variant = VARIANTS[name]
        for ratio in profile.ratios if variant.uses_ratio else (None,):
            if name == "full":
                prefill, text, timings = full_prefill, full_text, full_timings
            else:
                _, prefill, text, _, timings = measure(variant, ratio)
            rows = engine.teacher_forced_logits(plan, prefill, full_tokens)
            tf_kl, tf_top1 = teacher_forced_fidelity(full_rows, rows, full_tokens)
            gold_ll = sequence_log_likelihood(engine.teacher_forced_logits(plan, prefill, gold), gold)
            recomputed = 0 if name == "full" else prefill.recomputed_rows
            records.append(Record(
                task=sample.task, length=sample.target_tokens, seed=sample.seed, variant=name, ratio=ratio,
                prompt_tokens=plan.length, chunk_tokens=chunk_tokens, chunks=len(chunks),
                score=ruler.score(text, sample.references, sample.wrong), kl=first_token_kl(full_prefill.logits, prefill.logits),
                tf_kl=tf_kl, tf_top1=tf_top1, gold_ll=gold_ll, gold_ll_delta=gold_ll - full_gold,
                recomputed_share=1.0 if name == "full" else recomputed / max(1, chunk_tokens),
                load_s=timings.load_s, select_s=timings.select_s, recompute_s=timings.recompute_s,
                ttft_s=timings.ttft_s, output=text, references=sample.references, format=format,
            ))
    return records


RECORDS_FILE = "records.jsonl"
RUN_FILE = "run.json"


def _record_from(data: dict) -> Record:
    names = {f.name for f in fields(Record)}
    return Record(**{k: (tuple(v) if k == "references" else v) for k, v in data.items() if k in names})


def load_records(out_dir: Path, repair: bool = False) -> dict[tuple[str, int, int], list[Record]]:
    """Finished samples in `out_dir`, keyed (task, length, seed). A line cut short (by a killed run,
    or one being written now) is dropped; `repair=True` (the run about to append) also cuts it from
    the file, so later lines stay parseable. Readers of a folder a run may be writing leave it alone."""
    path = out_dir / RECORDS_FILE
    done: dict[tuple[str, int, int], list[Record]] = {}
    if not path.exists():
        return done
    good = 0
    raw = path.read_bytes()
    for line in raw.splitlines(keepends=True):
        try:
            rows = [_record_from(r) for r in json.loads(line)]
        except (ValueError, TypeError):
            break
        if not line.endswith(b"\n"):
            break
        if rows:
            done[(rows[0].task, rows[0].length, rows[0].seed)] = rows
        good += len(line)
    if repair and good < len(raw):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


RecordKey = tuple[str, int, int, str, float | None]
AGREE = ("output", "score", "prompt_tokens", "chunk_tokens", "gold_ll", "tf_kl")  # what a re-run must reproduce


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)  # thread counts reorder float sums
    return a == b


def merge_runs(runs: Sequence[tuple[str, Sequence[Record]]]) -> list[Record]:
    """Records of several run folders (named) as one set, each (sample, variant, ratio) once. A row
    that two runs both hold (the `full` reference every run decodes) must agree on its answer, score,
    token counts and likelihoods, which shows the runs read the same samples with the same models and
    code; otherwise pairing across them would be wrong, so this raises, naming the sample."""
    merged: dict[RecordKey, tuple[str, Record]] = {}
    for name, records in runs:
        for r in records:
            key = (r.task, r.length, r.seed, r.variant, r.ratio)
            if key not in merged:
                merged[key] = (name, r)
                continue
            first_name, first = merged[key]
            differ = [f for f in AGREE if not _same(getattr(first, f), getattr(r, f))]
            if differ:
                raise ValueError(f"{first_name} and {name} disagree on {r.variant} of {r.task} at {r.length} tokens "
                                 f"(seed {r.seed}) in {', '.join(differ)}: not the same samples, models or code, so "
                                 "their methods cannot be paired")
    return [r for _, r in merged.values()]


def _run_identity(engine: Engine, profile: Profile, seed: int) -> dict:
    return {"profile": asdict(profile), "seed": seed, "primary": engine.primary.name,
            "primary_weights": engine.primary.fingerprint.digest,
            "aux": engine.aux.name if engine.aux else None}


BEFORE_FORMATS = {"format": "ruler"}


def _check_run(out_dir: Path, identity: dict) -> None:
    path = out_dir / RUN_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        stored = {**BEFORE_FORMATS, **stored}  # a folder from before formats holds a RULER run
        differ = sorted(k for k in identity if stored.get(k) != json.loads(json.dumps(identity[k])))
        if differ:
            raise ValueError(f"{out_dir} holds a run with other {', '.join(differ)}; resume it with the same "
                             "settings or choose another output folder")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(identity, indent=1))


def jobs_of(profile: Profile, seed: int = 0) -> list[tuple[str, int, int]]:
    """(task, length, seed) in the order they run: length by length, and within one, sample i of every
    task before sample i+1, so a run stopped early holds every task equally at the lengths it reached."""
    return [(task, length, seed + i) for length in profile.lengths for i in range(profile.samples_at(length))
            for task in profile.tasks]


def run(engine: Engine, profile: Profile, seed: int = 0, progress: bool = True, out_dir: Path | None = None,
        limit_s: float | None = None, prepare: Prepare | None = None, identity: dict | None = None,
        format: str = "ruler") -> list[Record]:
    """Every task x length x sample of `profile`, each answered by every variant and ratio. With
    `out_dir`, finished samples are appended there as they finish and a rerun resumes; `limit_s` stops
    starting new samples after that many seconds (at least one runs; the run is resumed later).
    `prepare` runs before each sample's ingest (see `Prepare`); `identity` names what it does, so a folder
    holds one kind of run. `format`: the prompts' layout (`FORMATS`, see the module)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    unknown = [v for v in profile.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    layered = [v for v in profile.variants if VARIANTS[v].recompute_layers != "all"]
    if layered and "sliding_attention" not in layer_types(engine.primary.model):
        raise ValueError(f"variants {layered} recompute one kind of layer: {engine.primary.name} has no "
                         "sliding-window layers")
    unknown = [t for t in profile.tasks if t not in ruler.SPECS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {', '.join(ruler.SPECS)}")
    done: dict[tuple[str, int, int], list[Record]] = {}
    if out_dir is not None:
        _check_run(out_dir, {**_run_identity(engine, profile, seed), "format": format, **(identity or {})})
        done = load_records(out_dir, repair=True)
    count = token_counter(engine)
    jobs = jobs_of(profile, seed)
    started = time.monotonic()
    bar = tqdm(total=len(jobs), initial=sum(j in done for j in jobs), desc=f"RULER {profile.name}",
               disable=not progress, unit="sample")
    records: list[Record] = []
    ran = 0
    for job in jobs:
        if job not in done:
            if limit_s is not None and ran and time.monotonic() - started > limit_s:
                break
            ran += 1
            task, length, sample_seed = job
            sample = ruler.generate(task, length, sample_seed, count)
            done[job] = evaluate_sample(engine, sample, profile, count, prepare, format)
            if out_dir is not None:
                with open(out_dir / RECORDS_FILE, "a") as f:
                    f.write(json.dumps([asdict(r) for r in done[job]]) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            bar.update(1)
        records.extend(done[job])
    bar.close()
    return records


# the studies and summaries of a run's records live beside it, and are importable from here as before
from .profiles import MAIN_VARIANTS, PROFILES, VARIANTS, Profile, Variant  # noqa: E402,F401
from .study import AlignmentRow, alignment_study, first_global_layer  # noqa: E402,F401
from .summaries import (cross_budget_differences, paired_differences, records_as_dicts,  # noqa: E402,F401
                        summary)
