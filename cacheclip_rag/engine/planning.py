"""Request plans: where every token of a request sits. `plan_chunks` is the engine's own layout (prefix,
chunks with their separators, question); `plan_layout` follows a prompt someone else wrote, as
`recognize` found the stored chunks in it."""

from __future__ import annotations

from collections.abc import Sequence

from ..config import RequestOptions, check_text
from ..stages.load.ingest import FormattedPrefix, chunk_unit, validate_chunks
from ..models.loading import LoadedModel
from .recognize import Layout
from ..stages.request import Plan


def plan_chunks(lm: LoadedModel, question: str, texts: Sequence[str], options: RequestOptions, *,
                system_prompt: str) -> Plan:
    """The engine's own layout: `system_prompt`'s prefix, each chunk with its separator, the question;
    every input checked before any work."""
    validate_chunks(texts)
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question is empty")
    check_text("question", question)
    prefix_ids = lm.encode_prefix(lm.prompt.prefix(system_prompt))
    question_ids = lm.encode(lm.prompt.question(question, options.answer_prefix))
    limit = lm.max_context
    if len(question_ids) + len(prefix_ids) >= limit:
        raise ValueError(f"question of {len(question_ids)} tokens does not fit the model's context of {limit}")
    encoded = [lm.encode_with_offsets(chunk_unit(lm, t)) for t in texts]
    chunk_ids = tuple(tuple(ids) for ids, _ in encoded)
    char_spans = tuple(tuple(spans) for _, spans in encoded)
    plan = Plan(texts=tuple(texts), prefix_ids=tuple(prefix_ids), chunk_ids=chunk_ids, char_spans=char_spans,
                question_ids=tuple(question_ids), question=question, system_prompt=system_prompt)
    if plan.length + options.max_new_tokens > limit:
        raise ValueError(
            f"blended prompt of {plan.length} tokens plus max_new_tokens={options.max_new_tokens} "
            f"exceeds the model's context of {limit} tokens"
        )
    return plan


def plan_layout(lm: LoadedModel, layout: Layout, options: RequestOptions) -> Plan:
    """The plan of a prompt a client wrote, as `recognize` found it: its text before the first stored
    chunk is the shared prefix (chunks are cached behind it, once), each chunk is read from the
    store (stored with the model's separator when the prompt has it after the chunk, else alone),
    the text between chunks and after the last one is computed as the question is."""
    validate_chunks(layout.chunks)
    if len(layout.between) != len(layout.chunks):
        raise ValueError(f"a layout needs the text after each of its {len(layout.chunks)} chunks")
    separator = lm.prompt.chunk_separator
    bare, gaps, chunk_ids, spans = [], [], [], []
    afters = [*layout.between[:-1], layout.tail]  # the last chunk is followed by the rest of the prompt
    for i, (text, after) in enumerate(zip(layout.chunks, afters)):
        joined = bool(separator) and after.startswith(separator)  # then the stored unit ends with it
        ids, offsets = lm.encode_with_offsets(chunk_unit(lm, text, not joined))
        rest = after[len(separator):] if joined else after
        bare.append(not joined)
        chunk_ids.append(tuple(ids))
        spans.append(tuple(offsets))
        if i < len(afters) - 1:
            gaps.append(tuple(lm.encode(rest)) if rest else ())
        else:
            gaps.append(())
            tail = rest
    plan = Plan(texts=tuple(layout.chunks), prefix_ids=tuple(lm.encode_prefix(layout.head)), chunk_ids=tuple(chunk_ids),
                char_spans=tuple(spans), question_ids=tuple(lm.encode(tail)), question=layout.question,
                system_prompt=FormattedPrefix(layout.head), bare=tuple(bare), gaps=tuple(gaps))
    if not plan.question_ids:
        raise ValueError("the prompt ends with a stored chunk: nothing follows it to answer")
    if plan.length + options.max_new_tokens > lm.max_context:
        raise ValueError(f"prompt of {plan.length} tokens plus max_new_tokens={options.max_new_tokens} "
                         f"exceeds the model's context of {lm.max_context} tokens")
    return plan
