"""What an evaluation run measures: the variants (a method and its options) and the named profiles
(tasks, lengths, samples, ratios)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import MIN_RECOMPUTE_TOKENS, Diagnostics, RequestOptions
from . import ruler


@dataclass(frozen=True)
class Variant:
    """A method with its option overrides: the paper's methods and CacheClip's ablations."""

    name: str
    method: str
    grouping: bool = True
    shared_prefix: bool = True
    exact_budget: bool = True
    ape: tuple[float, float] | None = None  # (temperature, scale) for method "ape"; None: the defaults
    boundary_tokens: int | None = None  # RequestOptions.boundary_tokens
    recompute_layers: str = "all"  # RequestOptions.recompute_layers (a diagnostic)
    fixed_ratio: float | None = None  # run at this ratio whatever the profile's ratios (a diagnostic)
    # RequestOptions.selection and aux_share: "aux" (the paper's: the variant "cacheclip" reproduces it), or
    # "question" (cacheclip's default), after the aux's pick of aux_share of the budget
    selection: str = "aux"
    aux_share: float = 0.0
    spread_ratio: float | None = None  # RequestOptions.spread_ratio (the shipped default: 0.5, `cacheclip_spread`)
    # RequestOptions.min_recompute_tokens: 0, the ratio alone (variants measure what a ratio does); the shipped
    # default's floor in `cacheclip_spread`
    min_recompute_tokens: int = 0
    question_probe: bool = True  # Diagnostics.question_probe: the spread budget's words confirmed by the probe

    @property
    def uses_ratio(self) -> bool:
        return self.method in ("cacheblend", "cacheclip", "oracle") and self.fixed_ratio is None

    def options(self, ratio: float | None, **request: Any) -> RequestOptions:
        """The request this variant makes at `ratio` (None: a method that takes none), with `request`'s
        other options (decode budget, answer prefix)."""
        ape = dict(ape_temperature=self.ape[0], ape_scale=self.ape[1]) if self.ape else {}
        ratio = self.fixed_ratio if self.fixed_ratio is not None else ratio
        diagnostics = Diagnostics(grouping=self.grouping, shared_prefix=self.shared_prefix,
                                  exact_budget=self.exact_budget, boundary_tokens=self.boundary_tokens,
                                  recompute_layers=self.recompute_layers, question_probe=self.question_probe)
        return RequestOptions(method=self.method, ratio=ratio if ratio is not None else 0.0, selection=self.selection,
                              aux_share=self.aux_share, spread_ratio=self.spread_ratio,
                              min_recompute_tokens=self.min_recompute_tokens, diagnostics=diagnostics,
                              **ape, **request)


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
        # the quality-gap issue: each chunk's seam (separator tokens) recomputed first, then also its first
        # 4 tokens, out of the same budget; and every chunk row recomputed but written back only in the
        # sliding-window layers, or only in the global layers (where does the stale error live?)
        Variant("cacheclip_seams", "cacheclip", boundary_tokens=0),
        Variant("cacheclip_boundary4", "cacheclip", boundary_tokens=4),
        Variant("recompute_sliding_only", "cacheclip", recompute_layers="sliding", fixed_ratio=1.0),
        Variant("recompute_global_only", "cacheclip", recompute_layers="global", fixed_ratio=1.0),
        # a query-driven second stage (ProphetKV's idea): the question's attention over the reused cache picks
        # the budget (requery 0), or over the cache after the aux's pick of half the budget was recomputed
        Variant("cacheclip_requery", "cacheclip", selection="question"),
        Variant("cacheclip_requery_half", "cacheclip", selection="question", aux_share=0.5),
        # the default as shipped since issue 54: the question's selection, and ratio 0.5 for a question whose
        # subject several chunks hold (`spread.answer_spread`); since issue 67 at least 256 chunk tokens
        Variant("cacheclip_spread", "cacheclip", selection="question", spread_ratio=0.5,
                min_recompute_tokens=MIN_RECOMPUTE_TOKENS),
        # the default without the spread budget (`spread_ratio=None`), floor kept: what the budget adds, as
        # deployed (over prompts above the floor, RULER's, it is `cacheclip_requery` token for token)
        Variant("cacheclip_nospread", "cacheclip", selection="question", min_recompute_tokens=MIN_RECOMPUTE_TOKENS),
        # the default before the question probe: the spread budget on the question's words alone
        Variant("cacheclip_spread_words", "cacheclip", selection="question", spread_ratio=0.5,
                min_recompute_tokens=MIN_RECOMPUTE_TOKENS, question_probe=False),
    )
}

def is_default(variant: str, ratio: float | None) -> bool:
    """Whether `variant` at `ratio` is the method as shipped: the request a caller gets with no options."""
    return variant in VARIANTS and VARIANTS[variant].options(ratio) == RequestOptions()


GAP_VARIANTS = ("cacheclip_seams", "cacheclip_boundary4", "recompute_sliding_only", "recompute_global_only",
                "cacheclip_requery", "cacheclip_requery_half", "cacheclip_spread", "cacheclip_nospread",
                "cacheclip_spread_words")
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
    # answers spread over several chunks (issue 54): all the values of one key in 2, 3 and 4 parts of the
    # context, and a comparison of two keys' values; scored strictly (`solved`: every value) beside the
    # partial credit RULER gives; 52 samples a length
    "multichunk": Profile(
        "multichunk", lengths=(2048, 4096), tasks=ruler.MULTICHUNK_TASKS, samples=13, ratios=(0.2,),
        variants=("full", "shared_prefix", "cacheblend", "cacheclip_requery", "cacheclip_spread", "cacheclip", "oracle"),
        alignment_lengths=(), alignment_samples=0, max_new_tokens=48,
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
    # the end of the score-vs-ratio curve (where retention recovers): CacheClip at 0.7-1.0 over the power
    # run's 2K samples, paired with it and the sweep through `--merge`; about a minute a sample
    "tail": Profile(
        "tail", lengths=(2048,), tasks=ruler.TASKS, samples=13, ratios=(0.7, 0.9, 0.95, 1.0),
        variants=("full", "cacheclip"), alignment_lengths=(), alignment_samples=0,
    ),
    # CacheClip's ablations and the other baselines at the headline budget, over the same samples
    # (with `--merge` of the power run: each ablation paired against cacheclip @ 0.2)
    "ablations": Profile(
        "ablations", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.2,),
        variants=("full", "direct", "oracle", "cacheclip_nogroup", "cacheclip_noprefix", "cacheclip_nominal"),
        alignment_lengths=(), alignment_samples=0,
    ),
    # where the remaining gap lives and what closes it (the quality-gap issue), over the power run's 2K
    # samples: paired with cacheclip @ 0.2 there through `--merge`
    "gap": Profile(
        "gap", lengths=(2048,), tasks=ruler.TASKS, samples=13, ratios=(0.2,),
        variants=("full", *GAP_VARIANTS),
        alignment_lengths=(), alignment_samples=0,
    ),
    # every method and ablation at every ratio in one folder (resumable; about 25 hours on 2 CPU cores;
    # power + sweep + ablations cover its main methods at every ratio and the ablations at 0.2; the gap
    # profile's diagnostics are not part of it)
    "full": Profile(
        "full", lengths=(2048, 1024), tasks=ruler.TASKS, samples=(13, 25), ratios=(0.05, 0.1, 0.2, 0.3, 0.5),
        variants=tuple(v for v in VARIANTS if v not in GAP_VARIANTS), alignment_lengths=(1024, 2048),
        alignment_samples=50,
    ),
}
