"""The cold tier on S3-compatible object storage, against a real S3 server process on loopback (moto's
standalone server): answers through it equal LMDB's, read-through promotion, damage quarantined and
recomputed, the server stopped and restarted (one warning, queued writes shared after), two writers of one
chunk, texts and tombstones shared between replicas."""

import logging
import threading

import pytest
import torch

pytest.importorskip("obstore")
pytest.importorskip("moto")

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.object_server import S3Server  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.store.errors import StoreError, StoreUnavailableError  # noqa: E402
from cacheclip_rag.store.factory import open_store  # noqa: E402
from cacheclip_rag.store.s3_store import S3Store  # noqa: E402
from cacheclip_rag.store.texts import text_digest  # noqa: E402
from cacheclip_rag.store.tiered_store import TieredStore  # noqa: E402
from tests.conftest import max_diff  # noqa: E402
from tests.stress.workers import FINGERPRINT, check_entry, synthetic_entry, synthetic_key  # noqa: E402
from tests.test_redis import CHUNKS, QUESTION, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    with server.environment():
        yield server
    server.stop()


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3) -> str:
    return s3.bucket(f"bucket-{next(_buckets)}")


def test_entries_round_trip_concurrently_and_a_missing_one_is_a_miss(bucket):
    with S3Store(bucket + "/ns") as store:
        store.put_many([(synthetic_key(i), FINGERPRINT, synthetic_entry(i)) for i in range(12)])
        keys = [synthetic_key(i) for i in range(13)]
        got = store.get_many(keys, FINGERPRINT)
        for i, entry in enumerate(got[:12]):
            check_entry(i, entry)
        assert got[12] is None and store.contains(keys[0]) and not store.contains(keys[12])
        assert sorted(store.keys()) == sorted(keys[:12])
        assert store.delete(keys[:3] + [keys[12]]) == 3 and store.get(keys[0], FINGERPRINT) is None


def test_answers_through_the_cold_tier_equal_lmdb_and_reads_promote_to_the_hot_tier(bucket, tmp_path):
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=4, min_recompute_tokens=0)
    reference = make_engine(LMDBStore(tmp_path / "plain"), tmp_path).generate(QUESTION, CHUNKS, options)
    writer = make_engine(open_store(tmp_path / "a", bucket + "/corpus"), tmp_path)
    writer.ingest(CHUNKS, progress=False)  # written on ingest: local tier and bucket
    assert len(list(writer.store.remote.keys())) == len(list(writer.store.local.keys())) > 0
    # another replica: an empty hot tier, the same bucket
    reader_store = open_store(tmp_path / "b", bucket + "/corpus")
    reader = make_engine(reader_store, tmp_path)
    answer = reader.generate(QUESTION, CHUNKS, options)
    assert answer.token_ids == reference.token_ids
    assert max_diff(answer.first_logits, reference.first_logits) == 0.0
    assert reader_store.remote_hits > 0 and reader_store.misses == 0  # nothing recomputed
    assert set(reader_store.remote.keys()) <= set(reader_store.local.keys())  # promoted
    hits = reader_store.remote_hits
    again = reader.generate(QUESTION, CHUNKS, options)
    assert again.token_ids == reference.token_ids and reader_store.remote_hits == hits  # now from the hot tier


def test_a_damaged_object_is_quarantined_and_recomputed_never_served(bucket, tmp_path, caplog):
    import obstore

    options = RequestOptions(method="shared_prefix", max_new_tokens=3)
    store = S3Store(bucket)
    engine = make_engine(store, tmp_path)
    before = engine.generate(QUESTION, CHUNKS, options)
    keys = list(store.keys())
    for key in keys:
        raw = bytearray(bytes(obstore.get(store.client, store._entry(key)).bytes()))
        raw[-3] ^= 0x01
        obstore.put(store.client, store._entry(key), bytes(raw))
    with caplog.at_level(logging.ERROR):
        after = engine.generate(QUESTION, CHUNKS, options)
    assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) == 0.0
    assert "quarantined" in caplog.text
    assert len(store._list("q")) == len(keys)  # moved aside, kept for inspection
    assert all(store.contains(k) for k in keys)  # written again
    third = engine.generate(QUESTION, CHUNKS, options)
    assert third.token_ids == before.token_ids and len(store._list("q")) == len(keys)  # read whole this time


def test_two_replicas_writing_one_chunk_at_once_leave_one_entry_both_served(bucket):
    stores = [S3Store(bucket) for _ in range(2)]
    key, entry = synthetic_key(7), synthetic_entry(7)
    barrier = threading.Barrier(8)

    def write(store):
        barrier.wait()
        store.put(key, FINGERPRINT, entry)

    threads = [threading.Thread(target=write, args=(stores[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(stores[0].keys()) == [key]
    for store in stores:
        check_entry(7, store.get(key, FINGERPRINT))


def test_texts_and_tombstones_reach_every_replica_in_order(bucket):
    a, b = S3Store(bucket + "/t"), S3Store(bucket + "/t")
    a.remember_texts(["one", "two"])
    b.remember_texts(["two", "three"])  # "two" is not logged twice
    texts, cursor = b.texts_since(0)
    assert texts == ["one", "two", "three"] and cursor == 3
    barrier = threading.Barrier(2)

    def append(store, words):
        barrier.wait()
        store.remember_texts(words)

    threads = [threading.Thread(target=append, args=(s, [f"{name}-{i}" for i in range(5)]))
               for s, name in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    more, cursor = a.texts_since(cursor)
    assert sorted(more) == sorted([f"a-{i}" for i in range(5)] + [f"b-{i}" for i in range(5)]) and cursor == 13
    a.forget_texts([text_digest("two")])
    assert "two" not in b.texts() and len(b.texts()) == 12
    tail, _ = b.texts_since(cursor)
    assert len(tail) == 1 and tail[0] != "two"  # a tombstone, not the words


def test_owners_need_a_local_tier_in_front(bucket):
    with pytest.raises(StoreError, match="keeps no owners"):
        S3Store(bucket).retain("doc", [b"k" * 32])
    with pytest.raises(ValueError, match="s3://bucket"):
        S3Store("s3:///nobucket")
    with pytest.raises(ValueError, match="cold tier behind a local store"):
        EngineConfig(store_path="s3://bucket/x")
    with pytest.raises(ValueError, match="redis:// or s3://"):
        EngineConfig(shared_store="ftp://x")


def test_server_stopped_and_restarted_one_warning_recompute_then_queued_writes_shared(tmp_path, caplog):
    server = S3Server()
    try:
        with server.environment():
            url = server.bucket("outage")
            options = RequestOptions(method="shared_prefix", max_new_tokens=3)
            reference = make_engine(LMDBStore(tmp_path / "plain"), tmp_path).generate(QUESTION, CHUNKS, options)
            store = TieredStore(LMDBStore(tmp_path / "local"), S3Store(url, timeout_s=1, retries=0))
            engine = make_engine(store, tmp_path)
            server.stop()
            with caplog.at_level(logging.WARNING, logger="cacheclip_rag.store.tiered_store"):
                answers = [engine.generate(QUESTION, CHUNKS, options) for _ in range(3)]
                engine.ingest(["A chunk ingested while the bucket is down."], progress=False)
            for answer in answers:  # computed locally: right, not wrong and not hung
                assert answer.token_ids == reference.token_ids
                assert torch.equal(answer.first_logits, reference.first_logits)
            down = [r for r in caplog.records if "failed" in r.getMessage()]
            assert len(down) == 1, [r.getMessage() for r in caplog.records]  # one warning for the outage
            queued = set(store.unshared)
            assert len(queued) >= len(CHUNKS) + 1
            with pytest.raises(StoreUnavailableError):
                store.remote.contains(next(iter(queued)))
            server.start()  # an empty bucket again (moto keeps objects in memory)
            server.bucket("outage")
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="cacheclip_rag.store.tiered_store"):
                engine.generate(QUESTION, CHUNKS, options)
                engine.ingest(["One more chunk, after the outage."], progress=False)
            assert any("answers again" in r.getMessage() for r in caplog.records)
            assert not store.unshared and queued <= set(store.remote.keys())  # the queued entries are shared now
    finally:
        server.stop()
