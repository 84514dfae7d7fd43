"""Processes that exercise the store the way deployments do, for the crash and concurrency checks.

Run from the repository root as `python -m tests.stress.workers <role> <store> [args]`:

- `writer START STOP [BATCH]`: finds which synthetic entries START..STOP-1 are not stored yet, prints
  `ready`, writes them (BATCH per transaction), and prints how many it wrote. Killed at random moments by the tests.
- `reader STOP SECONDS`: reads every synthetic key over and over for SECONDS, checking each entry it
  sees is whole and equals what the writer writes; prints entries seen per pass.
- `ingest N`: precomputes N chunks with the tiny Llama (batch 1), the real ingest path.
- `threads STOP READERS`: one store object shared by READERS reader threads and one writer thread that
  writes STOP entries into a 1 MiB map (so it grows many times under the readers); prints the reads.
- `hold SECONDS`: opens the store, prints `ready`, and keeps it open (a live server beside maintenance).
- `die-reading`: opens a read transaction, prints `ready`, and waits to be killed inside it.

Each synthetic entry is a pure function of its index, so any reader can check what it reads.
"""

from __future__ import annotations

import sys
import time

import torch

from cacheclip_rag.store import ChunkEntry, LMDBStore, entry_key

FINGERPRINT = "stress-model"


def synthetic_key(i: int) -> bytes:
    return entry_key(FINGERPRINT, (), f"synthetic chunk {i}", "shared")


def synthetic_entry(i: int) -> ChunkEntry:
    g = torch.Generator().manual_seed(i)
    tokens = 16 + i % 48
    return ChunkEntry(
        keys=torch.randn(4, 2, tokens, 32, generator=g), values=torch.randn(4, 2, tokens, 32, generator=g),
        token_ids=tuple(range(i, i + tokens)), offsets=tuple((j, j + 1) for j in range(tokens)),
    )


def check_entry(i: int, entry: ChunkEntry) -> None:
    expected = synthetic_entry(i)
    if not (torch.equal(entry.keys, expected.keys) and torch.equal(entry.values, expected.values)
            and entry.token_ids == expected.token_ids):
        raise AssertionError(f"entry {i} differs from what was written (torn or wrong read)")


def pending(store: LMDBStore, start: int, stop: int) -> list[int]:
    return [i for i in range(start, stop) if not store.contains(synthetic_key(i))]


def write_pending(store: LMDBStore, todo: list[int], batch: int = 4) -> int:
    for at in range(0, len(todo), batch):
        store.put_many([(synthetic_key(i), FINGERPRINT, synthetic_entry(i)) for i in todo[at : at + batch]])
    return len(todo)


def write(store: LMDBStore, start: int, stop: int, batch: int = 4) -> int:
    """Write the entries start..stop-1 not stored yet; returns how many were written."""
    return write_pending(store, pending(store, start, stop), batch)


def read_all(store: LMDBStore, stop: int) -> int:
    keys = [synthetic_key(i) for i in range(stop)]
    seen = 0
    for i, entry in enumerate(store.get_many(keys, FINGERPRINT)):
        if entry is not None:
            check_entry(i, entry)
            seen += 1
    return seen


def threads_growing_the_map(path: str, stop: int, readers: int) -> int:
    """Reader threads and a writer thread on one store while its map grows; returns entries read.
    Raises the first error any thread met (a torn read, a raw LMDB error)."""
    import threading

    store = LMDBStore(path, map_size=1 << 20)
    write(store, 0, 4)
    errors: list[BaseException] = []
    reads = [0] * readers
    done = threading.Event()

    def reader(n: int) -> None:
        try:
            while not done.is_set():
                reads[n] += read_all(store, stop)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    pool = [threading.Thread(target=reader, args=(n,), daemon=True) for n in range(readers)]
    for t in pool:
        t.start()
    try:
        write(store, 4, stop, batch=3)
    finally:
        done.set()
        for t in pool:
            t.join(timeout=60)
    if errors:
        raise errors[0]
    assert store.env.info()["map_size"] > 1 << 20, "the map never grew"
    assert read_all(store, stop) == stop
    store.close()
    return sum(reads)


def main(argv: list[str]) -> int:
    role, path, *rest = argv
    if role == "writer":
        start, stop, *batch = map(int, rest)
        with LMDBStore(path, map_size=1 << 20) as store:
            todo = pending(store, start, stop)
            print("ready", flush=True)  # about to write: the crash tests time their kills from here
            print(write_pending(store, todo, *batch), flush=True)
    elif role == "reader":
        stop, seconds = int(rest[0]), float(rest[1])
        with LMDBStore(path, map_size=1 << 20) as store:
            deadline, counts = time.monotonic() + seconds, []
            while time.monotonic() < deadline:
                counts.append(read_all(store, stop))
            if counts != sorted(counts):
                raise AssertionError(f"a committed entry disappeared: {counts}")
            print(" ".join(map(str, counts)), flush=True)
    elif role == "threads":
        stop, readers = int(rest[0]), int(rest[1])
        print(threads_growing_the_map(path, stop, readers), flush=True)
    elif role == "hold":
        with LMDBStore(path) as store:
            store.contains(synthetic_key(0))
            print("ready", flush=True)
            time.sleep(float(rest[0]))
    elif role == "die-reading":
        with LMDBStore(path) as store, store._transaction() as txn:
            txn.get(synthetic_key(0), db=store._dbs[b"entries"])
            print("ready", flush=True)
            time.sleep(600)
    elif role == "ingest":
        from cacheclip_rag.stages.load.ingest import SHARED, precompute
        from cacheclip_rag.testing import tiny_model

        texts = [f"chunk {i}: " + "the quick brown fox jumps over the lazy dog " * 8 for i in range(int(rest[0]))]
        with LMDBStore(path) as store:
            precompute(tiny_model("llama"), store, texts, "Be brief.", variant=SHARED, batch_size=1, progress=False)
        print("done", flush=True)
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
