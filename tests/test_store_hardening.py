"""The store tried as an attacker and an unlucky operator would: threads during map growth, damaged
and truncated files, dead readers, maintenance beside live processes, entries that lie, foreign and
read-only stores, full disks, and bad arguments. Scenarios that crashed the process (segfault,
SIGBUS) run in a child process, so a regression is one failing test, not a dead test run."""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.store import (FORMAT_VERSION, ChunkEntry, LMDBStore, StoreError, StoreFullError, _checksum,
                                 encode_entry)
from cacheclip_rag.testing import tiny_model
from tests.conftest import exit_code_in_fork, max_diff
from tests.stress.workers import FINGERPRINT, read_all, synthetic_entry, synthetic_key, write

ROOT = Path(__file__).resolve().parents[1]


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.stress.workers", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


# ---- crashes ---------------------------------------------------------------------------------


def test_threads_reading_while_another_thread_grows_the_map(tmp_path):
    """Three reader threads and a writer on one store object, 1 MiB map grown many times: segfaulted
    (exit -11) in 4 of 4 runs before the in-process lock around map resizes."""
    for run in range(3):
        code, out, err = finish(worker("threads", str(tmp_path / str(run)), "300", "3"))
        assert code == 0, (code, err[-2000:])
        assert int(out.split()[-1]) > 0


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_truncated_data_file_is_refused_on_open(tmp_path, fraction):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 200)
    data = tmp_path / "data.mdb"
    os.truncate(data, int(data.stat().st_size * fraction))
    code = ("from cacheclip_rag.store import LMDBStore, StoreError\n"
            f"try:\n    LMDBStore({str(tmp_path)!r}).verify()\nexcept StoreError as err:\n    print('refused:', err)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])  # -7 was SIGBUS
    assert "refused:" in proc.stdout and "truncated" in proc.stdout and "data.mdb" in proc.stdout


def test_readers_killed_inside_a_transaction_are_cleared(tmp_path):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 5)
    dead = []
    for _ in range(3):
        proc = worker("die-reading", str(tmp_path))
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        dead.append(proc.pid)
    with LMDBStore(tmp_path) as store:
        table = store.env.readers()
        assert not any(f" {pid} " in f" {line} " for line in table.splitlines()[1:] for pid in dead), table
        # their pinned snapshots no longer keep freed pages from reuse: rewriting stays in place
        sizes = []
        for _ in range(6):
            store.delete([synthetic_key(i) for i in range(5)])
            write(store, 0, 5)
            sizes.append((tmp_path / "data.mdb").stat().st_size)
        assert sizes[-1] == sizes[1], sizes


# ---- lost work -------------------------------------------------------------------------------


def test_compact_refuses_while_another_process_has_the_store_open(tmp_path):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 50)
    holder = worker("hold", str(tmp_path), "60")
    try:
        assert holder.stdout.readline().strip() == "ready"
        with LMDBStore(tmp_path) as store:
            with pytest.raises(StoreError, match="another process has the store open"):
                store.compact()
            assert read_all(store, 50) == 50  # refused before touching anything
    finally:
        holder.kill()
        holder.wait()
    with LMDBStore(tmp_path) as store:
        store.compact()  # alone now
        assert read_all(store, 50) == 50


def test_a_stale_compaction_folder_is_removed_on_open(tmp_path):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 3)
    (tmp_path / "compact.tmp").mkdir()
    (tmp_path / "compact.tmp" / "data.mdb").write_bytes(b"half a copy")
    with LMDBStore(tmp_path) as store:
        assert read_all(store, 3) == 3
    assert not (tmp_path / "compact.tmp").exists()


# ---- entries that lie ------------------------------------------------------------------------


def raw_entry(header: dict, payload: bytes) -> bytes:
    """An entry with a valid checksum over whatever header and payload it is given."""
    header = {**header, "checksum": _checksum(header, payload)}
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + payload


def put_raw(store: LMDBStore, key: bytes, raw: bytes) -> None:
    with store.env.begin(write=True) as txn:
        txn.put(key, raw, db=store._dbs[b"entries"])


def header_of(entry: ChunkEntry, key: bytes = b"k" * 32, **changes) -> dict:
    header = {"version": FORMAT_VERSION, "key": key.hex(), "fingerprint": FINGERPRINT, "dtype": "float32",
              "shape": list(entry.keys.shape), "token_ids": list(entry.token_ids),
              "offsets": [list(o) for o in entry.offsets]}
    header.update(changes)
    return {k: v for k, v in header.items() if v is not None}


def payload_of(keys: torch.Tensor, values: torch.Tensor) -> bytes:
    return keys.contiguous().numpy().tobytes() + values.contiguous().numpy().tobytes()


def _lies():
    e = synthetic_entry(3)
    k, v = e.keys, e.values
    nan = k.clone()
    nan[0, 0, 0, 0] = float("nan")
    inf = v.clone()
    inf[1, 1, 2, 3] = float("inf")
    good = payload_of(k, v)
    return {
        "nan keys": (header_of(e), payload_of(nan, v)),
        "inf values": (header_of(e), payload_of(k, inf)),
        "values x1e30": (header_of(e), payload_of(k, v * 1e30)),
        "all-zero keys": (header_of(e), payload_of(torch.zeros_like(k), v)),
        "rows fewer than token ids": (header_of(e, token_ids=list(e.token_ids) + [1, 2]), good),
        "shape disagrees with payload": (header_of(e, shape=[4, 2, 10, 32]), good),
        "huge declared shape": (header_of(e, shape=[100000, 64, 100000, 128]), good),
        "missing dtype": (header_of(e, dtype=None), good),
        "unknown dtype": (header_of(e, dtype="float128"), good),
        "missing offsets": (header_of(e, offsets=None), good),
        "shape not 4-d": (header_of(e, shape=[4, 2, 19 * 32]), good),
    }


LIES = _lies()


@pytest.mark.parametrize("name", list(LIES))
def test_entries_with_a_valid_checksum_but_impossible_content_are_quarantined(tmp_path, name):
    header, payload = LIES[name]
    with LMDBStore(tmp_path) as store:
        put_raw(store, b"k" * 32, raw_entry(header, payload))
        assert store.get(b"k" * 32, FINGERPRINT) is None
        assert store.quarantined() == [b"k" * 32]


def test_deeply_nested_header_is_damage_not_a_recursion_error(tmp_path):
    head = b"[" * 200_000
    with LMDBStore(tmp_path) as store:
        put_raw(store, b"k" * 32, struct.pack("<Q", len(head)) + head)
        put_raw(store, b"j" * 32, struct.pack("<Q", 1 << 60) + b"{}")  # a header length past the entry
        assert store.get_many([b"k" * 32, b"j" * 32], FINGERPRINT) == [None, None]
        assert store.verify() == {"ok": 0, "quarantined": 0}  # already quarantined by the read
        assert sorted(store.quarantined()) == [b"j" * 32, b"k" * 32]


def test_bit_flips_in_the_header_are_quarantined_not_errors_forever(tmp_path):
    """Flip every bit of the version and fingerprint fields: each damaged entry must read as missing
    (quarantined, recomputed), never as 'another model' or 'another format version'."""
    entry = synthetic_entry(1)
    raw = encode_entry(FINGERPRINT, entry, bytes(32))
    start = raw.index(b'"version"')
    stop = raw.index(b'"dtype"')
    with LMDBStore(tmp_path) as store:
        for bit in range((stop - start) * 8):
            key = bit.to_bytes(4, "big") * 8
            damaged = bytearray(encode_entry(FINGERPRINT, entry, key))  # same length: keys are 32 bytes
            damaged[start + bit // 8] ^= 1 << (bit % 8)
            put_raw(store, key, bytes(damaged))
            assert store.get(key, FINGERPRINT) is None, bit
        assert len(store.quarantined()) == (stop - start) * 8


def test_an_entry_of_another_layout_is_recomputed_and_the_answer_is_unchanged(make_engine):
    """An intact entry one layer short: shared_prefix silently dropped the last layer, cacheclip raised
    IndexError. It must be quarantined and recomputed."""
    engine = make_engine(tiny_model("llama"))
    chunks = ["The ferry leaves at 7:40 every morning.", "The bakery sells out by nine."]
    options = RequestOptions(method="shared_prefix", max_new_tokens=3)
    before = engine.generate("When does the ferry leave?", chunks, options)
    for key in list(engine.store.keys()):
        entry = engine.store.get(key, engine.primary.fingerprint.digest)
        if entry is None or entry.keys.shape[0] < 2:
            continue
        short = ChunkEntry(entry.keys[:-1].clone(), entry.values[:-1].clone(), entry.token_ids, entry.offsets)
        engine.store.put(key, engine.primary.fingerprint.digest, short)
    for method in ("shared_prefix", "cacheclip"):
        after = engine.generate("When does the ferry leave?", chunks, RequestOptions(method=method, ratio=0.0,
                                                                                     max_new_tokens=3))
        assert after.token_ids == before.token_ids and max_diff(after.first_logits, before.first_logits) < 1e-5
    assert engine.store.stats()["quarantined"] >= 3


# ---- full disks ------------------------------------------------------------------------------


def _fill_then_maintain(path: str) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with LMDBStore(path, map_size=64 << 20) as store:
        write(store, 0, 60)
        store.delete([synthetic_key(i) for i in range(0, 60, 2)])
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))  # the disk is full now
        assert read_all(store, 60) == 30  # reads work (their access-time write fails quietly)
        try:
            store.compact()
        except StoreFullError as err:
            print("full:", err)
            assert not (Path(path) / "compact.tmp").exists()
            assert read_all(store, 60) == 30
            os._exit(3)
    os._exit(0)


def test_full_disk_keeps_reads_working_and_compaction_fails_cleanly(tmp_path):
    assert exit_code_in_fork(_fill_then_maintain, str(tmp_path)) == 3
    with LMDBStore(tmp_path) as store:
        assert read_all(store, 60) == 30


# ---- foreign and read-only stores ------------------------------------------------------------


def test_another_programs_lmdb_is_refused_and_left_untouched(tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"2", b"bob", db=users)
    env.close()
    before = (tmp_path / "data.mdb").read_bytes()
    with pytest.raises(StoreError, match="another program's LMDB"):
        LMDBStore(tmp_path)
    assert (tmp_path / "data.mdb").read_bytes() == before
    env = lmdb.open(str(tmp_path), max_dbs=2)  # a key named like one of our tables, holding plain data
    with env.begin(write=True) as txn:
        txn.put(b"entries", b"not a table")
    env.close()
    with pytest.raises(StoreError, match="another program's LMDB|not a cacheclip store"):
        LMDBStore(tmp_path)


def test_read_only_media_can_be_read_without_a_lock_file(tmp_path, monkeypatch):
    with LMDBStore(tmp_path) as store:
        write(store, 0, 5)
    (tmp_path / "lock.mdb").unlink()
    (tmp_path / "cacheclip.lock").unlink()
    real_access, real_open = os.access, os.open
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK else real_access(p, mode, **kw))

    def no_create(path, flags, *args, **kwargs):
        if flags & (os.O_CREAT | os.O_RDWR | os.O_WRONLY):
            raise PermissionError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_create)
    with LMDBStore(tmp_path, readonly=True) as store:
        assert read_all(store, 5) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.mdb"]  # nothing written there


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("options,error,match", [
    (dict(max_new_tokens=1.5), TypeError, "max_new_tokens must be an integer"),
    (dict(seed=2**70), ValueError, "seed must be in"),
    (dict(seed="7"), TypeError, "seed must be an integer"),
    (dict(stop="a"), TypeError, "stop must be a tuple"),
    (dict(ratio="0.2"), ValueError, "ratio must be a number"),
])
def test_bad_request_options_name_the_argument(options, error, match):
    with pytest.raises(error, match=match):
        RequestOptions(**options)


@pytest.mark.parametrize("config,error,match", [
    (dict(ingest_batch_size=1.5), TypeError, "ingest_batch_size must be an integer"),
    (dict(window=True), TypeError, "window must be an integer"),
    (dict(system_prompt="sys \ud800"), ValueError, "system_prompt is not valid Unicode"),
])
def test_bad_engine_config_names_the_argument(config, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**config)


def test_bad_questions_and_chunks_name_the_argument(make_engine):
    engine = make_engine(tiny_model("llama"))
    with pytest.raises(ValueError, match="question is not valid Unicode"):
        engine.generate("what \udc80?", ["a chunk."])
    with pytest.raises(ValueError, match="chunk 1 is not valid Unicode"):
        engine.generate("what?", ["a chunk.", "bad \ud800 text"])
    for question in (None, b"what?"):
        with pytest.raises(TypeError, match="question must be a string"):
            engine.generate(question, ["a chunk."])
    with pytest.raises(TypeError, match="chunks must be a list or tuple"):
        engine.generate("what?", (c for c in ["a chunk."]))
    assert list(engine.store.keys()) == []  # refused before any work


def test_evict_refuses_a_negative_budget(tmp_path):
    with LMDBStore(tmp_path) as store:
        with pytest.raises(ValueError, match="max_bytes"):
            store.evict(-5)
