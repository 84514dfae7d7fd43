"""The evaluation run: methods x ratios x lengths x tasks on RULER samples, in one engine.

Every sample is ingested once (its chunk KV for the primary, shared and direct, and for the aux),
then answered by `full` first (the reference for fidelity) and by every other variant and ratio
over the same stored caches. Greedy decoding; the answer is primed (see `ruler`).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from ..config import RequestOptions
from ..engine import Answer, Engine
from . import ruler
from .alignment import char_attention, compare
from .fidelity import first_token_kl, greedy_agreement


@dataclass(frozen=True)
class Variant:
    """A method with its option overrides: the paper's methods and CacheClip's ablations."""

    name: str
    method: str
    grouping: bool = True
    shared_prefix: bool = True

    @property
    def uses_ratio(self) -> bool:
        return self.method in ("cacheblend", "cacheclip", "oracle")


VARIANTS = {
    v.name: v
    for v in (
        Variant("full", "full"),
        Variant("direct", "direct"),
        Variant("shared_prefix", "shared_prefix"),
        Variant("cacheblend", "cacheblend"),
        Variant("cacheclip", "cacheclip"),
        Variant("oracle", "oracle"),
        Variant("cacheclip_nogroup", "cacheclip", grouping=False),  # ablation: no sliding-window grouping
        Variant("cacheclip_noprefix", "cacheclip", shared_prefix=False),  # ablation: chunks computed alone
    )
}


@dataclass(frozen=True)
class Profile:
    name: str
    lengths: tuple[int, ...]
    tasks: tuple[str, ...]
    samples: int
    ratios: tuple[float, ...]
    variants: tuple[str, ...]
    alignment_lengths: tuple[int, ...]
    max_new_tokens: int = 32
    headline_ratio: float = 0.2


PROFILES = {
    # about 8 minutes on 2 CPU cores with the embedded Gemma 3 270M / SmolLM2-135M pair
    "quick": Profile(
        "quick", lengths=(1024,), tasks=ruler.TASKS, samples=1, ratios=(0.1, 0.2, 0.4),
        variants=("full", "direct", "shared_prefix", "cacheblend", "cacheclip", "oracle"),
        alignment_lengths=(1024,), max_new_tokens=24,
    ),
    "full": Profile(
        "full", lengths=(2048, 4096), tasks=ruler.TASKS, samples=3, ratios=(0.1, 0.2, 0.3, 0.5),
        variants=tuple(VARIANTS), alignment_lengths=(1024, 2048, 4096),
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
    chunks: int
    score: float
    kl: float
    agreement: float
    recompute_fraction: float
    load_s: float
    select_s: float
    recompute_s: float
    ttft_s: float
    output: str
    references: tuple[str, ...]


def token_counter(engine: Engine) -> Callable[[str], int]:
    return functools.lru_cache(maxsize=None)(lambda text: len(engine.primary.encode(text)))


def _record(sample: ruler.Sample, chunks: int, variant: Variant, ratio: float | None, answer: Answer, full: Answer) -> Record:
    t = answer.timings
    return Record(
        task=sample.task, length=sample.target_tokens, seed=sample.seed, variant=variant.name, ratio=ratio,
        prompt_tokens=answer.prompt_tokens, chunks=chunks, score=ruler.score(answer.text, sample.references),
        kl=first_token_kl(full.first_logits, answer.first_logits),
        agreement=greedy_agreement(full.token_ids, answer.token_ids),
        recompute_fraction=answer.recompute_fraction, load_s=t.load_s, select_s=t.select_s,
        recompute_s=t.recompute_s, ttft_s=t.ttft_s, output=answer.text, references=sample.references,
    )


def decode_budget(engine: Engine, sample: ruler.Sample, margin: int = 8) -> int:
    """New tokens that fit every reference of the sample written out in the answer model's tokens,
    plus a margin: a budget that cuts the answer off would score truncation, not retrieval (Gemma
    writes one digit per token: a UUID is 37 tokens, four 7-digit values 36)."""
    return len(engine.primary.encode(" " + ", ".join(sample.references))) + margin


def evaluate_sample(engine: Engine, sample: ruler.Sample, profile: Profile, count: Callable[[str], int]) -> list[Record]:
    chunks = ruler.sample_chunks(sample, count)
    engine.ingest(chunks, progress=False)
    # RULER decodes to its budget: the completion format's newline stop would end an answer early
    base = dict(max_new_tokens=max(profile.max_new_tokens, decode_budget(engine, sample)),
                answer_prefix=sample.answer_prefix, prompt_stops=False)
    full = engine.generate(sample.question, chunks, RequestOptions(method="full", **base))
    records = [_record(sample, len(chunks), VARIANTS["full"], None, full, full)]
    for name in profile.variants:
        variant = VARIANTS[name]
        if variant.name == "full":
            continue
        for ratio in profile.ratios if variant.uses_ratio else (None,):
            options = RequestOptions(
                method=variant.method, ratio=ratio if ratio is not None else 0.0, grouping=variant.grouping,
                shared_prefix=variant.shared_prefix, **base,
            )
            answer = engine.generate(sample.question, chunks, options)
            records.append(_record(sample, len(chunks), variant, ratio, answer, full))
    return records


def run(engine: Engine, profile: Profile, seed: int = 0, progress: bool = True) -> list[Record]:
    """Every task x length x sample of `profile`, each answered by every variant and ratio."""
    unknown = [v for v in profile.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    count = token_counter(engine)
    jobs = [(task, length, seed + i) for length in profile.lengths for task in profile.tasks for i in range(profile.samples)]
    records: list[Record] = []
    for task, length, sample_seed in tqdm(jobs, desc=f"RULER {profile.name}", disable=not progress):
        sample = ruler.generate(task, length, sample_seed, count)
        records.extend(evaluate_sample(engine, sample, profile, count))
    return records


@dataclass(frozen=True)
class AlignmentRow:
    length: int
    pair: str
    jaccard: float
    kl: float
    pearson: float
    spearman: float


def alignment_study(engine: Engine, lengths: Sequence[int], seed: int = 0) -> tuple[list[AlignmentRow], dict]:
    """aux last layer vs primary last layer, and primary first vs primary last layer, on prose samples.

    Returns the rows and, for the first length, the three character maps (for the plot)."""
    if engine.aux is None:
        raise ValueError("the alignment study needs an aux model")
    count = token_counter(engine)
    rows, maps = [], {}
    system = engine.config.system_prompt
    for length in lengths:
        sample = ruler.generate("single2", length, seed, count)
        chunks = ruler.sample_chunks(sample, count)
        last = engine.primary.config.num_hidden_layers - 1
        primary = char_attention(engine.primary, system, chunks, sample.question, (0, last))
        aux_last = engine.aux.config.num_hidden_layers - 1
        aux = char_attention(engine.aux, system, chunks, sample.question, (aux_last,))[aux_last]
        for pair, other in (("aux_last vs pri_last", aux), ("pri_first vs pri_last", primary[0])):
            rows.append(AlignmentRow(length, pair, **compare(primary[last], other)))
        if not maps:
            maps = {"pri_last": primary[last], "pri_first": primary[0], "aux_last": aux, "length": length}
    return rows, maps


def summary(records: Sequence[Record]) -> dict:
    """Mean score, retention vs full, fidelity and timings per (variant, ratio); per task too."""
    def key(r: Record) -> tuple[str, float | None]:
        return (r.variant, r.ratio)

    groups: dict[tuple[str, float | None], list[Record]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    full_score = statistics.fmean(r.score for r in groups.get(("full", None), [])) if ("full", None) in groups else None
    full_ttft = statistics.fmean(r.ttft_s for r in groups[("full", None)]) if ("full", None) in groups else None
    rows = []
    for (variant, ratio), rs in groups.items():
        score = statistics.fmean(r.score for r in rs)
        ttft = statistics.fmean(r.ttft_s for r in rs)
        rows.append({
            "variant": variant, "ratio": ratio, "n": len(rs), "score": score,
            "retention": score / full_score if full_score else None,
            "kl": statistics.fmean(r.kl for r in rs), "agreement": statistics.fmean(r.agreement for r in rs),
            "recompute_fraction": statistics.fmean(r.recompute_fraction for r in rs),
            "select_s": statistics.fmean(r.select_s for r in rs), "load_s": statistics.fmean(r.load_s for r in rs),
            "recompute_s": statistics.fmean(r.recompute_s for r in rs), "ttft_s": ttft,
            "speedup": full_ttft / ttft if full_ttft and ttft > 0 else None,
            "per_task": {t: statistics.fmean(r.score for r in rs if r.task == t) for t in sorted({r.task for r in rs})},
        })
    return {"rows": rows, "full_score": full_score, "full_ttft_s": full_ttft}


def records_as_dicts(records: Sequence[Record]) -> list[dict]:
    return [asdict(r) for r in records]
