"""A chunk-cache tier shared by many machines: Redis (or Valkey), and a local LMDB store in front of it.

`RedisStore` keeps the LMDB store's entry bytes exactly (`store.encode_entry`: format version,
fingerprint, checksum), so a damaged or foreign entry is refused and recomputed the same way.
An entry larger than `part_bytes` is written as parts first and its readable key last (a small
manifest naming the parts): a reader sees the whole entry or none of it. Eviction is the server's:
run it with `maxmemory` and `maxmemory-policy allkeys-lru`; a manifest whose parts were evicted
reads as a miss. Keys live under a namespace per deployment. The connection is a URL
(`redis://`, `rediss://` for TLS, `unix:///path/redis.sock`; a password goes in the URL), with
timeouts, so a dead server is an error in seconds, not a hang.

`TieredStore` puts a local `LMDBStore` in front: reads are local first, a remote hit fills the
local tier, writes go to both. If the shared server is down, it logs and carries on with the local
tier alone (a miss is then computed, as without Redis).

Needs `pip install 'cacheclip-rag[redis]'`.
"""

from __future__ import annotations

import json
import time
import logging
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from .store import (ChunkEntry, CorruptEntryError, LMDBStore, Slot, StoreError, StoreFullError, as_stored,
                    encode_entry, parse_entry, record_read)
from .store.codec import copy_tensor
from .store.protocol import misfit

log = logging.getLogger(__name__)

_MANIFEST = b"CCPARTS1"  # an entry stored in parts: this prefix, then JSON {"token", "parts", "bytes"}


class StoreUnavailableError(StoreError):
    """The shared store cannot be reached (server down, network, timeout)."""


def _redis():
    try:
        import redis
    except ImportError as err:
        raise ModuleNotFoundError("RedisStore needs redis-py: pip install 'cacheclip-rag[redis]'") from err
    return redis


class RedisStore:
    """`KVStore` on a Redis server. Thread-safe (redis-py's connection pool)."""

    def __init__(self, url: str, namespace: str = "cacheclip", part_bytes: int = 32 << 20, timeout_s: float = 5.0):
        redis = _redis()
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis URL must start with redis://, rediss:// or unix://, got {url!r}")
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be a non-empty name without ':', got {namespace!r}")
        if part_bytes < 1 << 10:
            raise ValueError(f"part_bytes must be at least 1 KiB, got {part_bytes}")
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError as err:
            raise ValueError(f"bad redis URL {url!r}: {err}") from err
        self.url = url
        self.path = url  # where the entries live, as LMDBStore.path says it
        self.namespace = namespace
        self.part_bytes = part_bytes
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._response_error = redis.ResponseError

    # ---- keys ----------------------------------------------------------------------------------

    def _entry(self, key: bytes) -> bytes:
        return f"{self.namespace}:e:{key.hex()}".encode()

    def _part(self, key: bytes, token: str, i: int) -> bytes:
        return f"{self.namespace}:p:{key.hex()}:{token}:{i}".encode()

    def _quarantine_key(self, key: bytes) -> bytes:
        return f"{self.namespace}:q:{key.hex()}".encode()

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as err:
            raise StoreUnavailableError(f"redis at {self.url} is unreachable: {err}") from err
        except self._response_error as err:
            if "OOM" in str(err):
                raise StoreFullError(f"redis at {self.url} is out of memory ({err}); set maxmemory-policy "
                                     "allkeys-lru so it evicts old chunks") from err
            raise StoreError(f"redis at {self.url}: {err}") from err

    # ---- the KVStore protocol ------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return bool(self._call(self.client.exists, self._entry(key)))

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def _raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each entry's bytes in two round trips (entries or manifests, then any parts); None for a miss."""
        heads = self._call(self.client.mget, [self._entry(k) for k in keys]) if keys else []
        manifests = {i: json.loads(raw[len(_MANIFEST):]) for i, raw in enumerate(heads)
                     if raw is not None and raw.startswith(_MANIFEST)}
        parts: dict[int, list[bytes | None]] = {}
        if manifests:
            pipe = self.client.pipeline(transaction=False)
            for i, m in manifests.items():
                pipe.mget([self._part(keys[i], m["token"], n) for n in range(m["parts"])])
            for i, got in zip(manifests, self._call(pipe.execute)):
                parts[i] = got
        found: list[bytes | None] = []
        for i, raw in enumerate(heads):
            if raw is not None and i in manifests:
                pieces = parts[i]
                raw = None if any(p is None for p in pieces) else b"".join(pieces)  # parts evicted: a miss
            found.append(raw)
        return found

    def _decoded(self, keys: list[bytes], fingerprint: str, use) -> list:
        started = time.perf_counter()
        found: list = []
        for key, raw in zip(keys, self._raw_many(keys)):
            if raw is None:
                found.append(None)
                continue
            try:
                found.append(use(len(found), parse_entry(raw, fingerprint, key)))
            except CorruptEntryError as err:
                log.error("redis %s: entry %s is corrupted (%s); quarantined, it will be recomputed",
                          self.url, key.hex(), err)
                self._call(self.client.rename, self._entry(key), self._quarantine_key(key))
                found.append(None)
        record_read("redis", found, time.perf_counter() - started)
        return found

    def get_many(self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu") -> list[ChunkEntry | None]:
        """Entries for `keys` as new tensors, each verified as it arrives."""
        return self._decoded(keys, fingerprint, lambda i, view: view.decode(device))

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        """Entries decoded from the received bytes straight into `slots` (see `LMDBStore.read_into`)."""

        def use(i: int, view) -> ChunkEntry:
            if tuple(slots[i][0].shape) != view.shape or tuple(slots[i][1].shape) != view.shape:
                raise CorruptEntryError(misfit(view.shape, slots[i]))
            view.copy_into(slots[i])
            return ChunkEntry(slots[i][0], slots[i][1], view.token_ids, view.offsets, view.model)

        return self._decoded(keys, fingerprint, use)

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Each entry appears whole or not at all: parts first, then the readable key."""
        small = self.client.pipeline(transaction=False)
        for key, fingerprint, entry in items:
            raw = encode_entry(fingerprint, entry, key)
            if len(raw) <= self.part_bytes:
                small.set(self._entry(key), raw)
                continue
            token = secrets.token_hex(8)  # a concurrent writer of the same entry writes its own parts
            chunks = [raw[at : at + self.part_bytes] for at in range(0, len(raw), self.part_bytes)]
            pipe = self.client.pipeline(transaction=False)
            for n, piece in enumerate(chunks):
                pipe.set(self._part(key, token, n), piece)
            self._call(pipe.execute)
            manifest = {"token": token, "parts": len(chunks), "bytes": len(raw)}
            self._call(self.client.set, self._entry(key), _MANIFEST + json.dumps(manifest).encode())
        self._call(small.execute)

    def keys(self) -> Iterator[bytes]:
        prefix = f"{self.namespace}:e:".encode()
        found = self._call(lambda: list(self.client.scan_iter(match=prefix + b"*", count=1000)))
        return iter(bytes.fromhex(k[len(prefix):].decode()) for k in found)

    def quarantine(self, key: bytes, why: str) -> None:
        log.error("redis %s: entry %s is unusable (%s); quarantined, it will be recomputed", self.url, key.hex(), why)
        try:
            self._call(self.client.rename, self._entry(key), self._quarantine_key(key))
        except StoreError:
            pass  # already gone

    def stats(self) -> dict:
        entries = sum(1 for _ in self.keys())
        memory = self._call(self.client.info, "memory")
        return {"entries": entries, "bytes": memory.get("used_memory", 0), "path": self.url, "models": {},
                "quarantined": 0, "file_bytes": 0}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TieredStore:
    """A local `LMDBStore` in front of a shared `RedisStore`: read-through, write-through."""

    def __init__(self, local: LMDBStore, remote: RedisStore):
        self.local, self.remote = local, remote
        self.local_hits = self.remote_hits = self.misses = 0
        self._lock = threading.Lock()

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
            except StoreUnavailableError as err:
                log.warning("shared store down, serving from the local tier only: %s", err)
                fetched = [None] * len(missing)
            fill = []
            for i, entry in zip(missing, fetched):
                if entry is not None:
                    found[i] = entry
                    fill.append((keys[i], fingerprint, as_stored(entry, entry.stored_dtype)))  # float8 stays float8
            remote_hits = len(fill)
            if fill:
                self.local.put_many(fill)  # read-through: the next request is local
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
                if entry is not None and tuple(entry.keys.shape) == tuple(slots[i][0].shape):
                    copy_tensor(entry.keys, slots[i][0])
                    copy_tensor(entry.values, slots[i][1])
                    found[i] = replace(entry, keys=slots[i][0], values=slots[i][1], scales=None)
        return found

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        self.local.put_many(items)
        try:
            self.remote.put_many(items)
        except StoreUnavailableError as err:
            log.warning("shared store down, written to the local tier only: %s", err)

    def contains(self, key: bytes) -> bool:
        if self.local.contains(key):
            return True
        try:
            return self.remote.contains(key)
        except StoreUnavailableError:
            return False

    def quarantine(self, key: bytes, why: str) -> None:
        self.local.quarantine(key, why)
        try:
            self.remote.quarantine(key, why)
        except StoreUnavailableError:
            pass

    def keys(self) -> Iterator[bytes]:
        return self.local.keys()

    def stats(self) -> dict:
        return {**self.local.stats(), "local_hits": self.local_hits, "remote_hits": self.remote_hits,
                "misses": self.misses}

    def close(self) -> None:
        self.local.close()
        self.remote.close()
