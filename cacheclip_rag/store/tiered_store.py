"""A local LMDB store in front of a shared one (Redis, or S3-compatible object storage): reads are local
first, a remote hit fills the local tier, writes go to both. If the shared server is down, full or
refusing, it warns once for the outage and carries on with the local tier alone (a miss is then computed,
as without the shared tier); the entries it could not write there are queued (bounded) and written when
the shared tier answers again, so other replicas find them."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice
from dataclasses import replace

import torch

from .codec import copy_tensor
from .entry import ChunkEntry, as_stored
from .errors import StoreError, StoreFullError
from .lmdb_store import LMDBStore
from .protocol import KVStore, Slot, misfit
from .texts import digest_ref, is_text_ref, ref_digest

log = logging.getLogger(__name__)

MAX_UNSHARED = 100_000  # entries written locally while the shared tier was down, queued for it


class TieredStore:
    """A local `LMDBStore` in front of a shared `RedisStore`: read-through, write-through."""

    def __init__(self, local: LMDBStore, remote: KVStore):
        self.local, self.remote = local, remote
        self.local_hits = self.remote_hits = self.misses = 0
        self._lock = threading.Lock()
        self.remote_down = False
        self.unshared: OrderedDict[bytes, str] = OrderedDict()  # key -> fingerprint, oldest first

    def _failed(self, err: StoreError, doing: str) -> None:
        """One warning when the shared tier stops answering; later failures of the same outage at DEBUG."""
        with self._lock:
            first, self.remote_down = not self.remote_down, True
        (log.warning if first else log.debug)("shared tier %s failed (%s): serving and writing the local tier "
                                              "only until it answers again", doing, err)

    def _answered(self) -> None:
        """The shared tier answered: after an outage, say so and write what was queued for it."""
        with self._lock:
            back, self.remote_down = self.remote_down, False
        if back:
            log.warning("shared tier answers again; writing the %d entries queued for it", len(self.unshared))
        if self.unshared:
            self._flush()

    def _queue(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        with self._lock:
            for key, fingerprint, _ in items:
                self.unshared[key] = fingerprint
                self.unshared.move_to_end(key)
            while len(self.unshared) > MAX_UNSHARED:
                self.unshared.popitem(last=False)

    def _flush(self, batch: int = 64) -> None:
        """Queued entries from the local tier to the shared one, a batch at a time, until one fails."""
        while self.unshared:
            with self._lock:
                taken = list(islice(self.unshared.items(), batch))  # not a copy of the whole queue a batch
            by_print: dict[str, list[bytes]] = {}
            for key, fingerprint in taken:
                by_print.setdefault(fingerprint, []).append(key)
            items = []
            for fingerprint, keys in by_print.items():
                for key, entry in zip(keys, self.local.get_many(keys, fingerprint)):
                    if entry is not None:  # evicted or deleted locally meanwhile: nothing to share
                        items.append((key, fingerprint, as_stored(entry, entry.stored_dtype)))
            try:
                self.remote.put_many(items)
            except StoreError as err:
                self._failed(err, "a queued write")
                return
            with self._lock:
                for key, _ in taken:
                    self.unshared.pop(key, None)

    @property
    def path(self):
        return self.local.path

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def get_many(self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu",
                 local_checked: bool = False) -> list[ChunkEntry | None]:
        found = [None] * len(keys) if local_checked else self.local.get_many(keys, fingerprint, device)
        missing = [i for i, e in enumerate(found) if e is None]
        remote_hits = 0
        if missing:
            try:
                fetched = self.remote.get_many([keys[i] for i in missing], fingerprint, device)
                self._answered()
            except StoreError as err:
                if "written by model" in str(err):  # an intact entry of another model: the caller's error
                    raise
                self._failed(err, "a read")
                fetched = [None] * len(missing)
            fill = []
            for i, entry in zip(missing, fetched):
                if entry is not None:
                    found[i] = entry
                    fill.append((keys[i], fingerprint, as_stored(entry, entry.stored_dtype)))  # float8 stays float8
            remote_hits = len(fill)
            if fill:
                try:
                    self.local.put_many(fill)  # read-through: the next request is local
                except StoreFullError as err:
                    log.warning("local tier full, shared entries served without a local copy: %s", err)
        with self._lock:
            self.local_hits += len(keys) - len(missing)
            self.remote_hits += remote_hits
            self.misses += len(missing) - remote_hits
        return found

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        """Local entries straight into `slots`; the rest from the shared tier (filling the local one)."""
        found = self.local.read_into(keys, fingerprint, slots)
        missing = [i for i, e in enumerate(found) if e is None]
        with self._lock:
            self.local_hits += len(keys) - len(missing)
        if missing:
            fetched = self.get_many([keys[i] for i in missing], fingerprint, slots[0][0].device, local_checked=True)
            for i, entry in zip(missing, fetched):
                if entry is not None and tuple(entry.keys.shape) != tuple(slots[i][0].shape):
                    self.quarantine(keys[i], misfit(entry.keys.shape, slots[i]))
                elif entry is not None:
                    copy_tensor(entry.keys, slots[i][0])
                    copy_tensor(entry.values, slots[i][1])
                    found[i] = replace(entry, keys=slots[i][0], values=slots[i][1], scales=None)
        return found

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Both tiers; the shared one failing (down, full, refusing) never fails a write the local tier
        took: it is logged. A full local tier still writes the shared one, then says so."""
        local_full = None
        try:
            self.local.put_many(items)
        except StoreFullError as err:
            local_full = err
        try:
            self.remote.put_many(items)
            self._answered()
        except StoreError as err:
            self._failed(err, "a write")
            if local_full is None:
                self._queue(items)
        if local_full is not None:
            raise local_full

    def contains(self, key: bytes) -> bool:
        if self.local.contains(key):
            return True
        try:
            return self.remote.contains(key)
        except StoreError:
            return False

    def quarantine(self, key: bytes, why: str) -> None:
        self.local.quarantine(key, why)
        try:
            self.remote.quarantine(key, why)
        except StoreError:
            pass

    def keys(self) -> Iterator[bytes]:
        return self.local.keys()

    def remember_texts(self, texts: Sequence[str]) -> None:
        self.local.remember_texts(texts)
        try:
            self.remote.remember_texts(texts)
        except StoreError as err:
            log.warning("shared tier did not take %d chunk texts (%s): other replicas will not recognise them "
                        "until they are ingested again", len(texts), err)

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """From the shared tier: every replica's texts (nothing new while it is down)."""
        try:
            found = self.remote.texts_since(cursor)
        except StoreError as err:
            self._failed(err, "reading the texts")
            return [], cursor
        self._answered()
        return found

    def texts(self) -> list[str]:
        return list(dict.fromkeys([*self.local.texts(), *self.texts_since(0)[0]]))

    # who uses an entry is recorded by the local tier (the shared one serves other deployments too); what a
    # release deletes goes from both, and a forgotten text's tombstone reaches the other replicas' indexes
    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None, text: str | None = None) -> None:
        self.local.retain(owner, keys, group, text)

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        self.local.record_entries(items)

    def owners_of(self, group: str) -> list[str]:
        return self.local.owners_of(group)

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]:
        deleted = self.local.release(owners, group)
        self._forward(deleted)
        return deleted

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        deleted = self.local.forget_texts(digests)
        self._forward(deleted + [digest_ref(d) for d in digests])
        return deleted

    def delete(self, keys: Sequence[bytes]) -> int:
        gone = self.local.delete(keys)
        self._forward(list(keys))
        return gone

    def _forward(self, deleted: list[bytes]) -> None:
        """What the local tier deleted or forgot, gone from the shared tier too (a shared tier that is
        down keeps its copies: logged, they go when it is asked again)."""
        try:
            self.remote.delete([k for k in deleted if not is_text_ref(k)])
            self.remote.forget_texts([ref_digest(k) for k in deleted if is_text_ref(k)])
        except StoreError as err:
            log.warning("shared store down: %d deleted entries and texts remain there (%s)", len(deleted), err)

    def stats(self) -> dict:
        return {**self.local.stats(), "local_hits": self.local_hits, "remote_hits": self.remote_hits,
                "misses": self.misses}

    def close(self) -> None:
        self.local.close()
        self.remote.close()
