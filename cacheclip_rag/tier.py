"""A device-resident tier in front of the LMDB store: hot chunk caches stay on the GPU (LRU by bytes).

A request's chunks are looked up here first; misses are read from LMDB into pinned host memory and
copied to the device on a side stream (the copy of one entry overlaps the decode of the next, and
the whole load overlaps CacheClip's aux selection, which runs in another thread). Writes go straight
to the store. Entries are keyed by (store key, fingerprint), so a cached entry is never served for
another model. On a CPU device the tier is plain LRU memory, which is what the tests exercise.
"""

from __future__ import annotations

import time

import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch

from .store import ChunkEntry, LMDBStore, record_read


class PinnedStaging:
    """A ring of pinned host buffers, reused across misses (pinning is a slow driver call; pinning a
    fresh buffer per entry cost more than the copy). A slot is refilled only after the asynchronous
    copy that last read it has finished; buffers grow to the largest entry seen."""

    def __init__(self, slots: int = 4):
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._done: list[torch.cuda.Event | None] = [None] * slots
        self._turn = 0
        self._lock = threading.Lock()  # the aux thread and the request thread both load through the tier

    def to_device(self, tensor: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
        """`tensor` (CPU) copied to `device` on `stream` through a pinned slot; returns the device tensor."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            slot = self._turn
            self._turn = (slot + 1) % len(self._buffers)
            if self._done[slot] is not None:
                self._done[slot].synchronize()
            buffer = self._buffers[slot]
            if buffer is None or buffer.numel() < nbytes:
                buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            staged = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor)
            out = staged.to(device, non_blocking=True)
            self._done[slot] = torch.cuda.Event()
            self._done[slot].record(stream)
        return out


class DeviceTier:
    """`KVStore` over an `LMDBStore`, keeping up to `max_bytes` of decoded entries on `device`."""

    def __init__(self, store: LMDBStore, device: torch.device | str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.store = store
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple[bytes, str], ChunkEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging = PinnedStaging() if self._stream is not None else None

    @property
    def path(self):
        return self.store.path

    def _to_device(self, entry: ChunkEntry) -> ChunkEntry:
        if self._stream is None:
            return entry if self.device.type == "cpu" else ChunkEntry(
                entry.keys.to(self.device), entry.values.to(self.device), entry.token_ids, entry.offsets)
        with torch.cuda.stream(self._stream):
            keys = self._staging.to_device(entry.keys, self.device, self._stream)
            values = self._staging.to_device(entry.values, self.device, self._stream)
        return ChunkEntry(keys, values, entry.token_ids, entry.offsets)

    def _insert(self, key: tuple[bytes, str], entry: ChunkEntry) -> None:
        if entry.nbytes > self.max_bytes:
            return  # larger than the whole tier: served, not kept
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.nbytes

    def get_many(self, keys: list[bytes], fingerprint: str, device: torch.device | str | None = None) -> list[ChunkEntry | None]:
        started = time.perf_counter()
        found: list[ChunkEntry | None] = [None] * len(keys)
        missing = []
        with self._lock:
            for i, k in enumerate(keys):
                entry = self._entries.get((k, fingerprint))
                if entry is None:
                    missing.append(i)
                else:
                    self._entries.move_to_end((k, fingerprint))
                    found[i] = entry
            self.hits += len(keys) - len(missing)
            self.misses += len(missing)
        record_read("device", [found[i] for i in range(len(keys))], time.perf_counter() - started)
        if missing:
            loaded = self.store.get_many([keys[i] for i in missing], fingerprint, "cpu")
            for i, entry in zip(missing, loaded):
                if entry is not None:
                    found[i] = self._to_device(entry)
                    self._insert((keys[i], fingerprint), found[i])
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return found

    def get(self, key: bytes, fingerprint: str, device: torch.device | str | None = None) -> ChunkEntry | None:
        return self.get_many([key], fingerprint)[0]

    def quarantine(self, key: bytes, why: str) -> None:
        with self._lock:
            for cached in [k for k in self._entries if k[0] == key]:
                self.bytes -= self._entries.pop(cached).nbytes
        self.store.quarantine(key, why)

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.store.put(key, fingerprint, entry)

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        self.store.put_many(items)

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def keys(self) -> Iterator[bytes]:
        return self.store.keys()

    def stats(self) -> dict:
        return {**self.store.stats(), "tier_bytes": self.bytes, "tier_entries": len(self._entries),
                "tier_hits": self.hits, "tier_misses": self.misses}

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
        self.store.close()
