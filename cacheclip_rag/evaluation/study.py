"""The aux/primary attention alignment study over prose samples (Jaccard of the top characters, KL,
Pearson, Spearman), against the primary's first layer and its first global layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..engine.core import Engine
from ..models.loading import LoadedModel
from . import ruler
from .alignment import char_attention, compare


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


def last_of(model: LoadedModel) -> int:
    return model.config.num_hidden_layers - 1


def alignment_study(engine: Engine, lengths: Sequence[int], seed: int = 0, samples: int = 1,
                    progress: bool = False, other_auxes: Mapping[str, LoadedModel] | None = None,
                    ) -> tuple[list[AlignmentRow], dict]:
    """Per prose sample: the aux's last layer, the primary's first layer and its first global layer,
    each against the primary's last layer (last-token attention projected onto characters).
    `other_auxes` (name -> model) are compared on the same samples, the primary read once for all
    (pairs named "<name>_last vs pri_last").

    Returns one row per sample and pair, and the character maps of the first sample (for the plot)."""
    if engine.aux is None:
        raise ValueError("the alignment study needs an aux model")
    if "aux" in (other_auxes or {}):
        raise ValueError("other_auxes: 'aux' names the engine's own aux; give the others other names")
    from .records import token_counter

    count = token_counter(engine)
    rows, maps = [], {}
    system = engine.config.system_prompt
    last = last_of(engine.primary)
    first_global = first_global_layer(engine)
    jobs = [(length, seed + i) for length in lengths for i in range(samples)]
    for length, sample_seed in tqdm(jobs, desc="alignment", disable=not progress, unit="sample"):
        sample = ruler.generate("single2", length, sample_seed, count)
        chunks = ruler.sample_chunks(sample, count)
        primary = char_attention(engine.primary, system, chunks, sample.question,
                                 layers=tuple(sorted({0, first_global, last})))
        auxes = {name: char_attention(model, system, chunks, sample.question, layers=(last_of(model),))[last_of(model)]
                 for name, model in {"aux": engine.aux, **(other_auxes or {})}.items()}
        pairs = [(f"{name}_last vs pri_last", chars) for name, chars in auxes.items()]
        pairs.append(("pri_first vs pri_last", primary[0]))
        if first_global not in (0, last):
            pairs.append((f"pri_first_global (layer {first_global}) vs pri_last", primary[first_global]))
        for pair, other in pairs:
            rows.append(AlignmentRow(length, sample_seed, pair, **compare(primary[last], other)))
        if not maps:
            maps = {"pri_last": primary[last], "pri_first": primary[0], "aux_last": auxes["aux"], "length": length}
    return rows, maps
