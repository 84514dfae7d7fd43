"""Who is asking, and what their request may reuse: API keys belong to tenants, each tenant's chunks live
in its own namespace of the store, and a request is only matched against, and only reads the caches
of, its own tenant's chunks and the operator's shared corpus.

Threat model (also in the README): tenants share the model, the worker and the store's file, never an
entry. A tenant's request cannot find, read or time another tenant's chunks: a chunk the asker has not
ingested (and the operator has not shared) is computed for the asker, exactly as an unseen text is, so
`cached_tokens`, the recognised-chunk count and the time to first token are those of unseen text. What
is shared, and so observable by every tenant, is the operator's corpus (ingested with an admin key or
`cacheclip ingest`) and the load on the server (queue depth and latency under others' traffic).
`cache_salt` (the request field vLLM and TensorRT-LLM use) narrows reuse further: a salted request reads
and writes only the caches of requests with the same tenant and salt.

Keys file (JSON): {"<key>": {"tenant": "<name>", "roles": ["ingest"] | ["admin"] | []}, ...}. `ingest`
ingests into the tenant's namespace; `admin` ingests into the shared corpus and reads `/metrics`. Keys
given with `--api-key` (or none at all) are one tenant, the shared one, with both roles: a server with
one key behaves as it did before tenants existed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from ..engine.core import Engine
from .keys import SHARED, Tenant

MAX_VIEWS = 256  # (tenant, salt) engine views kept; a view is a few small objects over the shared models


def salted(tenant: Tenant, salt: str | None) -> str:
    """The namespace a request's caches live in: the tenant's, or with a salt, the tenant's and salt's."""
    if salt is None:
        return tenant.name
    return f"{tenant.name}\x01salt:{hashlib.sha256(salt.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


class Tenants:
    """The server's keys and, per (tenant, salt), an engine whose store is that namespace."""

    def __init__(self, engine: Engine, keys: dict[str, Tenant], refresh_s: float = 2.0):
        self.engine, self.keys = engine, keys
        self.index = engine.recognizer(refresh_s)  # one index; every view finds its tenant's and the corpus' chunks
        self._views: OrderedDict[str, Engine] = OrderedDict()
        self._lock = threading.Lock()

    def scope(self, tenant: Tenant, salt: str | None = None) -> Engine:
        """The engine a request of `tenant` (with `salt`) runs on: its namespace's caches (a salt reuses only
        what the same salt stored), its tenant's and the operator's chunks recognised."""
        namespace = salted(tenant, salt)
        readable = () if salt is not None else (SHARED,)
        return self.view(namespace, readable, tenant.name)

    def view(self, namespace: str, readable: tuple[str, ...] = (), owner: str | None = None) -> Engine:
        if namespace == SHARED:
            return self.engine
        with self._lock:
            if namespace in self._views:
                self._views.move_to_end(namespace)
                return self._views[namespace]
            view = self.engine.in_namespace(namespace, readable, owner)  # a salt's entries: the tenant's texts
            self._views[namespace] = view
            while len(self._views) > MAX_VIEWS:
                self._views.popitem(last=False)
            return view
