"""A store seen through a namespace: what one tenant of a server (or one `cache_salt`) writes and reads.

Every key is mapped into the namespace (`namespace_key`: a keyed hash of the namespace and the key, the
same size), so the same chunk ingested by two tenants is two entries, and no request of one tenant ever
reads, or times, an entry of another. Reads fall back, in order, to the `readable` namespaces (a
server's shared corpus, the empty namespace: what the operator ingested); writes go to the namespace
alone. The empty namespace is the store itself, unchanged (a server without tenants, the CLI).

Texts remembered for recognition carry the namespace as a marker (`marked`), so one text log holds every
tenant's, and `split_marked` sorts them back; a text with a NUL character is refused (`check_text`), so no
client text can pose as a marked one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

from .entry import ChunkEntry
from .protocol import KVStore, Slot

SHARED = ""  # the namespace of the store itself: the operator's corpus, readable by every tenant
_MARK = "\x00cacheclip-namespace:"
_FORGOTTEN = "\x00cacheclip-forgotten:"  # a tombstone in the texts' log (`texts`)


def namespace_key(namespace: str, key: bytes) -> bytes:
    """`key` inside `namespace` (NUL-free, so the encoding is injective); the shared namespace is the key."""
    if namespace == SHARED:
        return key
    return hashlib.blake2b(namespace.encode("utf-8") + b"\x00" + key, digest_size=len(key),
                           person=b"cacheclip-ns").digest()


def marked(namespace: str, text: str) -> str:
    return text if namespace == SHARED else f"{_MARK}{namespace}\x00{text}"


def split_marked(text: str) -> tuple[str, str]:
    """(namespace, text) of a remembered text."""
    if not text.startswith(_MARK):
        return SHARED, text
    namespace, _, rest = text[len(_MARK):].partition("\x00")
    return namespace, rest


class NamespacedStore:
    """`inner` seen from `namespace`, reading also from `readable` (in order) on a miss."""

    def __init__(self, inner: KVStore, namespace: str, readable: Sequence[str] = (), owner: str | None = None):
        """`owner`: the namespace whose owners hold the texts this view computes entries from (a tenant's, for
        its `cache_salt` views), so deleting a tenant's document also deletes what its salted requests
        computed from it; default: `namespace`."""
        if "\x00" in namespace:
            raise ValueError("a namespace cannot hold a NUL character")
        self.inner, self.namespace = inner, namespace
        self.owner = namespace if owner is None else owner
        self.readable = tuple(n for n in dict.fromkeys(readable) if n != namespace)

    def __getattr__(self, name: str) -> Any:  # path, stats, close, ...: the store's own
        return getattr(self.inner, name)

    def _own(self, keys: Sequence[bytes]) -> list[bytes]:
        return [namespace_key(self.namespace, k) for k in keys]

    def get_many(self, keys: list[bytes], fingerprint: str, device: Any = "cpu") -> list[ChunkEntry | None]:
        found = self.inner.get_many(self._own(keys), fingerprint, device)
        for other in self.readable:
            missing = [i for i, entry in enumerate(found) if entry is None]
            if not missing:
                break
            more = self.inner.get_many([namespace_key(other, keys[i]) for i in missing], fingerprint, device)
            for i, entry in zip(missing, more):
                found[i] = entry
        return found

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        found = self.inner.read_into(self._own(keys), fingerprint, slots)
        for other in self.readable:
            missing = [i for i, entry in enumerate(found) if entry is None]
            if not missing:
                break
            more = self.inner.read_into([namespace_key(other, keys[i]) for i in missing], fingerprint,
                                        [slots[i] for i in missing])
            for i, entry in zip(missing, more):
                found[i] = entry
        return found

    @property
    def layerwise(self) -> bool:
        """Layer-wise loading works through the view wherever it works on the store beneath."""
        return bool(getattr(self.inner, "layerwise", False))

    def host_entries(self, keys: list[bytes], fingerprint: str, shapes: Sequence[Sequence[int]], dtype: Any) -> list:
        """The host tier's entries of this namespace (then of `readable`), never another's."""
        found = self.inner.host_entries(self._own(keys), fingerprint, shapes, dtype)
        for other in self.readable:
            missing = [i for i, entry in enumerate(found) if entry is None]
            if not missing:
                break
            more = self.inner.host_entries([namespace_key(other, keys[i]) for i in missing], fingerprint,
                                           [shapes[i] for i in missing], dtype)
            for i, entry in zip(missing, more):
                found[i] = entry
        return found

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        self.inner.put_many([(namespace_key(self.namespace, k), f, e) for k, f, e in items])

    def contains(self, key: bytes) -> bool:
        return any(self.inner.contains(namespace_key(n, key)) for n in (self.namespace, *self.readable))

    def quarantine(self, key: bytes, why: str) -> None:
        self.inner.quarantine(namespace_key(self.namespace, key), why)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(self._own(keys))

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        raise TypeError("a namespace's texts are forgotten by releasing their owners (release)")

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def _owner(self, name: str) -> str:
        return name if self.namespace == SHARED else f"{self.namespace}\x00{name}"

    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None, text: str | None = None) -> None:
        self.inner.retain(self._owner(owner), self._own(keys), None if group is None else self._owner(group),
                          None if text is None else marked(self.namespace, text))

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        self.inner.record_entries([(marked(self.owner, t), self._own(keys)) for t, keys in items])

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]:
        return self.inner.release([self._owner(o) for o in owners], None if group is None else self._owner(group))

    def owners_of(self, group: str) -> list[str]:
        prefix = self._owner("")
        return [o[len(prefix):] for o in self.inner.owners_of(self._owner(group))]

    def remember_texts(self, texts: Sequence[str]) -> None:
        self.inner.remember_texts([marked(self.namespace, t) for t in texts])

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        texts, cursor = self.inner.texts_since(cursor)
        return [t for n, t in map(split_marked, texts) if n == self.namespace], cursor

    def texts(self) -> list[str]:
        return [t for t in self.texts_since(0)[0] if not t.startswith(_FORGOTTEN)]
