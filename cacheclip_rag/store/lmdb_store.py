"""The LMDB-backed chunk-cache store: one directory, shared by threads and processes, crash-safe."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from .entry import ChunkEntry, CorruptEntryError, EntryView, StoreError, StoreFullError, encode_entry, parse_entry
from .maintenance import Maintenance
from .protocol import Slot, misfit
from .tables import ACCESS, ENTRIES, LOCK_FILE, META, QUARANTINE, STAMP, TABLES
from .tally import record_read

log = logging.getLogger("cacheclip_rag.store")

# How LMDB reports a write the filesystem refused (ENOSPC, EFBIG past a size limit, EDQUOT; a short
# write at commit surfaces as EIO)
_DISK_FULL = ("No space left", "File too large", "Disk quota", "Input/output error")
_MARKER = b"cacheclip-store"
_VERIFIED_CAP = 1 << 20  # remembered verifications; past it the memory starts again (re-verifying is only slower)


def _lmdb():
    import lmdb  # imported where it is used: kernel-only runs (the GPU machine) need no lmdb wheel

    return lmdb


class _SharedExclusiveLock:
    """Many holders in shared mode or one in exclusive mode (threads of one process); a waiting
    exclusive request stops new shared ones, so map growth is not starved by a stream of reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _address(raw: memoryview) -> int:
    """Where a zero-copy value lies in the map: a rewrite of the entry lands elsewhere (copy on write)."""
    import numpy as np

    return int(np.frombuffer(raw, dtype=np.uint8, count=min(len(raw), 1)).ctypes.data) if len(raw) else 0


class LMDBStore(Maintenance):
    """The LMDB-backed `KVStore`.

    - Atomic: `put_many` commits all its items or none (LMDB transactions, synced to disk), so a
      writer killed at any moment leaves only whole, checksummed entries.
    - Threads: every method may be called from any number of threads at once. Each transaction runs
      under a shared in-process lock and a map resize under the exclusive one: LMDB may move the map
      only while no transaction of this process is open (a reader's zero-copy view would point into
      unmapped memory, a segfault).
    - Processes: each process opens its own environment; a store object carried across `fork` reopens
      itself in the child. Readers and writers in several processes may share one directory; LMDB
      serialises writers. Reads and writes copy bytes with numpy, never with a parallel torch op, so
      they work in a child forked after the parent used torch's OpenMP pool (which would hang there).
      Torch work of your own in such a child still can: use the `spawn` start method, or call
      `torch.set_num_threads(1)` first in the child, as torch's DataLoader workers do. Readers left by
      killed processes are cleared on open and whenever the reader table fills.
    - Growth: the map doubles when a write finds it full, up to `max_bytes`; past it (or on a full
      disk) `StoreFullError` is raised and nothing stored is touched. Other processes adopt a grown map.
    - Integrity: an entry is believed only after its checksum; one that is damaged or impossible
      (shape, rows, payload length, non-finite or absurd values, another key's entry) is moved to a
      quarantine table, logged, and reported as missing (so it is recomputed); it is never served.
      The checksum and the value scan run on an entry's first read in this process and again whenever
      its stored bytes change (a rewrite lands at another place in the map); `verify()` checks all.
      An intact entry of another model or format version raises `StoreError`. A truncated file is
      refused on open.
    - Speed: a read decodes from LMDB's zero-copy page view straight into the caller's tensors
      (`read_into`: the request's blended cache), converting dtype on the way: one copy.
    - Space: `evict(max_bytes)` drops least-recently-used entries; `compact()` rewrites the file
      without free pages, and refuses while another process has the store open (a file lock that
      every open store holds shared).
    - Only our own directories are opened: another program's LMDB is refused, never modified.
      `readonly=True` works on read-only media (no lock file is written there).
    """

    def __init__(self, path: str | Path, map_size: int = 1 << 30, readonly: bool = False,
                 max_bytes: int | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        if max_bytes is not None and max_bytes < 1 << 20:
            raise ValueError(f"max_bytes must be at least 1 MiB, got {max_bytes}")
        self._map_size = min(map_size, max_bytes) if max_bytes else map_size
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"{self.path} is a file, not a store directory")
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / "data.mdb").exists():
            raise StoreError(f"no store at {self.path}")
        self._open()

    # ---- opening -----------------------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        self._lock = _SharedExclusiveLock()
        self._verified: dict[bytes, tuple[int, int, str]] = {}  # key -> (address, length, checksum) verified
        self._lockfile = self._hold_lock_file()
        try:
            self._open_env()
        except BaseException:
            self._release_lock_file()
            raise

    def _hold_lock_file(self) -> int | None:
        """A shared flock held while the store is open; compaction needs it exclusively. Opening waits
        while another process compacts (a few seconds at most)."""
        try:
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            if not self.readonly:
                raise
            return None  # read-only media: nobody can compact it either
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _release_lock_file(self) -> None:
        if self._lockfile is not None:
            os.close(self._lockfile)  # closing drops this process's flock
            self._lockfile = None

    def _open_env(self) -> None:
        lmdb = _lmdb()
        stale = self.path / "compact.tmp"
        if stale.exists() and not self.readonly:  # a compaction killed midway; we hold the lock file,
            shutil.rmtree(stale, ignore_errors=True)  # so none is running now
        writable_lock = os.access(self.path, os.W_OK) and (
            not (self.path / "lock.mdb").exists() or os.access(self.path / "lock.mdb", os.W_OK))
        use_lock = not self.readonly or writable_lock
        for _ in range(100):  # another process may grow the map while we open the file or its tables
            try:
                self._env = lmdb.open(
                    str(self.path), map_size=self._map_size, subdir=True, readonly=self.readonly, lock=use_lock,
                    max_readers=256, max_dbs=4, metasync=True, sync=True,
                )
                break
            except lmdb.MapResizedError:  # a failed open leaves nothing open; try again
                time.sleep(0.01)
            except lmdb.Error as err:
                raise StoreError(f"cannot open the store at {self.path}: {err}") from err
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        self._verified.clear()  # a new map: addresses mean nothing now
        if use_lock:
            self._env.reader_check()  # slots of readers whose process died
        self._check_not_truncated()
        self._refuse_foreign()
        create = not self.readonly
        for _ in range(100):
            try:
                self._dbs = {name: self._env.open_db(name, create=create) if create or self._has_db(name) else None
                             for name in TABLES}
                break
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except lmdb.Error as err:
                self._env.close()
                raise StoreError(f"{self.path} is not a cacheclip store ({err})") from err
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        if self._dbs[ENTRIES] is None:
            raise StoreError(f"{self.path} is not a cacheclip store (no entries table)")
        if create:
            with self._transaction(write=True) as txn:
                txn.put(b"format", _MARKER, db=self._dbs[META], overwrite=False)

    def _refuse_foreign(self) -> None:
        """An existing LMDB whose main table names anything but our four tables is another program's:
        refuse it before a single table is added to it (opening the environment wrote nothing to it).
        Read through this environment: a second one on the same files in one process would drop
        LMDB's per-process file locks when closed."""
        lmdb = _lmdb()
        for _ in range(100):
            try:
                with self._env.begin() as txn:
                    names = {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}
                break
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
        else:
            self._env.close()
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        foreign = names - set(TABLES)
        if foreign:
            self._env.close()
            shown = ", ".join(sorted(n.decode("utf-8", "replace") for n in foreign)[:5])
            raise StoreError(f"{self.path} holds another program's LMDB database (keys: {shown}); "
                             "it is not a cacheclip store and was left untouched")

    def _check_not_truncated(self) -> None:
        """Pages past the end of the file would be a SIGBUS on first touch: refuse the file instead."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * psize
        size = (self.path / "data.mdb").stat().st_size
        if size < needed:
            self._env.close()
            raise StoreError(f"{self.path / 'data.mdb'} is truncated: {size:,} bytes, but its last committed "
                             f"page ends at {needed:,}. Restore it from a copy, or move it away to start empty.")

    def _has_db(self, name: bytes) -> bool:
        with self._env.begin() as txn:  # MapResizedError here is retried by the caller's loop
            return txn.get(name) is not None

    @property
    def env(self):
        """This process's environment (reopened after a fork: LMDB handles must not cross one)."""
        if os.getpid() != self._pid:
            # The parent's handle must not be used here. Closing it in the child only unmaps the file
            # and forgets it (LMDB clears reader slots of this pid only, and fcntl locks are not
            # inherited), which lets this process open its own environment on the same files. The
            # inherited lock-file descriptor shares the parent's flock: keep it open (closing it here
            # would not release the parent's lock, and the child takes its own).
            self._env.close()
            self._lockfile = None
            self._open()
        return self._env

    def __enter__(self) -> LMDBStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock.exclusive():
            self._env.close()
        self._release_lock_file()

    # ---- transactions ------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, write: bool = False) -> Iterator:
        """A transaction, committed on success; a map grown by another process is adopted first, and
        a reader table full of dead processes' slots is cleared."""
        lmdb = _lmdb()
        env = self.env
        for _ in range(100):
            with self._lock.shared():
                try:
                    txn = env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                except lmdb.ReadersFullError:
                    txn = None
                    env.reader_check()
                if txn is not None:
                    with txn:
                        yield txn
                    return
            with self._lock.exclusive():
                env.set_mapsize(0)  # 0: adopt the size another process set
                self._verified.clear()
        raise StoreError(f"{self.path}: could not begin a transaction (map resized or reader table full)")

    def contains(self, key: bytes) -> bool:
        with self._transaction() as txn:
            return txn.get(key, db=self._dbs[ENTRIES]) is not None

    # ---- reads -------------------------------------------------------------------------------

    def _view(self, key: bytes, raw: memoryview, fingerprint: str) -> EntryView:
        """The parsed entry; its checksum and values are checked only if these bytes were not before."""
        address = _address(raw)
        seen = self._verified.get(key)
        fresh = seen is None or seen[0] != address or seen[1] != len(raw)
        view = parse_entry(raw, fingerprint, key, checked=not fresh)
        if not fresh and view.checksum != seen[2]:  # other bytes at the same place: check them
            view = parse_entry(raw, fingerprint, key)
            fresh = True
        if fresh:
            if len(self._verified) >= _VERIFIED_CAP:
                self._verified.clear()
            self._verified[key] = (address, len(raw), view.checksum)
        return view

    def _read(self, keys: Sequence[bytes], fingerprint: str, use) -> list:
        """`use(i, view)` for each stored entry inside one read transaction; damaged ones quarantined."""
        started = time.perf_counter()
        found: list = []
        bad: list[tuple[bytes, bytes, str]] = []
        with self._transaction() as txn:
            for i, k in enumerate(keys):
                raw = txn.get(k, db=self._dbs[ENTRIES])
                if raw is None:
                    found.append(None)
                    continue
                try:
                    found.append(use(i, self._view(k, raw, fingerprint)))
                except CorruptEntryError as err:
                    self._verified.pop(k, None)
                    bad.append((k, bytes(raw), str(err)))
                    found.append(None)
        if bad:
            self._quarantine(bad)
        if not self.readonly:
            self._touch([k for k, e in zip(keys, found) if e is not None])
        record_read("lmdb", found, time.perf_counter() - started)
        return found

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def get_many(self, keys: list[bytes], fingerprint: str,
                 device: torch.device | str = "cpu") -> list[ChunkEntry | None]:
        """Entries for `keys` as new tensors (None where missing or quarantined now); records the access
        for LRU."""
        return self._read(keys, fingerprint, lambda i, view: view.decode(device))

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        """Decode each entry straight from its page into `slots[i]` (keys, values [L, KV, T, D] views of
        any dtype and device); returns entries whose tensors are those slots. An intact entry whose
        shape is not its slot's is quarantined (another layout, or another text's tokens) and misses."""

        def use(i: int, view: EntryView) -> ChunkEntry:
            key_slot, value_slot = slots[i]
            if tuple(key_slot.shape) != view.shape or tuple(value_slot.shape) != view.shape:
                raise CorruptEntryError(misfit(view.shape, slots[i]))
            view.copy_into(slots[i])
            return ChunkEntry(key_slot, value_slot, view.token_ids, view.offsets, view.model)

        return self._read(keys, fingerprint, use)

    def quarantine(self, key: bytes, why: str) -> None:
        """Move an entry that its reader found unusable (e.g. the wrong layout for its model) aside."""
        with self._transaction() as txn:
            raw = txn.get(key, db=self._dbs[ENTRIES])
            raw = None if raw is None else bytes(raw)
        if raw is not None:
            self._quarantine([(key, raw, why)])

    def _quarantine(self, items: list[tuple[bytes, bytes, str]]) -> None:
        for key, _, why in items:
            self._verified.pop(key, None)
            log.error("store %s: entry %s is corrupted (%s); quarantined, it will be recomputed", self.path, key.hex(), why)
        if self.readonly:
            raise StoreError(f"corrupted entries in read-only store {self.path}: {[k.hex() for k, _, _ in items]}")
        with self._transaction(write=True) as txn:
            for key, raw, _ in items:
                txn.put(key, raw, db=self._dbs[QUARANTINE])
                txn.delete(key, db=self._dbs[ENTRIES])
                txn.delete(key, db=self._dbs[ACCESS])

    def _touch(self, keys: list[bytes]) -> None:
        if not keys:
            return
        now = time.time()
        try:
            with self._transaction(write=True) as txn:
                for k in keys:
                    old = txn.get(k, db=self._dbs[ACCESS])
                    size = STAMP.unpack(old)[1] if old is not None else 0
                    txn.put(k, STAMP.pack(now, size), db=self._dbs[ACCESS])
        except (_lmdb().Error, StoreError) as err:
            # access times are a hint for eviction: a full map or disk must never fail a read
            log.debug("store %s: access times not recorded (%s)", self.path, err)

    # ---- writes ------------------------------------------------------------------------------

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Write all items in one transaction: all are committed or none."""
        lmdb = _lmdb()
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        encoded = [(k, encode_entry(f, e, k)) for k, f, e in items]
        now = time.time()
        while True:
            try:
                with self._transaction(write=True) as txn:
                    for k, raw in encoded:
                        txn.put(k, raw, db=self._dbs[ENTRIES])
                        txn.put(k, STAMP.pack(now, len(raw)), db=self._dbs[ACCESS])
                return
            except lmdb.MapFullError:
                self._grow(sum(len(raw) for _, raw in encoded))  # outside the transaction: it moves the map
            except lmdb.Error as err:
                raise self._disk_error(err) from err

    def _disk_error(self, err: Exception) -> Exception:
        if any(cause in str(err) for cause in _DISK_FULL):
            return StoreFullError(
                f"writing to {self.path} failed ({err}): the disk is full (or failing). This write was "
                "rolled back; everything stored before is intact. Free space, then retry."
            )
        return err

    def _grow(self, needed: int) -> None:
        with self._lock.exclusive():  # no transaction of this process may be open while the map moves
            size = self.env.info()["map_size"]
            new_size = max(size * 2, size + 2 * needed)
            if self.max_bytes is not None:
                if size >= self.max_bytes:
                    raise StoreFullError(
                        f"store {self.path} is full: its cap is {self.max_bytes:,} bytes; evict() entries or raise max_bytes"
                    )
                new_size = min(new_size, self.max_bytes)
            log.info("growing LMDB map %s from %d to %d bytes", self.path, size, new_size)
            try:
                self.env.set_mapsize(new_size)
            except _lmdb().Error as err:
                raise StoreFullError(f"cannot grow {self.path} to {new_size:,} bytes: {err}") from err
            self._verified.clear()

    def keys(self) -> Iterator[bytes]:
        """Every entry's key (a snapshot: no transaction stays open while the caller iterates)."""
        with self._transaction() as txn:
            keys = [bytes(k) for k in txn.cursor(db=self._dbs[ENTRIES]).iternext(keys=True, values=False)]
        return iter(keys)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove entries; returns how many existed."""
        removed = 0
        with self._transaction(write=True) as txn:
            for k in keys:
                removed += bool(txn.delete(k, db=self._dbs[ENTRIES]))
                txn.delete(k, db=self._dbs[ACCESS])
                self._verified.pop(k, None)
        # LMDB reuses pages freed by a commit only after the next commit; make the space usable now
        with self._transaction(write=True) as txn:
            txn.put(b"last_delete", STAMP.pack(time.time(), removed), db=self._dbs[META])
        return removed


__all__ = ["LMDBStore"]
