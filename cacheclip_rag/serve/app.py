"""The OpenAI-compatible HTTP server: `/v1/chat/completions`, `/v1/completions` (streamed by SSE or
not), `/v1/models`, `/v1/ingest`, `/health`, `/metrics`. One engine, one model worker, an async front.

Every client speaks the OpenAI API unchanged (the `openai` client, LangChain's `ChatOpenAI`,
LlamaIndex's `OpenAILike`): the RAG framework pastes retrieved chunks into its prompt as it always
does, and the server finds the stored ones there and reuses their caches. `usage` says what was
reused: `prompt_tokens_details.cached_tokens` (as OpenAI defines it) and a `cacheclip` object.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import DEFAULT_SELECTION, METHODS, MIN_RECOMPUTE_TOKENS, RequestOptions
from ..engine.core import Engine
from ..stages.request import Answer
from .documents import add_document_routes
from .layouts import Defaults, Planned, plan_chat, plan_completion
from .metrics import Metrics
from .requests import APIError, chat_request, completion_request, parse_json
from .keys import OPERATOR, Tenant
from .limits import ClientSlots
from .tenants import Tenants
from ..engine.scheduler import DONE, Job, QueueFull, Worker, off_worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    model: str = "cacheclip"  # the name clients pass as `model`
    api_keys: tuple[str, ...] = ()  # empty: no key needed; these keys are one tenant, the operator
    tenant_keys: dict[str, Tenant] = field(default_factory=dict)  # key -> tenant (`tenants.load_keys`)
    method: str = "cacheclip"
    ratio: float = 0.2
    selection: str = DEFAULT_SELECTION  # cacheclip's selection ("aux": the paper's aux selection)
    min_recompute_tokens: int = MIN_RECOMPUTE_TOKENS  # cacheclip's short-prompt floor (RequestOptions')
    max_queue: int = 8
    max_queued_per_client: int | None = None  # one key's, and one address's (default: half of max_queue, >= 1; 0: none)
    max_batch: int = 8  # running requests whose decode steps run as one forward
    max_body_bytes: int = 8 << 20  # refused while reading (413)
    max_prompt_chars: int | None = None  # refused before tokenizing (default: 16 characters a context token)
    max_ingest_documents: int = 256
    max_document_chars: int = 65536
    max_system_chars: int = 16384
    body_timeout_s: float = 30.0  # between two parts of a body (408)
    header_timeout_s: float = 10.0  # to send a request's headers (`serve`: the connection is closed)
    max_connections: int = 256  # open connections and running tasks (`serve`: beyond it, 503)
    max_connections_per_client: int = 64  # open connections from one address (`serve`: beyond it, 503; 0: none)
    timeout_s: float = 600.0
    default_max_tokens: int = 256
    index_refresh_s: float = 2.0  # how often new texts in the store are indexed for recognition

    def __post_init__(self) -> None:
        RequestOptions(method=self.method, ratio=self.ratio, selection=self.selection,
                       min_recompute_tokens=self.min_recompute_tokens)  # a clear error for a bad default
        if self.max_queue < 1 or self.max_batch < 1 or self.max_body_bytes < 1024 or not self.timeout_s > 0:
            raise ValueError("max_queue >= 1, max_batch >= 1, max_body_bytes >= 1 KiB and timeout_s > 0 are required")
        if self.api_keys and self.tenant_keys:
            raise ValueError("give API keys either as api_keys (one tenant) or as tenant_keys, not both")
        if self.max_connections_per_client < 0 or (self.max_queued_per_client or 0) < 0:
            raise ValueError("the per-client limits must be >= 0 (0: no limit)")
        limits = (self.max_ingest_documents, self.max_document_chars, self.max_system_chars, self.max_connections)
        if min(limits) < 1 or not self.body_timeout_s > 0 or not self.header_timeout_s > 0:
            raise ValueError("the ingest limits, max_connections and the timeouts must be positive")

    @property
    def queued_per_client(self) -> int:
        return max(1, self.max_queue // 2) if self.max_queued_per_client is None else self.max_queued_per_client

    @property
    def keys(self) -> dict[str, Tenant]:
        return dict(self.tenant_keys) or {key: OPERATOR for key in self.api_keys}


class Server:
    """The engine behind the HTTP routes: tenants and their recognition index, worker, metrics."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.tenants = Tenants(engine, settings.keys, settings.index_refresh_s)
        self.worker = Worker(settings.max_queue, settings.max_batch)
        self.slots = ClientSlots(settings.queued_per_client)
        self.metrics = Metrics()
        # read from the worker at each scrape: true whatever ended a request (finished, cancelled, a client gone,
        # timed out); a gauge set on events stayed at 1-3 for minutes after dropped streams
        self.metrics.queue_depth.set_function(lambda: self.worker.depth)
        self.metrics.batched_steps.set_function(lambda: self.worker.batched_steps)
        self.metrics.batched_rows.set_function(lambda: self.worker.batched_requests)
        self.created = int(time.time())
        self.max_prompt_chars = settings.max_prompt_chars or 16 * engine.primary.max_context

    def authorise(self, request: Request) -> Tenant:
        """The tenant of the request's key (every key compared, so the time says nothing of which matched)."""
        keys = self.tenants.keys
        if not keys:
            return OPERATOR
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        found = None
        for key, tenant in keys.items():
            if hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode("utf-8")):
                found = tenant
        if found is None:
            raise APIError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")
        return found

    async def body(self, request: Request) -> dict:
        """The JSON body, refused while reading past `max_body_bytes` (413) or when a part is slower than
        `body_timeout_s` (408); parsed off the event loop."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            raise APIError(413, f"the request body is over {self.settings.max_body_bytes} bytes")
        raw, parts = bytearray(), request.stream().__aiter__()
        while True:
            try:
                part = await asyncio.wait_for(parts.__anext__(), self.settings.body_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body stalled for over {self.settings.body_timeout_s:g} s") from None
            raw += part
            if len(raw) > self.settings.max_body_bytes:
                raise APIError(413, f"the request body is over {self.settings.max_body_bytes} bytes")
        return await asyncio.to_thread(parse_json, bytes(raw))

    def check_prompt_size(self, texts: list[str]) -> None:
        """A prompt whose characters alone exceed what the context could hold is refused before it is
        tokenized (tokenizing megabytes would cost seconds of CPU)."""
        size = sum(len(t) for t in texts)
        if size > self.max_prompt_chars:
            raise APIError(400, f"the prompt's {size} characters are over this server's {self.max_prompt_chars} "
                           f"(the model's context is {self.engine.primary.max_context} tokens)", "messages",
                           "context_length_exceeded")

    def limit_tokens(self, planned: Planned) -> Planned:
        """max_tokens within the context (a request asking for more than fits is refused, named); the ids."""
        lm = self.engine.primary
        if planned.plan is None:  # tokenized once, here: the worker's full prefill takes these ids
            planned = replace(planned, prompt_ids=tuple(lm.encode_prefix(planned.prompt)))
        prompt_tokens = planned.plan.length if planned.plan is not None else len(planned.prompt_ids)
        room = lm.max_context - prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt's {prompt_tokens} tokens fill the model's context of {lm.max_context}",
                           "messages", "context_length_exceeded")
        if planned.options.max_new_tokens > room:
            raise APIError(400, f"max_tokens={planned.options.max_new_tokens} with a {prompt_tokens}-token prompt exceeds "
                           f"the model's context of {lm.max_context}", "max_tokens", "context_length_exceeded")
        return planned

    def start(self, engine: Engine, planned: Planned):
        if planned.plan is None:
            return lambda: engine.complete(planned.prompt_ids or planned.prompt, planned.options)
        return lambda: engine.run_plan(planned.plan, planned.options)

    def client(self, request: Request) -> tuple[str, ...]:
        """The names a request's queue slots are counted under: its key (where keys are in use), its address."""
        header = request.headers.get("authorization", "") if self.tenants.keys else ""
        return ClientSlots.names(header[7:].strip() or None, request.client.host if request.client else None)

    async def run(self, engine: Engine, planned: Planned, request: Request) -> tuple[Job, AsyncIterator[str]]:
        client = self.client(request)
        if not self.slots.take(client):
            raise APIError(429, f"this client already has {self.slots.per_client} requests waiting or running, the "
                           "most one API key or address may have; send the next when one ends",
                           kind="rate_limit_error", code="client_queue_full", headers={"Retry-After": "1"})
        job = Job(self.start(engine, planned), asyncio.get_running_loop(), self.settings.timeout_s,
                  on_end=lambda: self.slots.give(client))
        try:
            self.worker.submit(job)
        except QueueFull as err:
            self.slots.give(client)
            raise APIError(429, str(err), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(err.retry_after_s)}) from None
        disconnected = request.is_disconnected

        async def pieces() -> AsyncIterator[str]:
            try:
                while True:
                    item = await job.out.get()
                    if item is DONE:
                        break
                    if await disconnected():
                        job.cancel()
                    yield item
                if job.error is not None:
                    raise job.error
            finally:
                job.cancel()  # a closed stream (client gone) stops the decode

        return job, pieces()

    def usage(self, planned: Planned, answer: Answer | None) -> dict:
        prompt_tokens, completion = (answer.prompt_tokens, len(answer.token_ids)) if answer else (0, 0)
        recomputed, reused = (answer.recomputed_tokens, answer.reused_tokens) if answer else (0, 0)
        timings = answer.timings.as_dict() if answer else {}
        if answer:
            self.metrics.ttft.labels(planned.options.method if planned.plan is not None else "full").observe(
                answer.timings.ttft_s)
            self.metrics.tokens.labels("reused").inc(reused)
            self.metrics.tokens.labels("computed").inc(prompt_tokens - reused)
            self.metrics.observe_store(answer.timings.store)
            self.metrics.recognised.inc(planned.chunks_recognised)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": reused},
                "cacheclip": {"method": planned.options.method if planned.plan is not None else "full",
                              "ratio": answer.ratio if answer and planned.plan is not None else planned.options.ratio,
                              "selection": planned.options.selection, "aux_share": planned.options.aux_share,
                              # the old spelling of the selection (deprecated, HTTP only): the aux's share, or null
                              "requery": planned.options.aux_share if planned.options.selection == "question" else None,
                              "chunks_recognised": planned.chunks_recognised,
                              "reused_tokens": reused, "recomputed_chunk_tokens": recomputed if planned.plan else 0,
                              "recognise_s": planned.recognise_s, "timings": timings}}

    def finish_reason(self, planned: Planned, answer: Answer | None) -> str:
        if answer is None:
            return "stop"
        ended = answer.token_ids and answer.token_ids[-1] in self.engine.primary.eos_token_ids
        return "length" if len(answer.token_ids) >= planned.options.max_new_tokens and not ended else "stop"


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    server = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.close()

    app = FastAPI(title="cacheclip", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        server.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:  # nothing internal reaches the client
        server.metrics.requests.labels(request.url.path, "500").inc()
        log.exception("internal error on %s", request.url.path, exc_info=err)
        return _error_response(APIError(500, "internal error (logged by the server)", kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}  # liveness only: nothing of the store or the traffic

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if server.tenants.keys and not server.authorise(request).admin:
            raise APIError(403, "/metrics needs an admin key", code="forbidden")
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authorise(request)
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": server.created,
                                            "owned_by": "cacheclip", "primary": engine.primary.name,
                                            "context_window": engine.primary.max_context,
                                            "system_prompt": engine.config.system_prompt}]}

    add_document_routes(app, server)

    async def respond(request: Request, engine: Engine, planned: Planned, kind: str):
        job, pieces = await server.run(engine, planned, request)
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())

        def choice(text: str | None, finish: str | None, delta: bool) -> dict:
            if kind == "chat":
                key = "delta" if delta else "message"
                body = ({"content": text} if text is not None else {}) if delta else {"role": "assistant", "content": text}
                return {"index": 0, key: body, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not request.state.stream:
            text = "".join([piece async for piece in pieces])
            server.metrics.requests.labels(request.url.path, "200").inc()
            return JSONResponse({"id": ident, "object": obj, "created": created, "model": settings.model,
                                 "choices": [choice(text, server.finish_reason(planned, job.answer), False)],
                                 "usage": server.usage(planned, job.answer)})

        async def events() -> AsyncIterator[bytes]:
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def event(payload: dict) -> bytes:
                return b"data: " + json.dumps(payload).encode() + b"\n\n"

            head = {"id": ident, "object": chunk_obj, "created": created, "model": settings.model}
            if kind == "chat":
                yield event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None, "logprobs": None}]})
            try:
                async for piece in pieces:
                    yield event({**head, "choices": [choice(piece, None, True)]})
            except Exception as err:  # noqa: BLE001 - the stream has begun: report in-band
                yield event({"error": {"message": str(err), "type": "server_error"}})
                return
            yield event({**head, "choices": [choice(None if kind == "chat" else "",
                                                    server.finish_reason(planned, job.answer), True)]})
            if request.state.include_usage:
                yield event({**head, "choices": [], "usage": server.usage(planned, job.answer)})
            else:
                server.usage(planned, job.answer)  # the metrics count it either way
            server.metrics.requests.labels(request.url.path, "200").inc()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        tenant = server.authorise(request)
        parsed = chat_request(await server.body(request), (settings.model,), METHODS)
        server.check_prompt_size([m["content"] for m in parsed.messages] + list(parsed.generation.documents or ()))
        request.state.stream, request.state.include_usage = parsed.generation.stream, parsed.generation.include_usage
        scope = server.tenants.scope(tenant, parsed.generation.cache_salt)
        planned = await off_worker(lambda: server.limit_tokens(plan_chat(  # tokenizing: off the event loop
            scope, with_default_tokens(parsed), defaults)))
        return await respond(request, scope, planned, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = server.authorise(request)
        parsed = completion_request(await server.body(request), (settings.model,), METHODS)
        server.check_prompt_size([parsed.prompt, *(parsed.generation.documents or ())])
        request.state.stream, request.state.include_usage = parsed.generation.stream, parsed.generation.include_usage
        scope = server.tenants.scope(tenant, parsed.generation.cache_salt)
        planned = await off_worker(lambda: server.limit_tokens(plan_completion(
            scope, with_default_tokens(parsed), defaults)))
        return await respond(request, scope, planned, "completion")

    defaults = Defaults(settings.method, settings.ratio, settings.selection, settings.min_recompute_tokens)

    def with_default_tokens(parsed):
        if parsed.generation.max_tokens is not None:
            return parsed
        return replace(parsed, generation=replace(parsed.generation, max_tokens=settings.default_max_tokens))

    return app


def uvicorn_config(app: FastAPI, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info"):
    """uvicorn's settings for the app: the header timeout and the connections per address
    (`protocol.TimedH11Protocol`), idle keep-alive connections closed after 5 s, at most `max_connections`
    connections and tasks (then 503)."""
    import uvicorn

    from .protocol import timed_protocol

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=timed_protocol(settings.header_timeout_s, settings.max_connections_per_client),
                          timeout_keep_alive=5,
                          limit_concurrency=settings.max_connections)


def serve(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server (uvicorn) until interrupted; binds loopback unless told otherwise."""
    import uvicorn

    uvicorn.Server(uvicorn_config(create_app(engine, settings), settings, host, port)).run()


__all__ = ["ServerSettings", "create_app", "serve", "uvicorn_config"]
