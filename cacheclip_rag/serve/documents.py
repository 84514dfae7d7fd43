"""The routes that change what a tenant has stored: `/v1/ingest` (documents in, each under an id) and the
deletes (`DELETE /v1/documents/{id}`, `POST /v1/documents/delete`), with their bounds, checked in
milliseconds before any compute."""

from __future__ import annotations

import hashlib

from fastapi import FastAPI, Request

from ..stages.load.ingest import FormattedPrefix
from .keys import Tenant
from .layouts import system_head
from .requests import APIError, check_fields
from ..engine.scheduler import off_worker

MAX_ID_CHARS = 256


def document_id(text: str) -> str:
    """A document's id when the client names none: the sha256 of its text (what a client can compute)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_ids(value, name: str, count: int | None, nullable: bool = False) -> list:
    """A list of ids (1-256 printable characters; None where `nullable`), `count` long when given."""
    if value is None:
        return []
    if not isinstance(value, list) or (count is not None and len(value) != count):
        raise APIError(400, f"'{name}' must be a list of strings" + (f", one per document ({count})" if count else ""), name)
    if count is None and len(value) > 4096:
        raise APIError(413, f"'{name}' holds {len(value)} ids, over the limit of 4096 a request", name)
    for i, one in enumerate(value):
        if one is None and nullable:
            continue
        if not isinstance(one, str) or not 0 < len(one) <= MAX_ID_CHARS or not one.isprintable():
            raise APIError(400, f"{name}[{i}] must be 1-{MAX_ID_CHARS} printable characters", f"{name}[{i}]")
    return value


def check_ingest(settings, body: dict) -> tuple[list[str], str | None, list[str], list[str | None] | None]:
    """`/v1/ingest`'s body within its limits, refused in milliseconds, before any compute: the documents,
    the system text, each document's id (default: the sha256 of its text) and group."""
    check_fields(body, {"documents", "system", "ids", "groups"})
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise APIError(400, "'documents' must be a non-empty list of strings", "documents")
    if len(documents) > settings.max_ingest_documents:
        raise APIError(413, f"'documents' holds {len(documents)} texts, over the limit of "
                       f"{settings.max_ingest_documents} a request", "documents")
    for i, text in enumerate(documents):
        if len(text) > settings.max_document_chars:
            raise APIError(413, f"documents[{i}] has {len(text)} characters, over the limit of "
                           f"{settings.max_document_chars}", f"documents[{i}]")
        if "\x00" in text:
            raise APIError(400, f"documents[{i}] holds a NUL character", f"documents[{i}]")
    system = body.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise APIError(400, "'system' must be the non-empty text your system message has before the chunks", "system")
    if system is not None and len(system) > settings.max_system_chars:
        raise APIError(413, f"'system' has {len(system)} characters, over the limit of {settings.max_system_chars}", "system")
    ids = check_ids(body.get("ids"), "ids", len(documents))
    groups = body.get("groups")
    if groups is not None:
        groups = check_ids(groups, "groups", len(documents), nullable=True)
    return documents, system, ids or [document_id(d) for d in documents], groups


def add_document_routes(app: FastAPI, server) -> None:
    """Ingest and delete on `app`, over `server` (`app.Server`: its keys, tenants, settings and metrics)."""
    engine = server.engine

    @app.post("/v1/ingest")
    async def ingest(request: Request) -> dict:
        """{"documents": [...]}: each text's caches computed and stored in the key's namespace (an admin
        key's: the shared corpus), and indexed for recognition."""
        tenant = server.authorise(request)
        if not tenant.ingest:
            raise APIError(403, "this API key may not ingest (it needs the ingest role)", code="forbidden")
        documents, system, ids, groups = check_ingest(server.settings, await server.body(request))
        scope = server.tenants.scope(tenant)
        # with `system`: computed behind the exact start of the prompts that will paste them, each also as
        # the last chunk of the message (no separator after it), so the first such request reuses them
        try:
            head = FormattedPrefix(system_head(engine, system)) if system is not None else None
            keys = await off_worker(scope.ingest, documents, progress=False, system_prompt=head,
                                    bare=head is not None, owners=ids, groups=groups)
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), "system" if "shared prefix" in str(err) else "documents") from None
        added = server.tenants.index.add(tenant.name, documents)
        server.metrics.requests.labels("/v1/ingest", "200").inc()
        return {"object": "ingest", "documents": len(documents), "indexed": added, "ids": ids,
                "keys": [k.hex() for k in keys]}

    def deleter(request: Request) -> Tenant:
        tenant = server.authorise(request)
        if not tenant.ingest:
            raise APIError(403, "this API key may not delete (it needs the ingest role)", code="forbidden")
        return tenant

    async def delete(tenant: Tenant, ids: list[str], group: str | None) -> dict:
        """The key's documents under `ids` (and in `group`) forgotten: every cache computed from a text no
        other of its ids holds, the text, and its place in the recognition index, at once. Another
        tenant's id is an unknown one here (its owners live in that tenant's namespace): same answer."""
        scope = server.tenants.scope(tenant)

        def forget() -> int:
            deleted = scope.release(ids, group)
            server.tenants.index.refresh(force=True)  # the tombstones: no prompt finds the texts from now on
            return deleted

        deleted = await off_worker(forget)
        server.metrics.requests.labels("/v1/documents", "200").inc()
        return {"object": "documents.deleted", "ids": ids, "group": group, "deleted_entries": deleted}

    @app.post("/v1/documents/delete")
    async def delete_documents(request: Request) -> dict:
        """{"ids": [...]} and/or {"group": "..."}: as `DELETE /v1/documents/{id}`, for many."""
        tenant = deleter(request)
        body = await server.body(request)
        check_fields(body, {"ids", "group"})
        ids = check_ids(body.get("ids", []), "ids", None)
        group = body.get("group")
        if group is not None:
            check_ids([group], "group", 1)
        if not ids and group is None:
            raise APIError(400, "give 'ids' (a list of document ids) or 'group'", "ids")
        return await delete(tenant, ids, group)

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(request: Request, doc_id: str) -> dict:
        tenant = deleter(request)
        check_ids([doc_id], "id", 1)
        return await delete(tenant, [doc_id], None)
