"""From an OpenAI request to a planned engine request: messages rendered with the model's chat template,
stored chunks found in the prompt and laid out around them by the engine (`Engine.plan_prompt`), or the explicit documents of
`extra_body={"documents": [...]}` in the engine's own layout; nothing found: plain full prefill."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import DEFAULT_SELECTION, MIN_RECOMPUTE_TOKENS, RequestOptions
from ..engine.core import Engine
from ..stages.request import Plan
from .requests import APIError, ChatRequest, CompletionRequest, Generation


@dataclass(frozen=True)
class Planned:
    """A request ready to run: the engine's plan (None: full prefill of `prompt` as written), its options,
    and what was recognised, for the response's usage."""

    plan: Plan | None
    prompt: str | None
    options: RequestOptions
    chunks_recognised: int
    recognise_s: float = 0.0
    prompt_ids: tuple[int, ...] | None = None  # `prompt` tokenized (once: the size check and the prefill read it)


def render_chat(engine: Engine, messages: tuple[dict, ...]) -> str:
    """The messages as the primary reads them: its tokenizer's chat template, or (a model without one, a
    base model) the turns as plain text, ending where the assistant's answer starts."""
    tokenizer = engine.primary.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def system_head(engine: Engine, system: str) -> str:
    """The exact text a chat prompt starts with when its system message is `system` followed by the
    chunks (LangChain's RAG prompt, the stuff layouts): what `/v1/ingest` computes chunks behind, so
    the first request that pastes them already finds them."""
    mark = "\u2063cacheclip-chunks\u2063"  # an invisible separator no template rewrites
    rendered = render_chat(engine, ({"role": "system", "content": system + mark}, {"role": "user", "content": "?"}))
    if mark not in rendered:
        raise APIError(400, "the chat template drops the system message: ingest without 'system'", "system")
    return rendered[: rendered.index(mark)]


@dataclass(frozen=True)
class Defaults:
    """What a request that names none gets: the server's method, ratio and selection."""

    method: str = "cacheclip"
    ratio: float = 0.2
    selection: str = DEFAULT_SELECTION
    min_recompute_tokens: int = MIN_RECOMPUTE_TOKENS


def options_for(generation: Generation, defaults: Defaults) -> RequestOptions:
    try:
        return RequestOptions(method=generation.method or defaults.method,
                              ratio=defaults.ratio if generation.ratio is None else generation.ratio,
                              selection=generation.selection or defaults.selection,
                              aux_share=generation.aux_share or 0.0,
                              spread_ratio=generation.spread_ratio,
                              min_recompute_tokens=(defaults.min_recompute_tokens if generation.min_recompute_tokens
                                                    is None else generation.min_recompute_tokens),
                              max_new_tokens=generation.max_tokens or 256, temperature=generation.temperature,
                              top_p=generation.top_p, seed=generation.seed, stop=generation.stop)
    except (TypeError, ValueError) as err:
        raise APIError(400, str(err)) from None


def _recognised(engine: Engine, prompt: str, options: RequestOptions, messages: tuple[dict, ...] = ()) -> Planned:
    """The engine's own path for a prompt someone else wrote (`Engine.plan_prompt`): the stored chunks found
    in it, the question read as the library reads it (a chat: the last message without its pasted chunks; a
    completion: the text after the last chunk); nothing found: the prompt as written."""
    try:
        found = engine.plan_prompt(prompt, options, messages=messages)
    except ValueError as err:
        raise APIError(400, str(err), code="context_length_exceeded" if "context" in str(err) else None) from None
    if found.plan is None:
        return Planned(None, prompt, options, chunks_recognised=0, recognise_s=found.recognise_s)
    return Planned(found.plan, None, found.options, chunks_recognised=found.chunks, recognise_s=found.recognise_s)


def plan_chat(engine: Engine, request: ChatRequest, defaults: Defaults) -> Planned:
    options = options_for(request.generation, defaults)
    messages = request.messages
    if request.generation.documents:  # the engine's own layout over the given documents
        system = next((m["content"] for m in messages if m["role"] == "system" and m["content"].strip()), None)
        try:
            options = replace(options, system_prompt=system)
            return Planned(engine.plan(messages[-1]["content"], list(request.generation.documents), options), None,
                           options, len(request.generation.documents))
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), "documents") from None
    return _recognised(engine, render_chat(engine, messages), options, messages)


def plan_completion(engine: Engine, request: CompletionRequest, defaults: Defaults) -> Planned:
    options = options_for(request.generation, defaults)
    if request.generation.documents:
        try:
            return Planned(engine.plan(request.prompt, list(request.generation.documents), options), None, options,
                           len(request.generation.documents))
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), "documents") from None
    return _recognised(engine, request.prompt, options)
