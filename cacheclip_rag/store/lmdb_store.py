"""The LMDB-backed chunk-cache store: one directory, shared by threads and processes, crash-safe."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from .entry import ChunkEntry, EntryView, check_identity, encode_entry, header_bytes, parse_entry
from .errors import CorruptEntryError, StoreError, StoreFullError
from .maintenance import Maintenance
from .opening import DISK_FULL, Opening, lmdb_module
from .owners import Owners
from .protocol import Slot, misfit
from .tables import ACCESS, ENTRIES, META, QUARANTINE, STAMP
from .tally import record_read

log = logging.getLogger("cacheclip_rag.store")

_READER_CHECK_S = 5.0  # stale reader slots (killed processes) are cleared this often by writers (or every 32 writes)
_VERIFIED_CAP = 1 << 20  # remembered verifications; past it the memory starts again (re-verifying is only slower)


# resolved folder -> the store this process has open there (weakly held: an unreferenced store closes)
_OPEN: weakref.WeakValueDictionary[str, LMDBStore] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.RLock()


def _folder_key(path: str | Path) -> str:
    return str(Path(path).resolve())


def _address(raw: memoryview) -> int:
    """Where a zero-copy value lies in the map: a rewrite of the entry lands elsewhere (copy on write)."""
    import numpy as np

    return int(np.frombuffer(raw, dtype=np.uint8, count=min(len(raw), 1)).ctypes.data) if len(raw) else 0


class LMDBStore(Opening, Maintenance, Owners):
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
    - Owners: `retain(owner, keys, group)` and `release(owners | group)` delete an entry once the last
      document that uses it is deleted (a framework's delete reaches the KV store).
    - Space: `evict(max_bytes)` drops least-recently-used entries; `compact()` rewrites the file
      without free pages, and refuses while another process has the store open (a file lock that
      every open store holds shared).
    - Only our own directories are opened: another program's LMDB is refused, never modified.
      `readonly=True` works on read-only media (no lock file is written there).
    """

    def __new__(cls, path: str | Path, map_size: int = 1 << 30, readonly: bool = False,
                max_bytes: int | None = None):
        """One open store per folder in a process (LMDB allows one environment per file per process):
        opening a folder that is open already returns that store, counting one more handle."""
        with _OPEN_LOCK:
            store = _OPEN.get(_folder_key(path))
            if store is not None and store._handles > 0:
                # a writable store serves a read-only request too; the other way round it cannot
                if (store.readonly and not readonly) or store.max_bytes != max_bytes:
                    raise StoreError(f"{path} is open in this process already ({'read-only' if store.readonly else 'writable'}"
                                     f", max_bytes={store.max_bytes}); open it with the same settings to share it")
                store._handles += 1
                return store
        return super().__new__(cls)

    def __init__(self, path: str | Path, map_size: int = 1 << 30, readonly: bool = False,
                 max_bytes: int | None = None):
        if getattr(self, "_handles", 0) > 0:
            return  # a second handle on a store this process has open
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        for name, value in (("map_size", map_size), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an integer number of bytes, got {value!r}")
        if not 1 << 16 <= map_size < 1 << 50:
            raise ValueError(f"map_size must be between 64 KiB and 1 PiB, got {map_size}")
        if max_bytes is not None and max_bytes < 1 << 20:
            raise ValueError(f"max_bytes must be at least 1 MiB, got {max_bytes}")
        self._map_size = min(map_size, max_bytes) if max_bytes else map_size
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"{self.path} is a file, not a store directory")
        if not readonly:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"cannot create the store folder {self.path}: {err.strerror}") from None
        elif not (self.path / "data.mdb").exists():
            raise StoreError(f"no store at {self.path}")
        with _OPEN_LOCK:
            self._open()
            self._handles = 1
            _OPEN[_folder_key(self.path)] = self

    def __enter__(self) -> LMDBStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close this handle; the environment closes with the last handle of the process."""
        with _OPEN_LOCK:
            if self._handles <= 0:
                return
            self._handles -= 1
            if self._handles:
                return
            if _OPEN.get(_folder_key(self.path)) is self:
                del _OPEN[_folder_key(self.path)]
        with self._lock.exclusive():
            self._env.close()
        self._release_lock_file()

    # ---- transactions ------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, write: bool = False) -> Iterator:
        """A transaction, committed on success; a map grown by another process is adopted first, and
        a reader table full of dead processes' slots is cleared."""
        lmdb = lmdb_module()
        env = self.env
        self._writes += write
        if write and (self._writes % 32 == 0 or time.monotonic() - self._readers_checked > _READER_CHECK_S):
            # a killed reader's slot pins its snapshot: pages freed since cannot be reused and the file
            # grows; clear such slots now and then, not only on open or when the table fills
            self._readers_checked = time.monotonic()
            env.reader_check()
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
        """The parsed entry. Bytes verified before in this process (the same place in the map, the same
        length, the same header) are not hashed or scanned again, nor is their header parsed again:
        LMDB writes a changed entry elsewhere (copy on write), so those are the bytes that were checked."""
        address, head = _address(raw), header_bytes(raw)
        seen = self._verified.get(key)
        if seen is not None and seen[0] == address and seen[1] == len(raw) and seen[2] == head:
            view = replace(seen[3], payload=memoryview(raw)[8 + len(head):])  # past the length and the header
            check_identity(view, fingerprint, key)
            return view
        view = parse_entry(raw, fingerprint, key)  # every check: checksum, layout, key, values
        if len(self._verified) >= _VERIFIED_CAP:
            self._verified.clear()
        self._verified[key] = (address, len(raw), head, replace(view, payload=memoryview(b"")))  # no page kept
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
            return ChunkEntry(key_slot, value_slot, token_ids=view.token_ids, offsets=view.offsets, model=view.model)

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
        except (lmdb_module().Error, StoreError) as err:
            # access times are a hint for eviction: a full map or disk must never fail a read
            log.debug("store %s: access times not recorded (%s)", self.path, err)

    # ---- writes ------------------------------------------------------------------------------

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Write all items in one transaction: all are committed or none."""
        lmdb = lmdb_module()
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

    def _disk_error(self, err: Exception, done: str = "") -> Exception:
        if any(cause in str(err) for cause in DISK_FULL):
            return StoreFullError(
                f"writing to {self.path} failed ({done}{err}): the disk is full (or failing). This write was "
                "rolled back; everything stored before is intact. Free space, then retry."
            )
        return StoreError(f"writing to {self.path} failed: {err}")

    def _grow(self, needed: int, *, past_cap: bool = False) -> None:
        """More map for a write of `needed` bytes: double it (within the cap). `past_cap`: exactly `needed`
        more, past a cap too, for a deletion's few page copies in a map full to its last page (it frees far
        more than it copies; the pages are written only if the file holds no free ones)."""
        with self._lock.exclusive():  # no transaction of this process may be open while the map moves
            size = self.env.info()["map_size"]
            if past_cap:
                new_size = size + needed
            else:
                new_size = max(size * 2, size + 2 * needed)
                if self.max_bytes is not None:
                    if size >= self.max_bytes:
                        raise StoreFullError(f"store {self.path} is full: its cap is {self.max_bytes:,} bytes; "
                                             "evict() entries or raise max_bytes")
                    new_size = min(new_size, self.max_bytes)
            log.info("growing LMDB map %s from %d to %d bytes", self.path, size, new_size)
            try:
                self.env.set_mapsize(new_size)
            except lmdb_module().Error as err:
                raise StoreFullError(f"cannot grow {self.path} to {new_size:,} bytes: {err}") from err
            self._verified.clear()

    def keys(self) -> Iterator[bytes]:
        """Every entry's key (a snapshot: no transaction stays open while the caller iterates)."""
        with self._transaction() as txn:
            keys = [bytes(k) for k in txn.cursor(db=self._dbs[ENTRIES]).iternext(keys=True, values=False)]
        return iter(keys)

    def delete(self, keys: Iterable[bytes], batch: int = 64) -> int:
        """Remove entries, `batch` per transaction (each reuses the pages the one before freed, so this
        works on a full disk as long as the file holds free pages); returns how many existed. A write
        the disk refuses is a `StoreFullError`; what was deleted before it stays deleted."""
        lmdb = lmdb_module()
        keys = list(keys)
        removed = at = grown = 0
        try:
            while at < len(keys):
                try:
                    with self._transaction(write=True) as txn:
                        gone = 0
                        for k in keys[at : at + batch]:
                            gone += bool(txn.delete(k, db=self._dbs[ENTRIES]))
                            txn.delete(k, db=self._dbs[ACCESS])
                except lmdb.MapFullError:  # a map filled to its last page (as a capped store is): a deletion
                    if grown == 4:  # copies a few tree pages first, so the map takes a little more
                        raise
                    grown += 1
                    self._grow(16 << 20, past_cap=True)
                    continue
                for k in keys[at : at + batch]:
                    self._verified.pop(k, None)
                removed += gone
                at += batch
        except lmdb.Error as err:
            raise self._disk_error(err, f"deleted {removed} of {len(keys)} entries, then ") from err
        try:  # LMDB reuses pages freed by a commit only after the next commit; make the space usable now
            with self._transaction(write=True) as txn:
                txn.put(b"last_delete", STAMP.pack(time.time(), removed), db=self._dbs[META])
        except lmdb.Error as err:
            log.debug("store %s: deletion mark not written (%s)", self.path, err)
        return removed


__all__ = ["LMDBStore"]
