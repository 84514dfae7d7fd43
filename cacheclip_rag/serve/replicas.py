"""The OpenAI-compatible server as N replicas on Ray Serve, behind a chunk-affinity request router.

- `Front` (one deployment, Serve's HTTP ingress): reads the request, recognises the stored chunks in its prompt
  (the server's own `StoreIndex` over the shared tier's remembered texts, scoped to the key's tenant) and
  forwards the raw request, with those chunks' names and sizes, to a replica.
- `EngineReplica` (N deployments): each runs the whole existing app (`create_app`: routes, keys and tenants,
  limits, streaming) over its own engine: its own hot tiers (host memory, a local LMDB) in front of the tier
  all replicas share (Redis or an S3 bucket). It reports the chunks it holds through Serve's routing stats
  (`record_routing_stats`: a fixed-size Bloom filter, `holdings`).
- `ChunkAffinityRouter` (Serve's `RequestRouter` API): sends a request to the replica holding most of its chunk
  characters, in any order and position, skipping replicas with long queues; `PrefixAffinityRouter` is the
  policy of the routers in use today (longest prompt prefix seen), for comparison.

Routing reads only local state (the stats Serve delivers, queue lengths it caches): it never waits on a replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..engine.core import Engine, recognizer_over
from ..store.namespaced import SHARED
from .app import ServerSettings, create_app
from .holdings import HeldChunks, rank, within_queue
from .keys import OPERATOR, Tenant
from .tenants import salted

log = logging.getLogger(__name__)

RECENT = 4096  # names a router remembers sending to a replica, until its summaries cover them
STICKY_TRIES = 3  # routing attempts that offer only the best-holding replicas
RECENT_S = 2.5  # how long, in routing-stats periods (a replica's report covers them by then)
LOAD_WINDOW = 32  # requests per replica in the window the bounded-load guard counts
LOAD_BOUND = 1.5  # a replica's share of that window: at most this times the mean, at least the mean over it
PROMPTS = 256  # prompts the prefix router remembers a replica


@dataclass
class Forwarded:
    """One HTTP request on its way to a replica, with what routers read: `chunks` ((name, characters) of the
    recognised stored chunks) and `prompt` (its text, for prefix routing)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    chunks: list[tuple[bytes, int]] = field(default_factory=list)
    prompt: str = ""
    pins: list[bytes] = field(default_factory=list)  # names the replica that serves it keeps claiming (owners)


def chunk_name(namespace: str, text: str) -> bytes:
    """A stored chunk's name for routing: its text in its namespace (a tenant's chunk is not another's)."""
    return hashlib.sha256(namespace.encode("utf-8", "surrogatepass") + b"\x00" + text.encode("utf-8", "surrogatepass")).digest()


def prompt_text(body: dict) -> str:
    """What a request asks over: a completion's prompt, or a chat's messages' text, in order."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


class Recogniser:
    """The stored chunks a request holds, named per namespace, from the shared tier's remembered texts."""

    def __init__(self, store, keys: dict[str, Tenant], refresh_s: float = 2.0):
        self.index = recognizer_over(store, refresh_s)
        self.keys = keys

    def tenant(self, authorization: str) -> Tenant | None:
        if not self.keys:
            return OPERATOR
        given = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        return self.keys.get(given)  # a wrong key: routed anywhere, refused there

    def chunks(self, tenant: Tenant | None, body: dict, prompt: str) -> list[tuple[bytes, int]]:
        if tenant is None:
            return []
        salt = body.get("cache_salt")
        namespaces = [salted(tenant, salt)] if isinstance(salt, str) else list(dict.fromkeys([tenant.name, SHARED]))
        found = []
        for namespace in namespaces:
            found += [(chunk_name(namespace, prompt[m.start:m.stop]), m.stop - m.start)
                      for m in self.index.find(prompt, (namespace,))]
        for document in body.get("documents") or ():
            if isinstance(document, str):
                found.append((chunk_name(namespaces[0], document), len(document)))
        return found

    @staticmethod
    def owner_marker(tenant: Tenant | None) -> list[tuple[bytes, int]]:
        """A tenant's documents' owners are recorded by the replica that ingested them (its local tier): ingests
        and deletes carry this name, so the affinity router keeps sending them to that replica."""
        if tenant is None:
            return []
        return [(chunk_name(tenant.name, "\x00owners"), 1 << 30)]


@serve.deployment
class EngineReplica:
    """One replica: the whole server app over its own engine; the chunks it served or ingested, reported."""

    def __init__(self, build: Callable[[str], tuple[Engine, ServerSettings]], capacity: int = 20_000):
        context = serve.get_replica_context()
        self.name = getattr(context, "replica_tag", None) or str(context.replica_id.unique_id)
        engine, settings = build(self.name)
        self.store = engine.store
        self.app = create_app(engine, settings)
        self.held = HeldChunks(capacity)

    def record_routing_stats(self) -> dict:
        """What this replica holds, for the router. A memory tier in front bounds it: the names kept are as many as
        the entries it holds (less the prefix), the most recently used, as the tier keeps them (an ingest writes
        the store, not the memory tier: its chunks are not claimed)."""
        entries = getattr(self.store, "entries", None)
        if entries is not None:
            self.held.trim(entries - 1)
        return {"held": self.held.summary(), "count": len(self.held)}

    async def handle(self, request: Forwarded) -> AsyncIterator[dict | bytes]:
        """The app's answer: first {"status", "headers"}, then the body's parts as they come."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query, "headers": request.headers, "client": request.client,
                 "server": ("cacheclip-replica", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(scope, receive, messages.put))
        try:
            while True:
                getter = asyncio.ensure_future(messages.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # the app ended without finishing its answer: its error
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (b"x-cacheclip-replica", self.name.encode())]
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            self.held.pin(request.pins)
            self.held.add(name for name, _ in request.chunks if name not in request.pins)
        finally:
            gone.set()  # the client went away (or the answer is complete): the app sees a disconnect
            if not task.done():
                task.cancel()


@serve.deployment
class Front:
    """Serve's HTTP ingress: recognise, forward to the replica the router picks, stream the answer back."""

    def __init__(self, replicas, shared: str, keys: dict[str, Tenant], max_body_bytes: int = 8 << 20,
                 refresh_s: float = 2.0):
        from ..store.factory import open_shared

        self.replicas = replicas.options(stream=True, method_name="handle")
        self.recogniser = Recogniser(open_shared(shared), keys, refresh_s)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request: Request):
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return JSONResponse({"error": {"message": f"the body is over {self.max_body_bytes} bytes",
                                           "type": "invalid_request_error", "code": "body_too_large"}}, 413)
        try:
            parsed = json.loads(body) if body else {}
        except (ValueError, RecursionError):
            parsed = {}  # the replica answers the 400
        parsed = parsed if isinstance(parsed, dict) else {}
        prompt = prompt_text(parsed)
        tenant = self.recogniser.tenant(request.headers.get("authorization", ""))
        forwarded = Forwarded(request.method, request.url.path, request.url.query.encode(), list(request.headers.raw),
                              body, (request.client.host, request.client.port) if request.client else None,
                              await asyncio.to_thread(self.recogniser.chunks, tenant, parsed, prompt), prompt)
        marker: list[tuple[bytes, int]] = []
        if request.url.path.startswith(("/v1/ingest", "/v1/documents")):
            marker = self.recogniser.owner_marker(tenant)
            forwarded.chunks += marker
            forwarded.pins = [name for name, _ in marker]
        for attempt in range(3):  # a replica that died before answering: another one (nothing was sent yet)
            answer = self.replicas.remote(forwarded)
            try:
                head = await answer.__anext__()
                break
            except Exception as err:  # noqa: BLE001 - Ray's actor-died and unavailable errors
                if attempt == 2:
                    log.error("no replica answered: %s", err)
                    return JSONResponse({"error": {"message": "no replica could answer; try again",
                                                   "type": "server_error", "code": "replica_unavailable"}}, 503)
                log.warning("a replica failed before answering (%s); sending the request to another", err)

        if marker and head["status"] < 300:  # ingested or deleted: the texts are in the shared tier now, and the
            # client's next request must be recognised (the index re-reads only every `refresh_s`: a request sent
            # within it was routed blind, to any replica)
            await asyncio.to_thread(self.recogniser.index.refresh, True)

        async def rest() -> AsyncIterator[bytes]:
            async for part in answer:
                yield part

        response = StreamingResponse(rest(), status_code=head["status"])
        response.raw_headers = head["headers"]
        return response


class _Remembering(RequestRouter):
    """A router that remembers where it sent each request (`_sent`). Serve calls `on_request_routed` only under
    strict `max_ongoing_requests`; its hand-over of a chosen replica to the request is hooked as well."""

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        super()._fulfill_next_pending_request(replica, request_metadata)
        if pending is not None:
            self._sent(pending, replica.replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._sent(pending_request, replica_id)

    def _sent(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        raise NotImplementedError


class ChunkAffinityRouter(_Remembering):
    """To the replica whose fast tiers hold most of the request's chunk characters (`holdings.rank`)."""

    def initialize_state(self, imbalanced_threshold: int = 4, load_bound: float = LOAD_BOUND,
                         stats_period_s: float = 1.0) -> None:
        self.imbalance, self.load_bound = imbalanced_threshold, load_bound
        # longer, and a replica's memory tier has evicted many of the names by then (every name sent in 5 s
        # counted as held, three times what a 20-entry tier holds)
        self.recent_s = RECENT_S * stats_period_s
        self.routed: deque[ReplicaID] = deque()  # the replicas of the last requests (LOAD_WINDOW a replica)
        self.replicas = 1
        # names sent to each replica in the last RECENT_S seconds (its summaries cover them after that)
        self.recent: dict[ReplicaID, OrderedDict[bytes, float]] = {}
        self.tries: dict[int, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        forwarded = _forwarded(pending_request)
        chunks = forwarded.chunks if forwarded else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        self.replicas = max(1, len(by_id))
        summaries = {i: (r.routing_stats or {}).get("held") for i, r in by_id.items()}
        stale = time.monotonic() - self.recent_s
        for names in self.recent.values():
            while names and next(iter(names.values())) < stale:
                names.popitem(last=False)
        queues = {i: self.replica_queue_len_cache.get(i) for i in by_id}
        recent = {i: set(self.recent.get(i, ())) for i in by_id}
        order = list(by_id)
        random.shuffle(order)  # Serve takes the shortest queue of a rank, the first on a tie: ties go anywhere
        summaries = {i: summaries[i] for i in order}
        shares = Counter(i for i in self.routed if i in by_id)
        ranks = [[by_id[i] for i in group]
                 for group in rank(chunks, summaries, queues, self.imbalance, recent, shares, self.load_bound,
                                     LOAD_WINDOW * self.replicas)]
        # Serve moves to the next rank when a replica's queue length is not known in time (a busy machine misses
        # the probe's 0.1 s deadline often): the first tries offer the best rank alone, so a slow probe delays the
        # request a little instead of sending it where its chunks are not
        key = id(pending_request)
        self.tries[key] = self.tries.get(key, 0) + 1
        if len(self.tries) > 4096:
            self.tries.clear()
        return ranks[:1] if self.tries[key] <= STICKY_TRIES and ranks else ranks

    def _sent(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        self.tries.pop(id(pending_request), None)
        self.routed.append(replica_id)
        while len(self.routed) > LOAD_WINDOW * self.replicas:
            self.routed.popleft()
        forwarded = _forwarded(pending_request)
        if forwarded and forwarded.chunks:
            names = self.recent.setdefault(replica_id, OrderedDict())
            now = time.monotonic()
            for name, _ in forwarded.chunks:
                names[name] = now
                names.move_to_end(name)
            while len(names) > RECENT:
                names.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.recent.pop(replica_id, None)


class PrefixAffinityRouter(_Remembering):
    """The policy of today's routers (Ray Serve LLM's prefix-cache router, llm-d's prefix scorer): the replica
    that served the longest prefix of this prompt, if it covers `match_rate` of it; otherwise any balanced one."""

    def initialize_state(self, imbalanced_threshold: int = 4, match_rate: float = 0.1) -> None:
        self.imbalance, self.match_rate = imbalanced_threshold, match_rate
        self.prompts: dict[ReplicaID, OrderedDict[str, None]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        forwarded = _forwarded(pending_request)
        prompt = forwarded.prompt if forwarded else ""
        queues = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas}
        within = set(within_queue(list(queues), queues, self.imbalance))
        balanced = [r for r in candidate_replicas if r.replica_id in within]
        best, chosen = 0, []
        for r in balanced:
            length = max((len(os.path.commonprefix((prompt, p))) for p in self.prompts.get(r.replica_id, ())),
                         default=0)
            if length > best:
                best, chosen = length, [r]
            elif length == best and length:
                chosen.append(r)
        if prompt and best >= self.match_rate * len(prompt):
            return [chosen, [r for r in candidate_replicas if r not in chosen]]
        return [balanced or candidate_replicas]

    def _sent(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        forwarded = _forwarded(pending_request)
        if forwarded and forwarded.prompt:
            seen = self.prompts.setdefault(replica_id, OrderedDict())
            seen[forwarded.prompt] = None
            while len(seen) > PROMPTS:
                seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prompts.pop(replica_id, None)


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    """The request's `Forwarded`, read by its fields: Serve unpickles the front's deployment class by value, so
    its `Forwarded` is not this module's class object (an `isinstance` check failed every time, and the routers
    routed blind)."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    if isinstance(getattr(arg, "chunks", None), list) and isinstance(getattr(arg, "prompt", None), str):
        return arg
    return None


@dataclass
class ConfiguredReplica:
    """`cacheclip serve --replicas`: each replica's engine from `config`, its local store a folder of its own
    below `config.store_path`."""

    config: object  # EngineConfig
    settings: ServerSettings

    def __call__(self, name: str) -> tuple[Engine, ServerSettings]:
        from dataclasses import replace
        from pathlib import Path

        path = Path(self.config.store_path) / "replicas" / name.replace("#", "_")
        return Engine.from_config(replace(self.config, store_path=path)), self.settings


ROUTERS = {"affinity": ChunkAffinityRouter, "prefix": PrefixAffinityRouter, "pow2": None}


def application(build: Callable[[str], tuple[Engine, ServerSettings]], shared: str, replicas: int,
                keys: dict[str, Tenant] | None = None, router: str = "affinity", stats_period_s: float = 1.0,
                imbalanced_threshold: int = 4, replica_cpus: float = 1.0, load_bound: float = LOAD_BOUND):
    """The Serve application: `Front` over `replicas` × `EngineReplica` (`build(name)` makes each one's engine and
    settings), routed by `router` ("affinity", "prefix", or "pow2": Serve's default power of two choices). Each
    replica asks Ray for `replica_cpus` CPUs (0: as many replicas as asked on any machine, sharing its cores)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    from ray.serve.config import RequestRouterConfig

    options: dict = {"num_replicas": replicas, "max_ongoing_requests": 16, "ray_actor_options": {"num_cpus": replica_cpus}}
    config = {"request_routing_stats_period_s": stats_period_s, "request_routing_stats_timeout_s": 5.0}
    if ROUTERS[router] is not None:
        kwargs: dict = {"imbalanced_threshold": imbalanced_threshold}
        if router == "affinity":
            kwargs.update(load_bound=load_bound, stats_period_s=stats_period_s)
        config.update(request_router_class=ROUTERS[router], request_router_kwargs=kwargs)
    options["request_router_config"] = RequestRouterConfig(**config)
    front = Front.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    return front.bind(EngineReplica.options(**options).bind(build), shared, dict(keys or {}))
