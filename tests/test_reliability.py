"""The store under crashes, concurrency, growth, caps and full disks; integrity; hostile input.

Crash and concurrency checks run real processes (`tests/stress/workers.py`) on a real LMDB
directory. The 50-kill run is `bench/stress_store.py`; here a shorter one keeps the suite quick.
"""

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.load.ingest import SHARED, precompute
from cacheclip_rag.store import ChunkEntry, LMDBStore, StoreError, StoreFullError, decode_entry, entry_key
from cacheclip_rag.testing import tiny_model
from tests.conftest import exit_code_in_fork, forked, max_diff
from tests.stress.workers import FINGERPRINT, check_entry, read_all, synthetic_entry, synthetic_key, write

ROOT = Path(__file__).resolve().parents[1]


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.stress.workers", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def committed(path: Path, stop: int) -> list[int]:
    """Indices stored, each checked whole and equal to what was written."""
    with LMDBStore(path) as store:
        found = store.get_many([synthetic_key(i) for i in range(stop)], FINGERPRINT)
        assert store.verify()["quarantined"] == 0
    for i, entry in enumerate(found):
        if entry is not None:
            check_entry(i, entry)
    return [i for i, e in enumerate(found) if e is not None]


def kill_at_random(path: Path, stop: int, rng: random.Random) -> None:
    """Start a writer and SIGKILL it at a random moment once it is writing."""
    proc = worker("writer", str(path), "0", str(stop), "3")
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(rng.random() * 0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_writer_killed_at_random_leaves_only_whole_entries_and_resumes(tmp_path):
    rng = random.Random(0)
    stop, history = 800, []
    for _ in range(4):  # 50 kills: bench/stress_store.py
        kill_at_random(tmp_path, stop, rng)
        history.append(committed(tmp_path, stop))
        assert history[-1] == sorted(history[-1])
    assert len(history[-1]) > 0
    assert all(set(a) <= set(b) for a, b in zip(history, history[1:]))  # committed entries stay
    done = set(history[-1])
    with LMDBStore(tmp_path) as store:
        written = write(store, 0, stop)
    assert written == stop - len(done)  # the rerun writes only what was not committed
    assert committed(tmp_path, stop) == list(range(stop))


def test_ingest_killed_midway_resumes_without_recomputing(tmp_path):
    n = 400
    proc = worker("ingest", str(tmp_path), str(n))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill once some chunks are committed
        time.sleep(0.3)
        if (tmp_path / "data.mdb").exists():
            with LMDBStore(tmp_path) as store:
                if store.stats()["entries"] >= 5:
                    break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lm = tiny_model("llama")
    with LMDBStore(tmp_path) as store:
        stored = store.stats()["entries"] - 1  # minus the prefix entry
        assert 4 <= stored < n, stored
        calls = []
        hook = lm.model.register_forward_pre_hook(lambda *a: calls.append(1))
        texts = [f"chunk {i}: " + "the quick brown fox jumps over the lazy dog " * 8 for i in range(n)]
        try:
            keys = precompute(lm, store, texts, "Be brief.", variant=SHARED, batch_size=1, progress=False)
        finally:
            hook.remove()
        assert len(calls) == n - stored  # one forward per chunk that was not committed
        assert all(store.get(k, lm.fingerprint.digest) is not None for k in keys)


def _reader_in_fork(store: LMDBStore, stop: int, seconds: float, out) -> None:
    try:
        deadline, counts = time.monotonic() + seconds, []
        while time.monotonic() < deadline:
            counts.append(read_all(store, stop))  # the store object crossed a fork: it must reopen
        out.put(("ok", counts))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(err)))


def _start_openmp_pool() -> None:
    """Large enough that torch runs it on its OpenMP pool (the pool a forked child inherits broken)."""
    a = torch.randn(2048, 2048)
    (a @ a).clone()


def test_forked_readers_see_only_committed_entries_while_a_writer_grows_the_map(tmp_path):
    stop = 600
    store = LMDBStore(tmp_path, map_size=1 << 20)  # 1 MiB: the writer must grow it many times
    write(store, 0, 10)
    _start_openmp_pool()
    with forked(_reader_in_fork, (store, stop, 6.0), count=3) as collect:
        writer = worker("writer", str(tmp_path), "0", str(stop), "5")
        try:
            assert writer.wait(timeout=300) == 0, writer.stderr.read()
        finally:
            writer.kill()
        results = collect(timeout=120)
    assert all(kind == "ok" for kind, _ in results), results
    for _, counts in results:
        assert counts == sorted(counts) and counts[0] >= 10  # never a committed entry lost
    assert read_all(store, stop) == stop
    assert store.env.info()["map_size"] > 1 << 20
    store.close()


def _digest_in_fork(store: LMDBStore, key: bytes, out) -> None:
    entry = store.get(key, FINGERPRINT)
    out.put(hashlib.sha256(entry.keys.numpy().tobytes() + entry.values.numpy().tobytes()).hexdigest())


def test_forked_child_reads_a_large_entry_after_the_parent_used_torch_threads(tmp_path):
    """The recipe that hung every time: a large entry, the parent's OpenMP pool started, then fork.
    A child copying with a parallel torch op blocks forever on the dead pool; the store's numpy copy
    does not."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(8, 4, 4096, 64, generator=g), torch.randn(8, 4, 4096, 64, generator=g)
    entry = ChunkEntry(keys=keys, values=values, token_ids=tuple(range(4096)),
                       offsets=tuple((i, i + 1) for i in range(4096)))
    key = synthetic_key(10**6)
    with LMDBStore(tmp_path) as store:
        store.put(key, FINGERPRINT, entry)
        _start_openmp_pool()
        with forked(_digest_in_fork, (store, key), count=2) as collect:
            digests = collect(timeout=120)
    assert digests == [hashlib.sha256(keys.numpy().tobytes() + values.numpy().tobytes()).hexdigest()] * 2


def test_two_writers_at_once_are_serialised_without_loss(tmp_path):
    a = worker("writer", str(tmp_path), "0", "400", "4")
    b = worker("writer", str(tmp_path), "200", "600", "7")  # overlaps a's range
    assert a.wait(timeout=120) == 0 and b.wait(timeout=120) == 0, (a.stderr.read(), b.stderr.read())
    wrote = int(a.stdout.read().split()[-1]) + int(b.stdout.read().split()[-1])
    assert 600 <= wrote <= 800  # overlap may be written by either (same bytes), nothing lost
    assert committed(tmp_path, 600) == list(range(600))


def test_processes_opening_while_others_grow_the_map(tmp_path):
    """Readers and writers started together: each opens the store while the others grow it."""
    with LMDBStore(tmp_path, map_size=1 << 20) as store:
        write(store, 0, 5)
    procs = [worker("writer", str(tmp_path), "0", "500", "5"), worker("writer", str(tmp_path), "250", "700", "3")]
    procs += [worker("reader", str(tmp_path), "700", "4") for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-800:] for _, err in outs]
    assert committed(tmp_path, 700) == list(range(700))


def test_size_cap_gives_a_clear_error_and_keeps_everything(tmp_path):
    with LMDBStore(tmp_path, map_size=1 << 20, max_bytes=2 << 20) as store:
        written = 0
        with pytest.raises(StoreFullError, match="full"):
            while True:
                store.put(synthetic_key(written), FINGERPRINT, synthetic_entry(written))
                written += 1
        assert written > 10
        assert read_all(store, written + 1) == written  # all committed entries intact
        store.evict(max_bytes=1 << 20)  # make room, then writing works again
        store.put(synthetic_key(written), FINGERPRINT, synthetic_entry(written))
        check_entry(written, store.get(synthetic_key(written), FINGERPRINT))


def _fill_small_filesystem(path: str) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))  # a 3 MiB "disk"
    with LMDBStore(path, map_size=64 << 20) as store:
        i = 0
        try:
            while True:
                store.put(synthetic_key(i), FINGERPRINT, synthetic_entry(i))
                i += 1
        except StoreFullError as err:
            print(f"full after {i}: {err}")
            raise SystemExit(3)


def test_full_disk_gives_a_clear_error_and_loses_nothing(tmp_path):
    assert exit_code_in_fork(_fill_small_filesystem, str(tmp_path)) == 3  # StoreFullError, not a crash
    stored = committed(tmp_path, 5000)
    assert len(stored) > 10 and stored == list(range(len(stored)))


def test_eviction_drops_least_recently_used_first(tmp_path):
    with LMDBStore(tmp_path) as store:
        for i in range(6):
            store.put(synthetic_key(i), FINGERPRINT, synthetic_entry(i))
            time.sleep(0.01)
        time.sleep(0.01)
        store.get_many([synthetic_key(0), synthetic_key(1)], FINGERPRINT)  # recently used now
        sizes = {i: len(synthetic_entry(i).keys.numpy().tobytes()) * 2 for i in range(6)}
        budget = sizes[0] + sizes[1] + sizes[5] + 2000  # headers are small
        removed = store.evict(budget)
        left = {i for i in range(6) if store.contains(synthetic_key(i))}
        assert removed == 3 and left == {0, 1, 5}
        assert store.verify() == {"ok": 3, "quarantined": 0}


def test_compact_shrinks_the_file_and_keeps_entries(tmp_path):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 300)
        store.delete([synthetic_key(i) for i in range(0, 300) if i % 10])
        before, after = store.compact()
        assert after < before / 3
        assert read_all(store, 300) == 30
        write(store, 300, 310)  # still writable after the swap
        assert read_all(store, 310) == 40


def test_corrupted_entry_is_recomputed_and_the_answer_is_unchanged(make_engine, caplog):
    from tests.test_store import corrupt

    engine = make_engine(tiny_model("llama"))
    chunks = ["The ferry leaves at 7:40 every morning.", "The bakery sells out by nine."]
    options = RequestOptions(method="shared_prefix", max_new_tokens=4)
    before = engine.generate("When does the ferry leave?", chunks, options)
    for key in list(engine.store.keys()):
        corrupt(engine.store, key, "payload")
    with caplog.at_level("ERROR"):
        after = engine.generate("When does the ferry leave?", chunks, options)
    assert "quarantined" in caplog.text
    assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) == 0.0
    assert engine.store.stats()["quarantined"] >= 2


def test_read_only_store_refuses_writes_and_missing_store(tmp_path):
    with pytest.raises(StoreError, match="no store"):
        LMDBStore(tmp_path / "nothing", readonly=True)
    with LMDBStore(tmp_path) as store:
        write(store, 0, 3)
    with LMDBStore(tmp_path, readonly=True) as store:
        assert read_all(store, 3) == 3
        with pytest.raises(StoreError, match="read-only"):
            store.put(synthetic_key(9), FINGERPRINT, synthetic_entry(9))


# ---- hostile input ---------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=300)


@settings(max_examples=200, deadline=None)
@given(fingerprint=st.text(max_size=50), prefix=st.lists(st.integers(0, 1 << 20), max_size=20), text=TEXT,
       variant=st.sampled_from(["shared", "direct", "../..", "/etc"]))
def test_keys_are_fixed_size_hashes_whatever_the_text(fingerprint, prefix, text, variant):
    key = entry_key(fingerprint, prefix, text, variant)
    assert isinstance(key, bytes) and len(key) == 32
    assert key != entry_key(fingerprint, prefix, text + "x", variant)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXT, min_size=1, max_size=3))
def test_chunk_texts_never_leave_the_store_directory(tmp_path_factory, texts):
    path = tmp_path_factory.mktemp("store")
    lm = tiny_model("llama")
    with LMDBStore(path) as store:
        try:
            precompute(lm, store, texts, "Be brief.", variant=SHARED, progress=False)
        except ValueError:
            assert any(not t.strip() for t in texts)  # only empty chunks are refused
    assert sorted(p.name for p in path.iterdir()) == ["cacheclip.lock", "data.mdb", "lock.mdb"]


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=400))
def test_random_bytes_never_decode(raw):
    with pytest.raises(StoreError):
        decode_entry(raw, "m")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=TEXT, question=TEXT)
def test_hostile_text_gets_a_clear_error_or_the_full_attention_answer(make_engine, chunk, question):
    """Control characters, unicode edge cases, empty strings: a ValueError naming the problem, or the
    answer; one chunk behind the shared prefix must then equal full attention exactly."""
    engine = make_engine(tiny_model("llama"))
    options = RequestOptions(method="shared_prefix", max_new_tokens=2)
    try:
        reuse = engine.generate(question, [chunk], options)
    except ValueError as err:
        assert not chunk.strip() or not question.strip(), err
        return
    full = engine.generate(question, [chunk], RequestOptions(method="full", max_new_tokens=2))
    assert max_diff(reuse.first_logits, full.first_logits) < 1e-4


def test_edge_inputs(make_engine):
    engine = make_engine(tiny_model("llama"))
    with pytest.raises(ValueError, match="no chunks"):
        engine.generate("q?", [])
    with pytest.raises(TypeError, match="not one string"):
        engine.generate("q?", "a single string")
    with pytest.raises(ValueError, match="exceeds"):
        engine.ingest(["word " * 3000])  # longer than the tiny model's 2048 positions
    with pytest.raises(ValueError, match="ratio"):
        RequestOptions(ratio=float("nan"))
    duplicate = engine.generate("what is here?", ["same text.", "same text."], RequestOptions(method="cacheclip",
                                                                                               ratio=1.0, max_new_tokens=2))
    full = engine.generate("what is here?", ["same text.", "same text."], RequestOptions(method="full", max_new_tokens=2))
    assert max_diff(duplicate.first_logits, full.first_logits) < 1e-4
    assert engine.store.verify()["quarantined"] == 0
    assert sorted(os.listdir(engine.store.path)) == ["cacheclip.lock", "data.mdb", "lock.mdb"]
