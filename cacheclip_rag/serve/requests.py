"""OpenAI request bodies, checked field by field: a bad request is a 4xx with OpenAI's error body
naming the field, never a traceback."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import SELECTIONS, SPREAD_RATIO

log = logging.getLogger(__name__)


class APIError(Exception):
    """An OpenAI-style error: HTTP `status`, and the body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Generation:
    """What both endpoints share: the model, decoding limits and sampling, streaming, and our options."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    documents: tuple[str, ...] | None  # explicit chunks (extra_body={"documents": [...]})
    cache_salt: str | None  # reuse only between requests of the same tenant with the same salt (as vLLM)
    # extra_body={"cacheclip": {"method", "ratio", "selection", "aux_share", "spread_ratio", "min_recompute_tokens"}}
    method: str | None
    ratio: float | None
    selection: str | None = None  # "question" | "aux" when the request names one
    aux_share: float | None = None
    spread_ratio: float | None = SPREAD_RATIO  # null turns the spread budget off
    min_recompute_tokens: int | None = None  # the server's default when None; 0 turns the short-prompt floor off


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict, ...]
    generation: Generation


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    generation: Generation
    echo: bool = field(default=False)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; every string in it valid Unicode (a lone surrogate such as "\\ud800"
    is refused here, named, not deep inside a tokenizer), nesting within Python's own limit."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not JSON ({type(err).__name__}: {err})") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_strings(body)
    return body


def _check_strings(body: dict) -> None:
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise APIError(400, f"'{path}' is not valid Unicode text ({err.reason} at index {err.start})",
                               path or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.append((f"{path}.{key}" if path else str(key), key))
                todo.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", item) for i, item in enumerate(value)]


# OpenAI fields: honoured; accepted and without effect on the answer; and supported only at their
# default (anything else is a 400 naming the field, as vLLM answers, never silently ignored)
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "documents", "cacheclip", "cache_salt"}
_WITHOUT_EFFECT = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                   "parallel_tool_calls"}
_DEFAULT_ONLY = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                 "function_call": (None, "none"), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
                 "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "audio": (None,),
                 "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
                 "reasoning_effort": (None,), "verbosity": (None,), "presence_penalty": (None, 0, 0.0),
                 "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1), "suffix": (None, ""), "echo": (None, False)}
_CHAT_FIELDS = _COMMON | _WITHOUT_EFFECT | {"messages", "max_completion_tokens"} | (set(_DEFAULT_ONLY) - {"best_of", "suffix", "echo"})
_COMPLETION_FIELDS = _COMMON | _WITHOUT_EFFECT | {"prompt", "logprobs", "logit_bias", "presence_penalty",
                                                  "frequency_penalty", "best_of", "suffix", "echo"}


def check_fields(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name not in known:
            raise APIError(400, f"unknown field '{name}'", name, "unknown_field")
        if name in _DEFAULT_ONLY and value not in _DEFAULT_ONLY[name]:
            raise APIError(400, f"'{name}' is not supported by this server (only its default: "
                           f"{_DEFAULT_ONLY[name][-1]!r})", name, "unsupported_parameter")


def _number(body: dict, name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise APIError(400, f"'{name}' must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise APIError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise APIError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _strings(value: Any, name: str, limit: int) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise APIError(400, f"'{name}' must be a string or a list of non-empty strings", name)
    if len(value) > limit:
        raise APIError(400, f"'{name}' holds at most {limit} entries, got {len(value)}", name)
    return tuple(value)


def generation(body: dict, known_models: tuple[str, ...], methods: tuple[str, ...]) -> Generation:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required (a string)", "model")
    if model not in known_models:
        raise APIError(404, f"the model {model!r} does not exist here; GET /v1/models lists {', '.join(known_models)}",
                       "model", "model_not_found")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 20)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 20)
    seed = _integer(body, "seed", 0, (1 << 63) - 1)
    if body.get("n", 1) not in (1, None):
        raise APIError(400, "'n' must be 1 here (one answer per request)", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    documents = body.get("documents")
    if documents is not None:
        documents = _strings(documents, "documents", 256)
        if not documents:
            raise APIError(400, "'documents' must hold at least one document", "documents")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise APIError(400, "'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
    ours = body.get("cacheclip") or {}
    if not isinstance(ours, dict):
        raise APIError(400, "'cacheclip' must be an object: {\"method\": ..., \"ratio\": ..., \"selection\": ...}",
                       "cacheclip")
    method = ours.get("method")
    if method is not None and method not in methods:
        raise APIError(400, f"'cacheclip.method' must be one of {', '.join(methods)}, got {method!r}", "cacheclip.method")
    ratio = None if ours.get("ratio") is None else _number(ours, "ratio", 0.0, low=0.0, high=1.0)
    selection, aux_share = _selection(ours)
    spread = None if "spread_ratio" in ours and ours["spread_ratio"] is None else _number(
        ours, "spread_ratio", SPREAD_RATIO, low=0.0, high=1.0)
    floor = _integer(ours, "min_recompute_tokens", 0, 1 << 20)
    return Generation(model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, low=0.0, high=2.0),
                      top_p=_number(body, "top_p", 1.0, low=1e-6, high=1.0), stop=_strings(body.get("stop"), "stop", 4),
                      seed=seed, stream=stream, include_usage=bool(options.get("include_usage", False)),
                      documents=documents, cache_salt=salt, method=method, ratio=ratio, selection=selection,
                      aux_share=aux_share, spread_ratio=spread,
                      min_recompute_tokens=floor)


def _warn_requery() -> None:
    """Said once a process: the library no longer takes the spelling; the HTTP API still reads it."""
    if not _warned_requery:
        _warned_requery.append(True)
        log.warning("a request used 'cacheclip.requery', the deprecated spelling of the selection: use "
                    "'selection' ('question' with 'aux_share', or 'aux')")


_warned_requery: list[bool] = []


def _selection(ours: dict) -> tuple[str | None, float | None]:
    """`selection` and `aux_share` as named, or from `requery`, their old spelling (deprecated; null: the
    paper's aux selection, a number p: the question's with the aux's share p)."""
    selection = ours.get("selection")
    if selection is not None and selection not in SELECTIONS:
        raise APIError(400, f"'cacheclip.selection' must be one of {', '.join(SELECTIONS)}, got {selection!r}",
                       "cacheclip.selection")
    aux_share = None if ours.get("aux_share") is None else _number(ours, "aux_share", 0.0, low=0.0, high=1.0)
    if "requery" in ours:
        _warn_requery()
        if selection is not None or aux_share is not None:
            raise APIError(400, "give 'requery' (deprecated) or 'selection'/'aux_share', not both", "requery")
        if ours["requery"] is None:
            return "aux", None
        return "question", _number(ours, "requery", 0.0, low=0.0, high=1.0)
    return selection, aux_share


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def chat_request(body: dict, known_models: tuple[str, ...], methods: tuple[str, ...]) -> ChatRequest:
    check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role")
        parsed.append({"role": "system" if role == "developer" else role, "content": _content(message, i)})
    if parsed[-1]["role"] != "user" or not parsed[-1]["content"].strip():
        raise APIError(400, "the last message must be the user's, with text", "messages")
    return ChatRequest(tuple(parsed), generation(body, known_models, methods))


def completion_request(body: dict, known_models: tuple[str, ...], methods: tuple[str, ...]) -> CompletionRequest:
    check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise APIError(400, "'prompt' must be a non-empty string (one prompt per request)", "prompt")
    return CompletionRequest(prompt, generation(body, known_models, methods))
