"""Every store is opened here, from a path or a URL: an LMDB folder or a `redis://` URL; a shared tier (Redis, or
S3-compatible object storage) behind a local LMDB; host-memory and device-memory tiers in front; a tenant's namespace over any of them.
A new tier is one module in this folder and one line here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import is_redis_url, is_s3_url
from .lmdb_store import LMDBStore
from .namespaced import NamespacedStore
from .protocol import KVStore


def open_store(location: str | Path, shared: str | None = None, *, host_bytes: int = 0, device_bytes: int = 0,
               device=None) -> KVStore:
    """The store for `location` (an LMDB folder, or a redis URL); with `shared` (a redis or s3 URL) a local LMDB
    tier in front of the shared one; with `host_bytes`/`device_bytes` the host and device tiers in front of that
    (`device`: where the device tier keeps entries)."""
    if is_redis_url(str(location)):
        from .redis_store import RedisStore

        store: KVStore = RedisStore(str(location))
    elif shared is None:
        store = LMDBStore(location)
    elif is_s3_url(shared):
        from .s3_store import S3Store
        from .tiered_store import TieredStore

        store = TieredStore(LMDBStore(location), S3Store(shared))
    else:
        from .redis_store import RedisStore, TieredStore

        store = TieredStore(LMDBStore(location), RedisStore(shared))
    if host_bytes:
        from .tiers import HostTier

        store = HostTier(store, host_bytes)
    if device_bytes:
        from .tiers import DeviceTier

        store = DeviceTier(store, device, device_bytes)
    return store


def in_namespace(store: KVStore, namespace: str, readable: Sequence[str] = (), owner: str | None = None) -> KVStore:
    """`store` as one tenant (or one `cache_salt`) sees it: writes to `namespace`, reads also `readable`; what it
    computes is recorded for `owner`'s texts (default `namespace`)."""
    return NamespacedStore(store, namespace, readable, owner)


def open_shared(url: str) -> KVStore:
    """The tier replicas share, alone (a redis or s3 URL): what a router reads the remembered texts from."""
    if is_s3_url(url):
        from .s3_store import S3Store

        return S3Store(url)
    if is_redis_url(url):
        from .redis_store import RedisStore

        return RedisStore(url)
    raise ValueError(f"a shared tier is a redis:// or s3:// URL, got {url!r}")
