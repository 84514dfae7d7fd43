import pytest
import torch

from cacheclip_rag import store as store_mod
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.load.ingest import SHARED, chunk_key, precompute, prefix_cache
from cacheclip_rag.store import ChunkEntry, LMDBStore, StoreError, entry_key
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS


def random_entry(tokens=7, dtype=torch.float32):
    return ChunkEntry(
        keys=torch.randn(3, 2, tokens, 16).to(dtype), values=torch.randn(3, 2, tokens, 16).to(dtype),
        token_ids=tuple(range(tokens)), offsets=tuple((i, i + 1) for i in range(tokens)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    entry = random_entry(dtype=dtype)
    with LMDBStore(tmp_path) as s:
        s.put(b"k", "model-a", entry)
        got = s.get(b"k", "model-a")
    assert torch.equal(got.keys.view(torch.uint8), entry.keys.view(torch.uint8))
    assert torch.equal(got.values.view(torch.uint8), entry.values.view(torch.uint8))
    assert got.token_ids == entry.token_ids and got.offsets == entry.offsets


def test_entry_of_another_model_is_refused(tmp_path):
    with LMDBStore(tmp_path) as s:
        s.put(b"k", "model-a", random_entry())
        with pytest.raises(StoreError, match="written by model model-a"):
            s.get(b"k", "model-b")


def _encoded_as(version: int, entry: ChunkEntry, fingerprint: str, key: bytes | None = None) -> bytes:
    """An entry written by another format version: 1 (blake2b, no key) or a future one."""
    import json
    import struct

    header = {"version": version, "fingerprint": fingerprint, "dtype": str(entry.keys.dtype).removeprefix("torch."),
              "shape": list(entry.keys.shape), "token_ids": list(entry.token_ids),
              "offsets": [list(o) for o in entry.offsets]}
    if key is not None:
        header["key"] = key.hex()
    payload = entry.keys.numpy().tobytes() + entry.values.numpy().tobytes()
    header["checksum"] = store_mod._checksum(header, payload)
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + payload


def test_version_1_entries_are_still_read_and_an_unknown_version_is_refused(tmp_path):
    entry = random_entry()
    with LMDBStore(tmp_path) as s:
        with s.env.begin(write=True) as txn:
            txn.put(b"old", _encoded_as(1, entry, "m"), db=s._dbs[b"entries"])
            txn.put(b"new", _encoded_as(3, entry, "m", b"new"), db=s._dbs[b"entries"])
        got = s.get(b"old", "m")
        assert torch.equal(got.keys, entry.keys) and got.token_ids == entry.token_ids
        with pytest.raises(StoreError, match="format version 3; this library reads versions 1, 2"):
            s.get(b"new", "m")
        assert store_mod.FORMAT_VERSION == 2


def corrupt(store, key, where):
    """Flip one bit of a stored entry's payload or header, through LMDB."""
    db = store._dbs[b"entries"]
    with store.env.begin(write=True) as txn:
        raw = bytearray(txn.get(key, db=db))
        i = len(raw) - 5 if where == "payload" else raw.index(b"token_ids") + 15
        raw[i] ^= 0x10
        txn.put(key, bytes(raw), db=db)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupted_entry_is_quarantined_logged_and_never_served(tmp_path, where, caplog):
    with LMDBStore(tmp_path) as s:
        s.put(b"k", "m", random_entry())
        s.put(b"ok", "m", random_entry())
        corrupt(s, b"k", where)
        with caplog.at_level("ERROR"):
            assert s.get_many([b"k", b"ok"], "m")[0] is None
        assert "corrupted" in caplog.text and b"k".hex() in caplog.text
        assert not s.contains(b"k") and s.quarantined() == [b"k"]
        assert s.get(b"ok", "m") is not None  # the rest is untouched
        assert s.stats()["quarantined"] == 1


def test_map_grows_on_demand(tmp_path):
    with LMDBStore(tmp_path, map_size=64 * 1024) as s:
        big = random_entry(tokens=400)  # ~300 KB, far above the initial map
        for i in range(5):
            s.put(bytes([i]), "m", big)
        assert s.env.info()["map_size"] > 64 * 1024
        assert all(torch.equal(s.get(bytes([i]), "m").keys, big.keys) for i in range(5))


def test_keys_are_hashes_not_paths():
    key = entry_key("fp", [1, 2], "../../etc/passwd\x00", "shared")
    assert len(key) == 32 and b"passwd" not in key
    assert key != entry_key("fp", [1, 2], "../../etc/passwd\x00", "direct")
    assert key != entry_key("fp", [1], "2../../etc/passwd\x00", "shared")  # length-prefixed fields


def test_second_ingest_computes_nothing(tmp_path):
    lm = tiny_model("llama")
    calls = []
    lm.model.register_forward_hook(lambda *a: calls.append(1))
    with LMDBStore(tmp_path) as s:
        keys = precompute(lm, s, CHUNKS, "Be brief.", progress=False)
        assert calls and all(s.contains(k) for k in keys)
        before = {k: s.get(k, lm.fingerprint.digest).keys.clone() for k in keys}
        calls.clear()
        assert precompute(lm, s, CHUNKS, "Be brief.", progress=False) == keys
        assert calls == []
        assert all(torch.equal(before[k], s.get(k, lm.fingerprint.digest).keys) for k in keys)


def test_prefix_is_stored_once_per_model_and_prefix(tmp_path):
    lm = tiny_model("llama")
    with LMDBStore(tmp_path) as s:
        precompute(lm, s, CHUNKS, "Be brief.", progress=False)
        n = s.stats()["entries"]
        assert n == len(CHUNKS) + 1
        precompute(lm, s, CHUNKS[:1], "Another system prompt.", progress=False)
        assert s.stats()["entries"] == n + 2  # a new prefix and the chunk behind it


def test_stored_chunk_equals_its_rows_in_a_full_prefill(tmp_path):
    """The batched ingest (right-padded) stores what a plain prefill of prefix + chunk computes."""
    from cacheclip_rag.stages.load.ingest import chunk_unit, new_cache
    from cacheclip_rag.stages.recompute.forward import forward_at

    lm = tiny_model("gemma3")
    with LMDBStore(tmp_path) as s:
        precompute(lm, s, CHUNKS, "Be brief.", batch_size=3, progress=False)
        prefix = prefix_cache(lm, s, "Be brief.")
        for text in CHUNKS:
            entry = s.get(chunk_key(lm, prefix.token_ids, text, SHARED), lm.fingerprint.digest)
            ids = list(prefix.token_ids) + lm.encode(chunk_unit(lm, text))
            cache = new_cache(lm, len(ids))
            forward_at(lm.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None])
            keys, values = cache.rows(len(prefix.token_ids), len(ids))
            assert (keys - entry.keys).abs().max() < 1e-5 and (values - entry.values).abs().max() < 1e-5


def test_device_tier_is_an_lru_by_bytes_that_serves_the_same_entries(tmp_path, make_engine):
    from cacheclip_rag.store.tiers import DeviceTier

    entries = {bytes([i]): random_entry(tokens=10) for i in range(4)}
    with LMDBStore(tmp_path / "s") as s:
        for k, e in entries.items():
            s.put(k, "m", e)
        tier = DeviceTier(s, "cpu", max_bytes=2 * entries[b"\x00"].nbytes)
        got = tier.get_many([b"\x00", b"\x01"], "m")
        assert all(torch.equal(g.keys, entries[k].keys) for g, k in zip(got, [b"\x00", b"\x01"]))
        assert (tier.hits, tier.misses) == (0, 2)
        tier.get_many([b"\x00"], "m")  # 0 is now the most recent
        tier.get_many([b"\x02"], "m")  # evicts 1, the least recent
        assert (tier.hits, tier.misses) == (1, 3) and tier.bytes <= tier.max_bytes
        tier.get_many([b"\x00", b"\x01"], "m")
        assert (tier.hits, tier.misses) == (2, 4)
        with pytest.raises(StoreError, match="written by model"):
            tier.get_many([b"\x03"], "other-model")  # a resident entry never crosses models either
    lm = tiny_model("llama")
    plain = make_engine(lm)
    options = RequestOptions(method="cacheclip", max_new_tokens=3, min_recompute_tokens=0)
    answer = plain.generate("what is the magic number?", CHUNKS, options)
    plain.store = DeviceTier(plain.store, "cpu", max_bytes=1 << 30)
    for _ in range(2):
        again = plain.generate("what is the magic number?", CHUNKS, options)
        assert again.token_ids == answer.token_ids and torch.equal(again.first_logits, answer.first_logits)
    assert plain.store.hits > 0
