"""One evaluation answer (`Record`) and the token counter the generator sizes samples with: what the
runner writes and the study, summaries and report read, in a module of its own below all of them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.core import Engine


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
    # "ruler": RULER's raw layout, its task preamble as the shared prefix; "deployed": the engine's own layout (its
    # chat template, chunks ingested behind its generic system prompt), as Engine.generate and the server ask
    format: str = "ruler"


def token_counter(engine: Engine) -> Callable[[str], int]:
    return functools.lru_cache(maxsize=None)(lambda text: len(engine.primary.encode(text)))
