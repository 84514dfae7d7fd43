"""The evaluation run: methods x ratios x lengths x tasks on RULER samples, in one engine.

Every sample is ingested once (its chunk KV for the primary and for the aux) and answered by `full`
first: its greedy answer is the reference for fidelity. Every other variant and ratio then runs over
the same stored caches, and from each one prefill come
- the RULER score of its own greedy answer (decoded to a budget that fits every reference; decoding
  ends early once every reference is in the output, which cannot change the score);
- teacher-forced fidelity along `full`'s answer: mean per-step KL(full || method) and top-1
  agreement, plus first-token KL;
- the log-likelihood of the gold answer, and its difference to `full`'s.
Prompts use RULER's own wording and raw layout (see `ruler`).

A run is resumable: each finished sample's records are appended as one JSON line to
`records.jsonl` in the run's folder, and a rerun skips the samples found there.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tqdm.auto import tqdm

from ..config import RequestOptions
from ..engine import Engine
from ..models import PromptFormat
from . import ruler
from .alignment import char_attention, compare
from .fidelity import first_token_kl, sequence_log_likelihood, teacher_forced_fidelity
from .stats import bootstrap_ci, paired_bootstrap_ci, sign_test, wilson_interval


@dataclass(frozen=True)
class Variant:
    """A method with its option overrides: the paper's methods and CacheClip's ablations."""

    name: str
    method: str
    grouping: bool = True
    shared_prefix: bool = True
    exact_budget: bool = True
    ape: tuple[float, float] | None = None  # (temperature, scale) for method "ape"; None: the defaults

    @property
    def uses_ratio(self) -> bool:
        return self.method in ("cacheblend", "cacheclip", "oracle")


VARIANTS = {
    v.name: v
    for v in (
        Variant("full", "full"),
        Variant("direct", "direct"),
        Variant("shared_prefix", "shared_prefix"),
        Variant("ape", "ape"),  # APE_TEMPERATURE, APE_SCALE (config)
        # tuned for Gemma 3 270M on held-out samples (seed 1000, one per task at 1K; not in any profile's
        # seeds): first-token KL to full 0.31 at (0.5, 1.0) against 0.92 at (0.9, 0.9); see bench/RESULTS.md
        Variant("ape_tuned", "ape", ape=(0.5, 1.0)),
        Variant("cacheblend", "cacheblend"),
        Variant("cacheclip", "cacheclip"),
        Variant("oracle", "oracle"),  # the primary's own last-layer attention selects (not a ceiling)
        Variant("cacheclip_nogroup", "cacheclip", grouping=False),  # ablation: no sliding-window grouping
        Variant("cacheclip_noprefix", "cacheclip", shared_prefix=False),  # ablation: chunks computed alone
        Variant("cacheclip_nominal", "cacheclip", exact_budget=False),  # the paper's nominal top-k budget
    )
}

MAIN_VARIANTS = ("full", "shared_prefix", "ape", "ape_tuned", "cacheblend", "cacheclip")


@dataclass(frozen=True)
class Profile:
    name: str
    lengths: tuple[int, ...]
    tasks: tuple[str, ...]
    samples: int | tuple[int, ...]  # per task; one number, or one per length
    ratios: tuple[float, ...]
    variants: tuple[str, ...]
    alignment_lengths: tuple[int, ...]
    max_new_tokens: int = 32
    headline_ratio: float = 0.2
    alignment_samples: int = 1

    def samples_at(self, length: int) -> int:
        if isinstance(self.samples, int):
            return self.samples
        if len(self.samples) != len(self.lengths):
            raise ValueError(f"samples {self.samples} must give one count per length {self.lengths}")
        return self.samples[self.lengths.index(length)]


PROFILES = {
    # about 10 minutes on 2 CPU cores with the embedded Gemma 3 270M / SmolLM2-135M pair
    "quick": Profile(
        "quick", lengths=(1024,), tasks=ruler.TASKS, samples=1, ratios=(0.1, 0.2, 0.4),
        variants=("full", "direct", "shared_prefix", "ape", "cacheblend", "cacheclip", "oracle"),
        alignment_lengths=(1024,),
    ),
    # the paired comparison at the headline budget, with power: 104 samples at 2K (run first: the
    # acceptance set), then 200 at 1K
    "power": Profile(
        "power", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.2,),
        variants=MAIN_VARIANTS, alignment_lengths=(1024, 2048), alignment_samples=50,
    ),
    # the power run's companion for the score-vs-ratio curves: the budget-taking methods at the other
    # ratios of the sweep over the same samples (the ratio-free baselines and ratio 0.2 come from the
    # power run: report both together with `--merge`); about 2 minutes a 2K sample on 2 CPU cores
    "sweep": Profile(
        "sweep", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.05, 0.1, 0.3, 0.5),
        variants=("full", "cacheblend", "cacheclip"), alignment_lengths=(), alignment_samples=0,
    ),
    # CacheClip's ablations and the other baselines at the headline budget, over the same samples
    # (with `--merge` of the power run: each ablation paired against cacheclip @ 0.2)
    "ablations": Profile(
        "ablations", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.2,),
        variants=("full", "direct", "oracle", "cacheclip_nogroup", "cacheclip_noprefix", "cacheclip_nominal"),
        alignment_lengths=(), alignment_samples=0,
    ),
    # every method and ablation at every ratio in one folder (resumable; about 25 hours on 2 CPU cores;
    # power + sweep + ablations cover its main methods at every ratio and the ablations at 0.2)
    "full": Profile(
        "full", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.05, 0.1, 0.2, 0.3, 0.5),
        variants=tuple(VARIANTS), alignment_lengths=(1024, 2048), alignment_samples=50,
    ),
}


@dataclass(frozen=True)
class Record:
    """One answer: which sample and variant, its score, fidelity to `full`, and its timings."""

    task: str
    length: int
    seed: int
    variant: str
    ratio: float | None
    prompt_tokens: int
    chunk_tokens: int
    chunks: int
    score: float
    kl: float  # first answer token, KL(full || method)
    tf_kl: float  # mean over full's answer, teacher-forced
    tf_top1: float  # share of full's answer tokens that are the method's top-1 under teacher forcing
    gold_ll: float  # log p(gold answer), nats
    gold_ll_delta: float  # gold_ll - full's gold_ll
    recomputed_share: float  # recomputed chunk tokens / chunk tokens (the budget actually spent)
    load_s: float
    select_s: float
    recompute_s: float
    ttft_s: float
    output: str
    references: tuple[str, ...]


def token_counter(engine: Engine) -> Callable[[str], int]:
    return functools.lru_cache(maxsize=None)(lambda text: len(engine.primary.encode(text)))


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


def _answer_until_complete(engine: Engine, plan, prefill, options: RequestOptions, references, started: float):
    """Greedy decode that ends once every reference is in the output (the score cannot change after)."""
    stream = engine.decode(plan, prefill, options, started)
    text = ""
    for piece in stream:
        text += piece
        if ruler.score(text, references) == 1.0:
            break
    return text, list(stream.token_ids), prefill.timings


def evaluate_sample(engine: Engine, sample: ruler.Sample, profile: Profile, count: Callable[[str], int]) -> list[Record]:
    chunks = ruler.sample_chunks(sample, count)
    gold = engine.primary.encode(gold_answer(sample))
    engine = ruler_engine(engine, sample)  # a view in RULER's layout; the caller's engine is untouched
    engine.ingest(chunks, progress=False, direct="direct" in profile.variants)
    budget = max(profile.max_new_tokens, decode_budget(engine, sample), len(gold))
    # RULER decodes to its budget: no prompt-format stop string ends an answer early
    base = dict(max_new_tokens=budget, answer_prefix=sample.answer_prefix, prompt_stops=False)

    def measure(variant: Variant, ratio: float | None):
        ape = dict(ape_temperature=variant.ape[0], ape_scale=variant.ape[1]) if variant.ape else {}
        options = RequestOptions(
            method=variant.method, ratio=ratio if ratio is not None else 0.0, grouping=variant.grouping,
            shared_prefix=variant.shared_prefix, exact_budget=variant.exact_budget, **ape, **base,
        )
        started = time.perf_counter()
        plan, prefill = engine.prefill(sample.question, chunks, options)
        text, tokens, timings = _answer_until_complete(engine, plan, prefill, options, sample.references, started)
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
            recomputed = 0 if name == "full" else int(prefill.recomputed_positions.numel())
            records.append(Record(
                task=sample.task, length=sample.target_tokens, seed=sample.seed, variant=name, ratio=ratio,
                prompt_tokens=plan.length, chunk_tokens=chunk_tokens, chunks=len(chunks),
                score=ruler.score(text, sample.references), kl=first_token_kl(full_prefill.logits, prefill.logits),
                tf_kl=tf_kl, tf_top1=tf_top1, gold_ll=gold_ll, gold_ll_delta=gold_ll - full_gold,
                recomputed_share=1.0 if name == "full" else recomputed / max(1, chunk_tokens),
                load_s=timings.load_s, select_s=timings.select_s, recompute_s=timings.recompute_s,
                ttft_s=timings.ttft_s, output=text, references=sample.references,
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


def _check_run(out_dir: Path, identity: dict) -> None:
    path = out_dir / RUN_FILE
    if path.exists():
        stored = json.loads(path.read_text())
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
        limit_s: float | None = None) -> list[Record]:
    """Every task x length x sample of `profile`, each answered by every variant and ratio. With
    `out_dir`, finished samples are appended there as they finish and a rerun resumes; `limit_s` stops
    starting new samples after that many seconds (at least one runs; the run is resumed later)."""
    unknown = [v for v in profile.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    unknown = [t for t in profile.tasks if t not in ruler.SPECS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {', '.join(ruler.TASKS)}")
    done: dict[tuple[str, int, int], list[Record]] = {}
    if out_dir is not None:
        _check_run(out_dir, _run_identity(engine, profile, seed))
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
            done[job] = evaluate_sample(engine, sample, profile, count)
            if out_dir is not None:
                with open(out_dir / RECORDS_FILE, "a") as f:
                    f.write(json.dumps([asdict(r) for r in done[job]]) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            bar.update(1)
        records.extend(done[job])
    bar.close()
    return records


@dataclass(frozen=True)
class AlignmentRow:
    length: int
    seed: int
    pair: str
    jaccard: float
    kl: float
    pearson: float
    spearman: float


def first_global_layer(engine: Engine) -> int:
    """The primary's first full-attention layer (Gemma 3's first five layers see a local window only)."""
    types = getattr(engine.primary.config, "layer_types", None) or []
    return next((i for i, t in enumerate(types) if t == "full_attention"), 0)


def alignment_study(engine: Engine, lengths: Sequence[int], seed: int = 0, samples: int = 1,
                    progress: bool = False) -> tuple[list[AlignmentRow], dict]:
    """Per prose sample: the aux's last layer, the primary's first layer and its first global layer,
    each against the primary's last layer (last-token attention projected onto characters).

    Returns one row per sample and pair, and the character maps of the first sample (for the plot)."""
    if engine.aux is None:
        raise ValueError("the alignment study needs an aux model")
    count = token_counter(engine)
    rows, maps = [], {}
    system = engine.config.system_prompt
    last = engine.primary.config.num_hidden_layers - 1
    first_global = first_global_layer(engine)
    aux_last = engine.aux.config.num_hidden_layers - 1
    jobs = [(length, seed + i) for length in lengths for i in range(samples)]
    for length, sample_seed in tqdm(jobs, desc="alignment", disable=not progress, unit="sample"):
        sample = ruler.generate("single2", length, sample_seed, count)
        chunks = ruler.sample_chunks(sample, count)
        primary = char_attention(engine.primary, system, chunks, sample.question, tuple(sorted({0, first_global, last})))
        aux = char_attention(engine.aux, system, chunks, sample.question, (aux_last,))[aux_last]
        pairs = [("aux_last vs pri_last", aux), ("pri_first vs pri_last", primary[0])]
        if first_global not in (0, last):
            pairs.append((f"pri_first_global (layer {first_global}) vs pri_last", primary[first_global]))
        for pair, other in pairs:
            rows.append(AlignmentRow(length, sample_seed, pair, **compare(primary[last], other)))
        if not maps:
            maps = {"pri_last": primary[last], "pri_first": primary[0], "aux_last": aux, "length": length}
    return rows, maps


def _estimate(values: Sequence[float]) -> dict:
    e = bootstrap_ci(values)
    return {"mean": e.mean, "low": e.low, "high": e.high, "n": e.n}


def summary(records: Sequence[Record]) -> dict:
    """Per (length, variant, ratio): n; mean score, fidelity and Δ log p(gold) with bootstrap 95%
    intervals; the share of samples solved with its Wilson interval; spent budget; timings; per task."""
    groups: dict[tuple[int, str, float | None], list[Record]] = {}
    for r in records:
        groups.setdefault((r.length, r.variant, r.ratio), []).append(r)
    rows = []
    for (length, variant, ratio), rs in groups.items():
        full = groups.get((length, "full", None))
        full_ttft = statistics.fmean(r.ttft_s for r in full) if full else None
        ttft = statistics.fmean(r.ttft_s for r in rs)
        solved = wilson_interval(sum(r.score == 1.0 for r in rs), len(rs))
        rows.append({
            "length": length, "variant": variant, "ratio": ratio, "n": len(rs),
            "score": _estimate([r.score for r in rs]),
            "solved": {"mean": solved.mean, "low": solved.low, "high": solved.high, "n": solved.n},
            "tf_kl": _estimate([r.tf_kl for r in rs]), "tf_top1": _estimate([r.tf_top1 for r in rs]),
            "kl": _estimate([r.kl for r in rs]), "gold_ll_delta": _estimate([r.gold_ll_delta for r in rs]),
            "recomputed_share": statistics.fmean(r.recomputed_share for r in rs),
            "select_s": statistics.fmean(r.select_s for r in rs), "load_s": statistics.fmean(r.load_s for r in rs),
            "recompute_s": statistics.fmean(r.recompute_s for r in rs), "ttft_s": ttft,
            "speedup": full_ttft / ttft if full_ttft and ttft > 0 else None,
            "per_task": {t: statistics.fmean(r.score for r in rs if r.task == t) for t in sorted({r.task for r in rs})},
        })
    return {"rows": rows}


PAIRED_METRICS = ("score", "tf_kl", "tf_top1", "kl", "gold_ll_delta")


def _by_cell(records: Sequence[Record]) -> dict[tuple[str, float | None], dict[tuple[str, int, int], Record]]:
    by: dict[tuple[str, float | None], dict[tuple[str, int, int], Record]] = {}
    for r in records:
        by.setdefault((r.variant, r.ratio), {})[(r.task, r.length, r.seed)] = r
    return by


def _paired_rows(mine: dict[tuple[str, int, int], Record], theirs: dict[tuple[str, int, int], Record],
                 metrics: Sequence[str], **labels: object) -> list[dict]:
    """Per length: mean of mine − theirs over the samples both hold, with a paired bootstrap 95%
    interval, and the sign test (wins = mine higher, ties dropped)."""
    out = []
    for length in sorted({k[1] for k in mine}):
        keys = sorted(k for k in mine if k in theirs and k[1] == length)
        if len(keys) < 2:
            continue
        for metric in metrics:
            a = [getattr(mine[k], metric) for k in keys]
            b = [getattr(theirs[k], metric) for k in keys]
            d = paired_bootstrap_ci(a, b)
            wins, losses, p = sign_test(a, b)
            out.append({"length": length, **labels, "metric": metric, "mean": d.mean, "low": d.low,
                        "high": d.high, "n": d.n, "wins": wins, "losses": losses, "p": p,
                        "excludes_zero": d.excludes_zero()})
    return out


def paired_differences(records: Sequence[Record], method: str = "cacheclip",
                       against: Sequence[str] | None = None) -> list[dict]:
    """`method` minus each other variant on the same samples, at the same ratio where both take one
    (ratio-free baselines are compared at every ratio of `method`): mean difference with a paired
    bootstrap 95% interval, and the sign test (wins = method higher, ties dropped)."""
    by = _by_cell(records)
    variants = dict.fromkeys(r.variant for r in records)
    against = [v for v in (against or variants) if v not in (method, "full") and v in variants]
    out = []
    for (variant, ratio), mine in sorted(by.items(), key=lambda kv: (kv[0][1] or 0.0)):
        if variant != method:
            continue
        for other in against:
            theirs = by.get((other, ratio if VARIANTS[other].uses_ratio else None), {})
            out += _paired_rows(mine, theirs, PAIRED_METRICS, ratio=ratio, method=method, other=other)
    return out


CROSS_BUDGET_METRICS = ("tf_kl", "score")


def cross_budget_differences(records: Sequence[Record], method: str = "cacheclip",
                             other: str = "cacheblend") -> list[dict]:
    """`method` at each ratio minus `other` at every larger ratio, on the same samples: whether the
    method matches the other's fidelity with less recompute (the paper's Figure 6 read across
    budgets). Same statistics as `paired_differences`."""
    by = _by_cell(records)
    mine_ratios = sorted(r for v, r in by if v == method and r is not None)
    their_ratios = sorted(r for v, r in by if v == other and r is not None)
    out = []
    for ratio in mine_ratios:
        for other_ratio in (r for r in their_ratios if r > ratio):
            out += _paired_rows(by[(method, ratio)], by[(other, other_ratio)], CROSS_BUDGET_METRICS, ratio=ratio,
                                method=method, other=other, other_ratio=other_ratio)
    return out


def records_as_dicts(records: Sequence[Record]) -> list[dict]:
    return [asdict(r) for r in records]
