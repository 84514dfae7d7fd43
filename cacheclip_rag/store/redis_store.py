"""A chunk-cache tier shared by many machines: Redis (or Valkey).

`RedisStore` keeps the LMDB store's entry bytes exactly (`store.encode_entry`: format version,
fingerprint, checksum), so a damaged or foreign entry is refused and recomputed the same way.
An entry larger than `part_bytes` is written as parts first and its readable key last (a small
manifest naming the parts): a reader sees the whole entry or none of it. Eviction is the server's:
run it with `maxmemory` and `maxmemory-policy allkeys-lru`; a manifest whose parts were evicted
reads as a miss. Keys live under a namespace per deployment. The connection is a URL
(`redis://`, `rediss://` for TLS, `unix:///path/redis.sock`; a password goes in the URL), with
timeouts, so a dead server is an error in seconds, not a hang.

`TieredStore` (in `tiered_store`) puts a local `LMDBStore` in front of it.

Needs `pip install 'cacheclip-rag[redis]'`.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator, Sequence

from .entry import ChunkEntry, encode_entry
from .errors import CorruptEntryError, StoreError, StoreFullError, StoreUnavailableError
from .protocol import ReceivedEntries
from .redis_owners import RedisOwners
from .tiered_store import TieredStore  # noqa: F401 - the tier over Redis, importable from here

log = logging.getLogger(__name__)

_MANIFEST = b"CCPARTS1"  # an entry stored in parts: this prefix, then JSON {"token", "parts", "bytes"}
_MAX_ENTRY = 1 << 40  # no chunk cache comes near a TiB: a manifest declaring more is damage
_MIN_PART = 1 << 10  # RedisStore's smallest part size
# SET an entry's readable key and return what it replaced when that was a manifest (whose parts are
# then deleted), atomically, so two writers of one key never leave each other's parts behind unnamed
_SET_RETURNING_MANIFEST = """
local old = redis.call('GETRANGE', KEYS[1], 0, string.len(ARGV[2]) - 1)
local manifest = false
if old == ARGV[2] then manifest = redis.call('GET', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[1])
return manifest
"""
# DEL a key only if it still holds what the caller read (a manifest found broken), never a newer write
_DEL_IF_UNCHANGED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def parse_manifest(raw: bytes) -> dict:
    """A manifest's token, part count and size, each checked (types, bounds, and the part count against
    the size), before anything is fetched or allocated on its word; `CorruptEntryError` otherwise."""
    try:
        manifest = json.loads(raw[len(_MANIFEST):])
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptEntryError("corrupted entry: its parts manifest is not JSON") from None
    if not isinstance(manifest, dict):
        raise CorruptEntryError("corrupted entry: its parts manifest is not an object")
    token, parts, size = manifest.get("token"), manifest.get("parts"), manifest.get("bytes")
    if not (isinstance(token, str) and len(token) == 16 and all(c in "0123456789abcdef" for c in token)):
        raise CorruptEntryError(f"corrupted entry: manifest token {token!r} is not 16 hex digits")
    if type(parts) is not int or type(size) is not int or not 0 < size <= _MAX_ENTRY:
        raise CorruptEntryError(f"corrupted entry: manifest parts {parts!r} / bytes {size!r} are not sizes")
    if not 1 <= parts <= -(-size // _MIN_PART):
        raise CorruptEntryError(f"corrupted entry: {parts} parts for {size} bytes (parts are >= {_MIN_PART} bytes)")
    return {"token": token, "parts": parts, "bytes": size}


def _redis():
    try:
        import redis
    except ImportError as err:
        raise ModuleNotFoundError("RedisStore needs redis-py: pip install 'cacheclip-rag[redis]'") from err
    return redis


class RedisStore(ReceivedEntries, RedisOwners):
    """`KVStore` on a Redis server. Thread-safe (redis-py's connection pool)."""

    TIER = "redis"

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
        self._out_of_memory = redis.exceptions.OutOfMemoryError
        self._set_returning_manifest = self.client.register_script(_SET_RETURNING_MANIFEST)
        self._del_if_unchanged = self.client.register_script(_DEL_IF_UNCHANGED)
        self._foreign_warned = False

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
            if isinstance(err, self._out_of_memory) or "OOM" in str(err):
                raise StoreFullError(f"redis at {self.url} is out of memory ({err}); set maxmemory-policy "
                                     "allkeys-lru so it evicts old chunks") from err
            raise StoreError(f"redis at {self.url}: {err}") from err

    # ---- the KVStore protocol ------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """True only for a whole entry: a manifest whose parts were evicted reads as absent (and is
        removed), so the entry is recomputed rather than believed."""
        head = self._call(self.client.getrange, self._entry(key), 0, len(_MANIFEST) - 1)
        if not head:
            return False
        if head != _MANIFEST:
            return True
        raw = self._call(self.client.get, self._entry(key))
        if raw is None:
            return False
        try:
            manifest = parse_manifest(raw)
        except CorruptEntryError as err:
            self._quarantine_damaged(key, str(err))
            return False
        names = [self._part(key, manifest["token"], n) for n in range(manifest["parts"])]
        if self._call(self.client.exists, *names) == len(names):
            return True
        self._drop_partial(key, raw, manifest)
        return False

    def _drop_partial(self, key: bytes, raw: bytes, manifest: dict) -> None:
        """An entry some of whose parts the server evicted: its manifest goes (unless rewritten since),
        and its remaining parts with it, so it is recomputed and not read as a miss forever."""
        log.warning("redis %s: entry %s lost parts to eviction; removed, it will be recomputed", self.url, key.hex())
        self._call(self._del_if_unchanged, [self._entry(key)], [raw])
        self._call(self.client.delete, *[self._part(key, manifest["token"], n) for n in range(manifest["parts"])])

    def _quarantine_damaged(self, key: bytes, why: str) -> None:
        self.quarantine(key, f"corrupted: {why}")

    def _raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each entry's bytes in two round trips (entries or manifests, then any parts); None for a miss.
        A damaged manifest is quarantined; one whose parts were evicted is removed."""
        heads = self._call(self.client.mget, [self._entry(k) for k in keys]) if keys else []
        manifests: dict[int, dict] = {}
        for i, raw in enumerate(heads):
            if raw is not None and raw.startswith(_MANIFEST):
                try:
                    manifests[i] = parse_manifest(raw)
                except CorruptEntryError as err:
                    self._quarantine_damaged(keys[i], str(err))
                    heads[i] = None
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
                if any(p is None for p in pieces):
                    self._drop_partial(keys[i], raw, manifests[i])
                    raw = None
                else:
                    raw = b"".join(pieces)
                    if len(raw) != manifests[i]["bytes"]:
                        self._quarantine_damaged(keys[i], f"its parts hold {len(raw)} bytes, not {manifests[i]['bytes']}")
                        raw = None
            found.append(raw)
        return found

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Each entry appears whole or not at all: parts first, then the readable key. The parts of the
        manifest an entry replaces are deleted (two writers of one key leave no orphans)."""
        for key, fingerprint, entry in items:
            raw = encode_entry(fingerprint, entry, key)
            token = None
            if len(raw) > self.part_bytes:
                token = secrets.token_hex(8)  # a concurrent writer of the same entry writes its own parts
                chunks = [raw[at : at + self.part_bytes] for at in range(0, len(raw), self.part_bytes)]
                pipe = self.client.pipeline(transaction=False)
                for n, piece in enumerate(chunks):
                    pipe.set(self._part(key, token, n), piece)
                try:
                    self._call(pipe.execute)
                except StoreError:
                    self._forget_parts(key, token, len(chunks))
                    raise
                raw = _MANIFEST + json.dumps({"token": token, "parts": len(chunks), "bytes": len(raw)}).encode()
            try:
                replaced = self._call(self._set_returning_manifest, [self._entry(key)], [raw, _MANIFEST])
            except StoreError:
                if token is not None:
                    self._forget_parts(key, token, len(chunks))
                raise
            if replaced:
                try:
                    old = parse_manifest(replaced)
                except CorruptEntryError:
                    continue
                if old["token"] != token:
                    self._forget_parts(key, old["token"], old["parts"])

    def _forget_parts(self, key: bytes, token: str, count: int) -> None:
        try:
            self._call(self.client.delete, *[self._part(key, token, n) for n in range(count)])
        except StoreError as err:
            log.warning("redis %s: %d parts of %s not deleted (%s)", self.url, count, key.hex(), err)

    def keys(self) -> Iterator[bytes]:
        """Every entry's key; a key in the namespace that is not ours (not a hex store key) is skipped,
        with one warning."""
        prefix = f"{self.namespace}:e:".encode()
        found = self._call(lambda: list(self.client.scan_iter(match=prefix + b"*", count=1000)))
        keys = []
        for name in found:
            try:
                keys.append(bytes.fromhex(name[len(prefix):].decode("ascii")))
            except (ValueError, UnicodeDecodeError):
                if not self._foreign_warned:
                    self._foreign_warned = True
                    log.warning("redis %s: skipping %r and any other key in namespace %r that is not a store "
                                "key", self.url, name, self.namespace)
        return iter(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove entries (a manifest and its parts); returns how many existed."""
        gone = 0
        for key in keys:
            head = self._call(self.client.getdel, self._entry(key))
            if head is None:
                continue
            gone += 1
            if head.startswith(_MANIFEST):
                try:
                    manifest = parse_manifest(head)
                except CorruptEntryError:
                    continue
                self._forget_parts(key, manifest["token"], manifest["parts"])
        return gone

    def quarantine(self, key: bytes, why: str) -> None:
        log.error("redis %s: entry %s is unusable (%s); quarantined, it will be recomputed", self.url, key.hex(), why)
        try:
            self._call(self.client.rename, self._entry(key), self._quarantine_key(key))
        except StoreError:
            pass  # gone meanwhile

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
