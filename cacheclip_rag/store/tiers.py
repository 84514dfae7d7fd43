"""In-memory tiers in front of a store: verified chunk caches kept decoded, least recently used out first.

- `HostTier`: host RAM in the model's dtype (pinned when CUDA is present, so a hit is one DMA to the
  GPU; on a CPU a hit is one memcpy into the request's blended cache). Hot chunks skip the store's
  page lookups, header parsing and dtype conversion.
- `DeviceTier`: GPU memory; a hit is a device-to-device copy.
Both are shared by every request of the process, count their reads per request (`timings.store`:
`host_*`, `device_*`), key entries by (store key, fingerprint) so an entry never crosses models, and
pass writes and quarantines through to the store (dropping what they hold for those keys).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from .codec import copy_tensor
from .entry import ChunkEntry
from .protocol import KVStore, Slot
from .tally import record_read


class _LRUBytes:
    """Entries by (key, fingerprint), at most `max_bytes` of them, the least recently used dropped first."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be an integer > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[bytes, str], ChunkEntry] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[bytes], fingerprint: str) -> list[ChunkEntry | None]:
        with self._lock:
            found = []
            for k in keys:
                entry = self._entries.get((k, fingerprint))
                if entry is not None:
                    self._entries.move_to_end((k, fingerprint))
                found.append(entry)
            hits = sum(e is not None for e in found)
            self.hits += hits
            self.misses += len(keys) - hits
        return found

    def insert(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        if entry.nbytes > self.max_bytes:
            return  # larger than the whole tier: served, not kept
        with self._lock:
            if (key, fingerprint) in self._entries:
                return
            self._entries[(key, fingerprint)] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes

    def drop(self, keys: Sequence[bytes]) -> None:
        wanted = set(keys)
        with self._lock:
            for cached in [k for k in self._entries if k[0] in wanted]:
                self.bytes -= self._entries.pop(cached).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


class _Tier:
    """What both tiers share: the LRU, pass-through writes, and `read_into` over a memory copy."""

    name = "tier"

    def __init__(self, store: KVStore, max_bytes: int, device: torch.device):
        self.store = store
        self.device = device
        self._lru = _LRUBytes(max_bytes)

    # the counts the tests and `stats` read
    max_bytes = property(lambda self: self._lru.max_bytes)
    bytes = property(lambda self: self._lru.bytes)
    hits = property(lambda self: self._lru.hits)
    misses = property(lambda self: self._lru.misses)
    entries = property(lambda self: len(self._lru._entries))

    @property
    def path(self):
        return self.store.path

    def _held(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def get_many(self, keys: list[bytes], fingerprint: str,
                 device: torch.device | str | None = None) -> list[ChunkEntry | None]:
        """Entries as the tier holds them (shared tensors: read them, do not write them)."""
        started = time.perf_counter()
        found = self._lru.lookup(keys, fingerprint)
        record_read(self.name, found, time.perf_counter() - started)
        missing = [i for i, e in enumerate(found) if e is None]
        if missing:
            for i, entry in zip(missing, self.store.get_many([keys[i] for i in missing], fingerprint, self.device)):
                if entry is not None:
                    found[i] = self._keep(entry)
                    self._lru.insert(keys[i], fingerprint, found[i])
        return found

    def _keep(self, entry: ChunkEntry) -> ChunkEntry:
        return entry

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        """Hits copied from the tier into `slots`; misses read from the store into new tier tensors in
        the slots' dtype (kept), then copied."""
        started = time.perf_counter()
        found = self._lru.lookup(keys, fingerprint)
        record_read(self.name, found, time.perf_counter() - started)
        out: list[ChunkEntry | None] = [None] * len(keys)
        missing = []
        for i, (entry, slot) in enumerate(zip(found, slots)):
            if entry is None or tuple(entry.keys.shape) != tuple(slot[0].shape):
                missing.append(i)  # a held entry of another shape: the store decides (and quarantines)
                continue
            out[i] = self._serve(entry, slot)
        if missing:
            held = [(self._held(slots[i][0].shape, slots[i][0].dtype), self._held(slots[i][1].shape, slots[i][1].dtype))
                    for i in missing]
            read = self.store.read_into([keys[i] for i in missing], fingerprint, held)
            for i, entry in zip(missing, read):
                if entry is not None:
                    self._lru.insert(keys[i], fingerprint, entry)
                    out[i] = self._serve(entry, slots[i])
        return out

    @staticmethod
    def _serve(entry: ChunkEntry, slot: Slot) -> ChunkEntry:
        copy_tensor(entry.keys, slot[0])
        copy_tensor(entry.values, slot[1])
        return replace(entry, keys=slot[0], values=slot[1], scales=None)

    def quarantine(self, key: bytes, why: str) -> None:
        self._lru.drop([key])
        self.store.quarantine(key, why)

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        self._lru.drop([k for k, _, _ in items])  # an overwritten entry is not served from memory
        self.store.put_many(items)

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None, text: str | None = None) -> None:
        self.store.retain(owner, keys, group, text)

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        self.store.record_entries(items)

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        deleted = self.store.forget_texts(digests)
        self._lru.drop(deleted)
        return deleted

    def delete(self, keys: Sequence[bytes]) -> int:
        self._lru.drop(keys)
        return self.store.delete(keys)

    def remember_texts(self, texts: Sequence[str]) -> None:
        self.store.remember_texts(texts)

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        return self.store.texts_since(cursor)

    def texts(self) -> list[str]:
        return self.store.texts()

    def owners_of(self, group: str) -> list[str]:
        return self.store.owners_of(group)

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]:
        deleted = self.store.release(owners, group)
        self._lru.drop(deleted)
        return deleted

    def keys(self) -> Iterator[bytes]:
        return self.store.keys()

    def stats(self) -> dict:
        return {**self.store.stats(), f"{self.name}_tier_bytes": self.bytes, f"{self.name}_tier_entries": len(self._lru),
                f"{self.name}_tier_hits": self.hits, f"{self.name}_tier_misses": self.misses}

    def close(self) -> None:
        self._lru.clear()
        self.store.close()


class HostTier(_Tier):
    """`KVStore` over another store, keeping up to `max_bytes` of verified, decoded entries in host RAM
    (pinned when `pin`, default: when CUDA is available), in the dtype requests read them in."""

    name = "host"

    def __init__(self, store: KVStore, max_bytes: int, pin: bool | None = None):
        super().__init__(store, max_bytes, torch.device("cpu"))
        self.pin = torch.cuda.is_available() if pin is None else pin

    def _held(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.pin)

    def _keep(self, entry: ChunkEntry) -> ChunkEntry:
        if not self.pin or entry.keys.is_pinned():
            return entry
        keys, values = self._held(entry.keys.shape, entry.keys.dtype), self._held(entry.values.shape, entry.values.dtype)
        copy_tensor(entry.keys, keys)
        copy_tensor(entry.values, values)
        return replace(entry, keys=keys, values=values)

    layerwise = True  # entries are held in host memory: a GPU cache can be filled from them layer by layer

    def host_entries(self, keys: list[bytes], fingerprint: str, shapes: Sequence[Sequence[int]],
                     dtype: torch.dtype) -> list[ChunkEntry | None]:
        """Entries in host memory of `dtype` (held, or read from the store into held memory), for a
        caller that copies them to the GPU itself (layer-wise loading)."""
        slots = [(self._held(s, dtype), self._held(s, dtype)) for s in shapes]
        found = self._lru.lookup(keys, fingerprint)
        record_read(self.name, found, 0.0)
        missing = [i for i, (e, s) in enumerate(zip(found, shapes)) if e is None or tuple(e.keys.shape) != tuple(s)]
        if missing:
            read = self.store.read_into([keys[i] for i in missing], fingerprint, [slots[i] for i in missing])
            for i, entry in zip(missing, read):
                found[i] = entry
                if entry is not None:
                    self._lru.insert(keys[i], fingerprint, entry)
        return found


class DeviceTier(_Tier):
    """`KVStore` over another store, keeping up to `max_bytes` of decoded entries on `device` (a GPU;
    on a CPU device it is plain LRU memory, which is what the CPU tests exercise)."""

    name = "device"

    def __init__(self, store: KVStore, device: torch.device | str, max_bytes: int):
        super().__init__(store, max_bytes, torch.device(device))
