"""Deleting documents (issue 71): a tenant removes its own documents by the ids it ingested them under, over
a real server (uvicorn on loopback, httpx, the `openai` client's transport is not needed for routes it does
not know); the caches computed from them (at ingest and for requests), their remembered texts and their
place in the recognition index go at once, in LMDB, in Redis and in a local tier in front of Redis. Another
tenant's ids are unknown ids; deletes are idempotent."""

import json
import random

import httpx
import pytest

pytest.importorskip("fastapi")

from cacheclip_rag.cli import main as cli_main  # noqa: E402
from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.engine.recognize import StoreIndex  # noqa: E402
from cacheclip_rag.serve.client import RemoteEngine  # noqa: E402
from cacheclip_rag.serve.keys import load_keys  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.store.namespaced import NamespacedStore  # noqa: E402
from cacheclip_rag.store.tiers import HostTier  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_serve import running  # noqa: E402

A, B, READER, ADMIN = ("sk-tenant-a-" + "a" * 12, "sk-tenant-b-" + "b" * 12, "sk-reader-" + "r" * 14,
                       "sk-admin-" + "x" * 15)
WORDS = "harbour ferry tide gull lantern basalt archive piston mirror dome cliff fog rye".split()
SYSTEM = "Context:\n"


def document(i: int) -> str:
    rng = random.Random(i)
    return f"Record {i:04d}: " + " ".join(rng.choice(WORDS) for _ in range(30)) + f". Its code is {1000000 + i}."


def engine_over(store, path) -> Engine:
    lm = tiny_model("llama")
    return Engine(primary=lm, aux=lm, store=store,
                  config=EngineConfig(store_path=path, system_prompt="Be brief.", store_dtype="float32"))


@pytest.fixture
def live(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({A: {"tenant": "a", "roles": ["ingest"]}, B: {"tenant": "b", "roles": ["ingest"]},
                                READER: {"tenant": "c", "roles": []}, ADMIN: {"tenant": "ops", "roles": ["admin"]}}))
    engine = engine_over(LMDBStore(tmp_path / "store"), tmp_path / "store")
    with running(engine, tenant_keys=load_keys(keys)) as (url, server):
        yield url, engine


def post(url: str, key: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, timeout=300, headers={"Authorization": f"Bearer {key}"}, json=body)


def ask(url: str, key: str, doc: str) -> dict:
    reply = post(url, key, "/v1/chat/completions", {"model": "cacheclip", "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM + doc}, {"role": "user", "content": "Which code?"}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def reused(url: str, key: str, doc: str) -> tuple[int, int]:
    usage = ask(url, key, doc)
    return usage["cacheclip"]["chunks_recognised"], usage["prompt_tokens_details"]["cached_tokens"]


def words_in_store(store: LMDBStore, text: str) -> bool:
    """Whether any table of the LMDB file still holds the text's words (its longest line, as UTF-8)."""
    needle = text.encode()[20:80]
    with store.env.begin() as txn:
        for db in store._dbs.values():
            if db is not None and any(needle in bytes(v) for _, v in txn.cursor(db=db)):
                return True
    return False


def test_a_tenant_deletes_its_document_and_everything_computed_from_it_goes(live):
    url, engine = live
    store, doc, other = engine.store, document(1), document(2)
    before = set(store.keys())
    assert post(url, A, "/v1/ingest", {"documents": [doc, other], "ids": ["doc-1", "doc-2"], "system": SYSTEM}
                ).status_code == 200
    prefixes = set(store.keys()) - before  # the system head's caches and the two chunks' (ingest) ...
    ask(url, A, doc)  # ... and what a request computes from the chunk (its layout in this prompt)
    assert reused(url, A, doc)[1] > reused(url, A, document(99))[1]
    held = set(store.keys())

    unknown = post(url, A, "/v1/documents/delete", {"ids": ["never-ingested"]})
    as_b = post(url, B, "/v1/documents/delete", {"ids": ["doc-1"]})  # B's namespace has no doc-1
    assert unknown.status_code == as_b.status_code == 200
    assert unknown.json()["deleted_entries"] == as_b.json()["deleted_entries"] == 0
    assert set(store.keys()) == held and reused(url, A, doc)[0] == 1  # nothing of A's changed
    assert post(url, READER, "/v1/documents/delete", {"ids": ["doc-1"]}).status_code == 403

    gone = httpx.delete(url + "/v1/documents/doc-1", headers={"Authorization": f"Bearer {A}"})
    assert gone.status_code == 200 and gone.json()["deleted_entries"] >= 2
    assert reused(url, A, doc) == (0, 0)  # not recognised, nothing read: at once, no refresh wait
    assert not words_in_store(store, doc) and words_in_store(store, other)
    assert all(doc not in t for t in store.texts())
    left = set(store.keys())
    assert len(held - left) == gone.json()["deleted_entries"]
    assert reused(url, A, other)[0] == 1  # the other document is untouched
    again = post(url, A, "/v1/documents/delete", {"ids": ["doc-1"]})  # idempotent
    assert again.json()["deleted_entries"] == 0 and set(store.keys()) - left == set(store.keys()) - left
    assert prefixes <= held

    assert post(url, A, "/v1/ingest", {"documents": [doc], "ids": ["doc-1"], "system": SYSTEM}).status_code == 200
    assert reused(url, A, doc)[0] == 1  # ingested again: found again


def test_the_admin_deletes_the_operator_corpus_and_a_tenant_cannot(live):
    url, engine = live
    shared = document(7)
    reply = post(url, ADMIN, "/v1/ingest", {"documents": [shared], "system": SYSTEM})
    default_id = reply.json()["ids"][0]  # the sha256 of the text when no id is given
    assert len(default_id) == 64
    assert reused(url, A, shared)[0] == 1  # the operator's corpus serves every tenant
    assert post(url, A, "/v1/documents/delete", {"ids": [default_id]}).json()["deleted_entries"] == 0
    assert reused(url, B, shared)[0] == 1
    assert post(url, ADMIN, "/v1/documents/delete", {"ids": [default_id]}).json()["deleted_entries"] >= 1
    assert reused(url, A, shared)[0] == 0 and reused(url, B, shared)[0] == 0


def test_ids_shared_texts_and_groups(live):
    """Two ids holding one text: the caches stay until both are deleted. A group deletes all its ids."""
    url, engine = live
    doc = document(3)
    post(url, A, "/v1/ingest", {"documents": [doc, doc], "ids": ["x", "y"], "system": SYSTEM})
    assert post(url, A, "/v1/documents/delete", {"ids": ["x"]}).json()["deleted_entries"] == 0
    assert reused(url, A, doc)[0] == 1
    assert post(url, A, "/v1/documents/delete", {"ids": ["y"]}).json()["deleted_entries"] > 0
    assert reused(url, A, doc)[0] == 0
    docs = [document(i) for i in (4, 5)]
    post(url, A, "/v1/ingest", {"documents": docs, "ids": ["p", "q"], "groups": ["file.md", "file.md"]})
    assert post(url, A, "/v1/documents/delete", {"group": "file.md"}).json()["deleted_entries"] >= 2
    assert all(reused(url, A, d)[0] == 0 for d in docs)


@pytest.mark.parametrize("body, field", [({"ids": "doc"}, "ids"), ({"ids": [""]}, "ids[0]"), ({}, "ids"),
                                         ({"ids": ["a"], "extra": 1}, None), ({"group": 3}, "group[0]")])
def test_bad_deletes_are_named(live, body, field):
    reply = post(live[0], A, "/v1/documents/delete", body)
    assert reply.status_code == 400
    if field is not None:
        assert reply.json()["error"]["param"] == field


def test_the_remote_engine_and_the_cli_delete_on_the_server(live, tmp_path, capsys):
    url, engine = live
    remote = RemoteEngine(url, A)
    doc = document(11)
    remote.ingest([doc], owners=["node-1"], groups=["ref-1"])
    assert engine.store.texts() and remote.release(group="ref-1") > 0
    assert all(doc not in t for t in engine.store.texts())
    text = tmp_path / "notes.md"
    text.write_text("# Ferry\n\n" + document(12) + "\n")
    assert cli_main(["ingest", str(text), "--server", url, "--api-key", A]) == 0
    assert len(engine.store.texts()) == 1
    assert cli_main(["delete", "--file", str(text), "--server", url, "--api-key", A]) == 0
    assert engine.store.texts() == [] and "cache entries" in capsys.readouterr().out


def check_forgetting(tmp_path, redis_url=None, tiered=True):
    """Owned texts seen through a tenant's namespace: their entries (ingest's and a request's misses), words
    and index entries go with their last owner, from every tier; a second index reading the same log (as
    another replica's does) forgets them too; what nobody owns stays."""
    local = LMDBStore(tmp_path / "local")
    if redis_url is None:
        tiers, store = [local], HostTier(local, 1 << 26)
    else:
        from cacheclip_rag.store.redis_store import RedisStore, TieredStore

        remote = RedisStore(redis_url)
        tiers, store = ([local, remote], TieredStore(local, remote)) if tiered else ([remote], remote)
    tenant = engine_over(NamespacedStore(store, "t", ("",)), tmp_path / "local")
    kept = document(30)
    tenant.ingest([kept], progress=False)  # nobody's: never deleted (and it stores the prefix)
    before = [set(t.keys()) for t in tiers]
    index = StoreIndex(store, refresh_s=0.0)
    docs = [document(i) for i in (20, 21)]
    tenant.ingest(docs, owners=["one", "two"], groups=["g", None], progress=False)
    tenant.generate("Which code?", [docs[0]], RequestOptions(method="direct", max_new_tokens=1))  # a miss
    index.refresh(force=True)
    assert index.find("see " + docs[0], ("t",)) and index.find("see " + docs[1], ("t",))
    grown = [set(t.keys()) for t in tiers]
    assert all(g > b for g, b in zip(grown, before))
    assert tenant.release(group="g") > 0
    index.refresh(force=True)
    assert not index.find("see " + docs[0], ("t",)) and index.find("see " + docs[1], ("t",))
    assert docs[0] not in tenant.store.texts() and docs[1] in tenant.store.texts()
    assert tenant.release(["one"]) == 0  # idempotent
    assert tenant.release(["two"]) > 0
    assert [set(t.keys()) for t in tiers] == before  # every entry computed from the two texts, from every tier
    assert tenant.store.texts() == [kept]
    index.refresh(force=True)
    assert not index.find("see " + docs[1], ("t",)) and StoreIndex(store).find("see " + kept, ("t",))
    tenant.ingest([docs[0]], owners=["one"], progress=False)  # back again: found again
    index.refresh(force=True)
    assert index.find("see " + docs[0], ("t",))


def test_forgetting_in_lmdb_behind_a_host_tier(tmp_path):
    check_forgetting(tmp_path)


@pytest.mark.parametrize("tiered", [True, False], ids=["local-tier-in-front", "redis-alone"])
def test_forgetting_in_redis(tmp_path, tiered):
    from tests.test_redis import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    try:
        check_forgetting(tmp_path, server.tcp_url, tiered)
    finally:
        server.kill()


def test_what_salted_requests_computed_from_a_deleted_document_goes_too(live):
    """A tenant's `cache_salt` requests compute and store their own caches (per salt); they count as the
    tenant's text's, so the delete removes them as well."""
    url, engine = live
    doc, unseen = document(40), document(41)

    def salted(text: str) -> int:
        reply = post(url, A, "/v1/chat/completions", {
            "model": "cacheclip", "max_tokens": 1, "documents": [text], "cache_salt": "s1",
            "messages": [{"role": "user", "content": "Which code?"}]})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    post(url, A, "/v1/ingest", {"documents": [doc], "ids": ["salted-doc"]})
    salted(unseen)  # the salt's prefix, stored once
    prefix_only = salted(document(42))  # another unseen text: the prefix alone is read
    salted(doc)
    assert salted(doc) > prefix_only  # the salted request reads its own stored chunk
    assert post(url, A, "/v1/documents/delete", {"ids": ["salted-doc"]}).json()["deleted_entries"] > 0
    assert salted(doc) == prefix_only  # computed afresh, not read
