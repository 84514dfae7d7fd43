"""A prompt someone else wrote (a framework's RAG template, an OpenAI client's messages) as an engine plan:
the stored chunks found in it (`recognize`), laid out around them (`planning.plan_layout`), with the question
the selection and the spread budget read. One path for `Engine.stream_prompt`, the frameworks and the server."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..config import RequestOptions
from ..models.loading import LoadedModel
from ..stages.request import Plan
from .planning import plan_layout
from .recognize import Layout, Match, layout


@dataclass(frozen=True)
class Recognised:
    """What a prompt held: its plan (None: no stored chunk, run it as written), the options it runs with (the
    aux's selection for a chat that asks before its context), how many chunks were found, how long that took."""

    plan: Plan | None
    options: RequestOptions
    chunks: int
    recognise_s: float


def asked(messages: Sequence[dict], chunks: Sequence[str]) -> str:
    """The user's question alone: the last message without the chunks pasted into it."""
    text = messages[-1]["content"]
    for chunk in chunks:
        text = text.replace(chunk, " ")
    return " ".join(text.split()) or messages[-1]["content"][-500:]


def selection_for(found: Layout, options: RequestOptions, has_aux: bool) -> RequestOptions:
    """cacheclip's query-driven selection reads the question's attention from the rows after the chunks; a
    chat that asks before its context (the user's words are not in the text after the last chunk) is
    selected by the aux, from the user's words, instead (the paper's selection)."""
    if options.method != "cacheclip" or options.selection != "question" or not has_aux:
        return options
    if " ".join(found.question.split()) in " ".join(found.tail.split()):
        return options
    return replace(options, selection="aux", aux_share=0.0)


def plan_prompt(lm: LoadedModel, find: Callable[[str], list[Match]], prompt: str, options: RequestOptions, *,
                question: str | None = None, messages: Sequence[dict] = (), has_aux: bool = False) -> Recognised:
    """`prompt` planned over the stored chunks `find` sees in it. The question: the user's words (`messages`:
    the last message without the pasted chunks; else `question`, else the text after the last chunk, where a
    completion asks). Raises ValueError for a prompt that does not fit the context."""
    t0 = time.perf_counter()
    matches = find(prompt)
    recognise_s = time.perf_counter() - t0
    if not matches:
        return Recognised(None, options, 0, recognise_s)
    tail = " ".join(prompt[matches[-1].stop:].split())
    words = asked(messages, [prompt[m.start:m.stop] for m in matches]) if messages else question or tail
    found = layout(prompt, matches, words or prompt[-500:])
    if messages:
        options = selection_for(found, options, has_aux)
    return Recognised(plan_layout(lm, found, options), options, len(matches), recognise_s)
