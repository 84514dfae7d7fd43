"""Opening an LMDB store directory safely: the lock file compaction needs, space reserved before LMDB
maps anything, other programs' databases and truncated files refused, a map grown by another process
adopted, and a fresh environment after a fork."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .entry import EntryView
from .errors import StoreError, StoreFullError
from .tables import ENTRIES, LOCK_FILE, META, TABLES

# How LMDB reports a write the filesystem refused (ENOSPC, EFBIG past a size limit, EDQUOT; a short
# write at commit surfaces as EIO)
DISK_FULL = ("No space left", "File too large", "Disk quota", "Input/output error")
_MARKER = b"cacheclip-store"
# LMDB's lock file for 256 readers (a header and 64 bytes a reader slot), rounded up: allocated up front
_LOCK_BYTES = 64 << 10


def lmdb_module():
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


class Opening:
    """Mixed into `LMDBStore`: everything between a path and an open, checked environment."""

    path: Path
    readonly: bool

    # ---- opening -----------------------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        self._lock = _SharedExclusiveLock()
        self._readers_checked, self._writes = time.monotonic(), 0
        # key -> (address in the map, length, header bytes, parsed view) of bytes verified in this process
        self._verified: dict[bytes, tuple[int, int, bytes, EntryView]] = {}
        self._lockfile = self._hold_lock_file()
        try:
            self._reserve_space()
            self._open_env()
        except BaseException:
            self._release_lock_file()
            self._forget_created()
            raise
        self._created = []

    def _hold_lock_file(self) -> int | None:
        """A shared flock held while the store is open; compaction needs it exclusively. Opening waits
        while another process compacts (a few seconds at most)."""
        self._created = [name for name in (LOCK_FILE, "lock.mdb", "data.mdb") if not (self.path / name).exists()]
        try:
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if not self.readonly:
                raise StoreError(f"cannot open the store at {self.path} for writing ({err.strerror}); on read-only "
                                 "media open it with readonly=True") from None
            return None  # read-only media: nobody can compact it either
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _forget_created(self) -> None:
        """Remove what opening created in a folder that turned out not to be ours (or unusable)."""
        for name in self._created:
            try:
                (self.path / name).unlink()
            except OSError:
                pass

    def _reserve_space(self) -> None:
        """A new store's files, allocated before LMDB maps them: LMDB's lock file is shared memory, and
        touching a page of it that a full filesystem cannot back is a SIGBUS that kills the process.
        posix_fallocate says ENOSPC instead, which is a StoreFullError here."""
        lock = self.path / "lock.mdb"
        if self.readonly or lock.exists():
            return
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, _LOCK_BYTES)
            finally:
                os.close(fd)
        except OSError as err:
            lock.unlink(missing_ok=True)
            raise StoreFullError(f"cannot create a store at {self.path}: {err.strerror} (the filesystem is full). "
                                 "Free space there, or put the store elsewhere.") from None

    def _release_lock_file(self) -> None:
        if self._lockfile is not None:
            os.close(self._lockfile)  # closing drops this process's flock
            self._lockfile = None

    def _open_env(self) -> None:
        lmdb = lmdb_module()
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
                    max_readers=256, max_dbs=len(TABLES), metasync=True, sync=True,
                )
                break
            except lmdb.MapResizedError:  # a failed open leaves nothing open; try again
                time.sleep(0.01)
            except lmdb.Error as err:
                if any(cause in str(err) for cause in DISK_FULL):
                    raise StoreFullError(f"cannot open the store at {self.path}: {err} (the filesystem is full)") from err
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
        """An existing LMDB whose main table names anything but our tables is another program's:
        refuse it before a single table is added to it (opening the environment wrote nothing to it).
        Read through this environment: a second one on the same files in one process would drop
        LMDB's per-process file locks when closed."""
        lmdb = lmdb_module()
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
            self._forget_created()
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
