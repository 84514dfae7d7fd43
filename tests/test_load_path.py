"""The load path: entries decoded straight into the blended cache (one copy, dtype converted on the way),
integrity checked once per stored version in a process, the host tier, and layer-wise loading's order."""

import hashlib

import pytest
import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.store import (FP8, ChunkEntry, LMDBStore, as_stored, decode_entry, encode_entry, entry)
from cacheclip_rag.testing import tiny_model
from cacheclip_rag.store.tiers import HostTier
from tests.conftest import CHUNKS, QUESTION, forked, max_diff

FP = "model-a"


def random_entry(tokens=9, layers=3, heads=2, dim=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ChunkEntry(torch.randn(layers, heads, tokens, dim, generator=g).to(dtype),
                      torch.randn(layers, heads, tokens, dim, generator=g).to(dtype),
                      tuple(range(tokens)), tuple((i, i + 1) for i in range(tokens)))


def strided_slot(entry: ChunkEntry, dtype: torch.dtype, at: int = 5, capacity: int = 40):
    """A chunk's place in a [L, B, KV, N, D] buffer, as the blended cache hands it out (not contiguous)."""
    layers, heads, tokens, dim = entry.keys.shape
    buffers = [torch.full((layers, 2, heads, capacity, dim), 7.0, dtype=dtype) for _ in range(2)]
    return buffers, (buffers[0][:, 1, :, at:at + tokens], buffers[1][:, 1, :, at:at + tokens])


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16])
def test_read_into_decodes_into_a_strided_slot_as_decode_then_convert_would(tmp_path, stored, target):
    original = random_entry()
    kept = as_stored(original, stored)
    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, kept)
        reference = decode_entry(encode_entry(FP, kept, b"k"), FP, key=b"k")  # in its decoded dtype
        buffers, slot = strided_slot(original, target)
        (got,) = store.read_into([b"k"], FP, [slot])
    assert got.keys is slot[0] and got.token_ids == original.token_ids
    torch.testing.assert_close(slot[0], reference.keys.to(target), rtol=0, atol=0)  # torch's rounding, bit for bit
    torch.testing.assert_close(slot[1], reference.values.to(target), rtol=0, atol=0)
    untouched = torch.ones_like(buffers[0], dtype=torch.bool)
    untouched[:, 1, :, 5:5 + original.num_tokens] = False
    assert bool((buffers[0][untouched] == 7.0).all()) and bool((buffers[1][untouched] == 7.0).all())


def test_read_into_allocates_no_tensor_of_its_own(tmp_path, monkeypatch):
    """One copy: the page view is decoded into the slot, never into an entry tensor first."""
    original = random_entry(dtype=torch.float16)
    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, original)
        monkeypatch.setattr(entry, "tensor_from_payload", lambda *a, **k: pytest.fail("decoded into its own tensor"))
        _, slot = strided_slot(original, torch.float32)
        assert store.read_into([b"k"], FP, [slot])[0] is not None
    torch.testing.assert_close(slot[0], original.keys.float(), rtol=0, atol=0)


def test_an_entry_that_does_not_fit_its_slot_is_quarantined(tmp_path):
    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, random_entry(tokens=9))
        _, slot = strided_slot(random_entry(tokens=8), torch.float32)
        assert store.read_into([b"k"], FP, [slot]) == [None]
        assert store.quarantined() == [b"k"]


def counting_checksums(monkeypatch) -> list[int]:
    calls = []
    real = entry._checksum

    def counted(header, payload):
        calls.append(len(payload))
        return real(header, payload)

    monkeypatch.setattr(entry, "_checksum", counted)
    return calls


def test_integrity_is_checked_once_per_stored_version_in_a_process(tmp_path, monkeypatch):
    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, random_entry(seed=1))
        calls = counting_checksums(monkeypatch)
        for _ in range(3):
            assert store.get(b"k", FP) is not None
        _, slot = strided_slot(random_entry(), torch.float32)
        store.read_into([b"k"], FP, [slot])
        assert len(calls) == 1  # the first read alone
        store.put(b"k", FP, random_entry(seed=2))  # a new version of the entry: checked on its first read
        written = len(calls)  # the writer computed its checksum
        assert torch.equal(store.get(b"k", FP).keys, random_entry(seed=2).keys)
        store.get(b"k", FP)
        assert len(calls) == written + 1
        assert store.verify() == {"ok": 1, "quarantined": 0} and len(calls) == written + 2  # verify always checks
    with LMDBStore(tmp_path) as again:  # another open (another process): checked again on first read
        again.get(b"k", FP)
        assert len(calls) == written + 3


def test_a_damaged_rewrite_after_a_verified_read_is_still_caught(tmp_path):
    from tests.test_store import corrupt

    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, random_entry())
        assert store.get(b"k", FP) is not None  # verified
        corrupt(store, b"k", "payload")  # new bytes written (same header, same checksum field)
        assert store.get(b"k", FP) is None and store.quarantined() == [b"k"]


@pytest.mark.parametrize("damage", ["nan", "zero keys"])
def test_values_no_reader_would_accept_are_refused_at_write(tmp_path, damage):
    bad = random_entry()
    if damage == "nan":
        bad.values[0, 0, 0, 0] = float("nan")
    else:
        bad.keys.zero_()
    with LMDBStore(tmp_path) as store:
        with pytest.raises(ValueError, match="refusing to store"):
            store.put(b"k", FP, bad)
        assert not store.contains(b"k")


def test_reads_onto_a_non_cpu_device_take_the_device_path(tmp_path):
    """A read onto any device but the CPU (the model's device on a GPU) went through code that raised
    NameError; the meta device takes that path here."""
    with LMDBStore(tmp_path) as store:
        store.put(b"k", FP, random_entry(dtype=torch.float16))
        store.put(b"q", FP, as_stored(random_entry(), FP8))
        for key in (b"k", b"q"):
            got = store.get(key, FP, device="meta")
            assert got.keys.device.type == "meta" and got.keys.shape == (3, 2, 9, 16)
        meta = torch.empty(3, 2, 9, 16, device="meta")
        assert store.read_into([b"k"], FP, [(meta, meta.clone())])[0].keys.device.type == "meta"


def _read_into_in_fork(store: LMDBStore, key: bytes, out) -> None:
    big, other = torch.empty(8, 4, 4096, 64), torch.empty(8, 4, 4096, 64)  # no torch copy here: it would hang
    store.read_into([key], FP, [(big, other)])
    out.put(hashlib.sha256(big.numpy().tobytes()).hexdigest())


def test_forked_child_decodes_and_converts_a_large_entry_after_the_parent_used_torch_threads(tmp_path):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(8, 4, 4096, 64, generator=g).half()
    stored = ChunkEntry(keys, keys.clone(), tuple(range(4096)), tuple((i, i + 1) for i in range(4096)))
    with LMDBStore(tmp_path) as store:
        store.put(b"big", FP, stored)
        a = torch.randn(2048, 2048)
        (a @ a).clone()  # the parent's OpenMP pool is up: a child using it would hang
        with forked(_read_into_in_fork, (store, b"big"), count=2) as collect:
            digests = collect(timeout=120)
    assert digests == [hashlib.sha256(keys.float().numpy().tobytes()).hexdigest()] * 2


# ---- the host tier -------------------------------------------------------------------------------


def test_host_tier_holds_entries_in_the_requested_dtype_and_serves_them(tmp_path):
    entries = {bytes([i]): random_entry(seed=i, dtype=torch.float16) for i in range(3)}
    with LMDBStore(tmp_path) as store:
        for k, e in entries.items():
            store.put(k, FP, e)
        tier = HostTier(store, max_bytes=2 * random_entry().nbytes, pin=False)  # two float32 entries
        for rounds in range(2):
            for k, e in list(entries.items())[:2]:
                _, slot = strided_slot(e, torch.float32)
                assert tier.read_into([k], FP, [slot])[0] is not None
                torch.testing.assert_close(slot[0], e.keys.float(), rtol=0, atol=0)
        assert (tier.hits, tier.misses) == (2, 2) and tier.bytes == 2 * random_entry().nbytes
        held = tier._lru.lookup([b"\x00"], FP)[0]
        assert held.keys.dtype == torch.float32  # converted once, when it was read in
        _, slot = strided_slot(entries[b"\x02"], torch.float32)
        tier.read_into([b"\x02"], FP, [slot])  # evicts the least recently used
        assert tier.bytes <= tier.max_bytes and len(tier._lru) == 2
        tier.put(b"\x00", FP, random_entry(seed=9, dtype=torch.float16))  # an overwrite is not served stale
        _, slot = strided_slot(random_entry(), torch.float32)
        tier.read_into([b"\x00"], FP, [slot])
        torch.testing.assert_close(slot[0], random_entry(seed=9, dtype=torch.float16).keys.float())


def test_engine_with_a_host_tier_answers_as_without_and_counts_host_reads(tmp_path):
    lm = tiny_model("gemma3")
    plain = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path / "a"),
                   config=EngineConfig(store_path=tmp_path / "a", system_prompt="Be brief."))
    tiered = Engine(primary=lm, aux=lm, store=HostTier(LMDBStore(tmp_path / "b"), 1 << 30),
                    config=EngineConfig(store_path=tmp_path / "b", system_prompt="Be brief."))
    for method in ("shared_prefix", "cacheclip", "cacheblend", "ape"):
        options = RequestOptions(method=method, ratio=0.3, max_new_tokens=3)
        want = plain.generate(QUESTION, CHUNKS, options)
        for _ in range(2):
            got = tiered.generate(QUESTION, CHUNKS, options)
            assert got.token_ids == want.token_ids and max_diff(got.first_logits, want.first_logits) == 0.0
    assert got.timings.store["host_hits"] >= len(CHUNKS) and got.timings.store.get("lmdb_hits", 0) == 0
    assert EngineConfig(host_cache_bytes=1 << 20).host_cache_bytes == 1 << 20
    with pytest.raises(ValueError, match="host_cache_bytes must be >= 0"):
        EngineConfig(host_cache_bytes=-1)


# ---- layer-wise loading --------------------------------------------------------------------------


class LoggingStream:
    """Runs work at once, as a CUDA stream would in order, and logs what the loader and the
    recompute did, so the order is checked here; `seen` records layers the recompute used."""

    def __init__(self, log: list):
        self.log = log
        self.done: set[int] = set()

    def run(self, work):
        self.log.append(("work",))
        work()

    def record(self, layer: int) -> None:
        self.log.append(("record", layer))
        self.done.add(layer)

    def wait(self, layer: int) -> None:
        assert layer in self.done, f"layer {layer} used before its copies were queued"
        self.log.append(("wait", layer))


def plain_and_layered(lm, tmp_path) -> tuple[Engine, Engine, list]:
    """An engine over LMDB, and one over a host tier whose layer-wise loads log into the returned list."""
    plain = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path / "a"),
                   config=EngineConfig(store_path=tmp_path / "a", system_prompt="Be brief."))
    events: list = []
    layered = Engine(primary=lm, aux=lm, store=HostTier(LMDBStore(tmp_path / "b"), 1 << 30, pin=False),
                     config=EngineConfig(store_path=tmp_path / "b", system_prompt="Be brief."),
                     layer_stream=lambda model: LoggingStream(events))
    return plain, layered, events


@pytest.mark.parametrize("arch", ["gemma3", "llama3_scaled"])
@pytest.mark.parametrize("method", ["shared_prefix", "cacheclip", "ape"])
def test_layerwise_loading_waits_per_layer_and_builds_the_same_cache(tmp_path, arch, method):
    lm = tiny_model(arch)
    plain, layered, events = plain_and_layered(lm, tmp_path)
    options = RequestOptions(method=method, ratio=0.3, max_new_tokens=4, min_recompute_tokens=0)
    for _ in range(2):  # a miss (computed and held), then a hit
        events.clear()
        want, got = plain.generate(QUESTION, CHUNKS, options), layered.generate(QUESTION, CHUNKS, options)
        assert got.token_ids == want.token_ids and max_diff(got.first_logits, want.first_logits) == 0.0
        layers = lm.config.num_hidden_layers
        records = [e[1] for e in events if e[0] == "record"]
        assert records == list(range(layers))  # every layer queued, in order, once
        waits = [e[1] for e in events if e[0] == "wait"]
        first_waits = list(dict.fromkeys(waits))
        assert first_waits == list(range(layers))  # the recompute meets the layers in order
        assert events.index(("wait", 0)) > events.index(("record", 0))


def test_a_tenants_view_of_a_host_tier_loads_layer_by_layer_from_its_own_namespace(tmp_path):
    """Layer-wise loading was chosen by `isinstance(store, HostTier)`, so a server tenant's view (a
    `NamespacedStore` over the host tier) loaded whole entries; it is now a property of the store, which
    the view passes through, and the view's host reads stay in its namespace."""
    from cacheclip_rag.store.namespaced import NamespacedStore

    lm = tiny_model("llama")
    plain, root, events = plain_and_layered(lm, tmp_path)
    tenant = root.in_namespace("tenant-a", ("",))
    assert isinstance(tenant.store, NamespacedStore) and tenant.store.layerwise
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=4, min_recompute_tokens=0)
    keys = tenant.ingest(CHUNKS, progress=False)
    want, got = plain.generate(QUESTION, CHUNKS, options), tenant.generate(QUESTION, CHUNKS, options)
    assert got.token_ids == want.token_ids and max_diff(got.first_logits, want.first_logits) == 0.0
    assert [e[1] for e in events if e[0] == "record"] == list(range(lm.config.num_hidden_layers))
    fingerprint = lm.fingerprint.digest
    shapes = [tuple(e.keys.shape) for e in tenant.store.get_many(keys, fingerprint)]
    assert all(e is not None for e in tenant.store.host_entries(keys, fingerprint, shapes, lm.dtype))
    other = root.in_namespace("tenant-b")  # the same chunk keys read nothing of tenant-a's, held or stored
    assert all(e is None for e in other.store.host_entries(keys, fingerprint, shapes, lm.dtype))
