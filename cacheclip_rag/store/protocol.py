"""What every chunk-cache store offers, and the read-into form built on `get_many` for those that
have no faster one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch

from .codec import copy_tensor
from .entry import ChunkEntry

Slot = tuple[torch.Tensor, torch.Tensor]  # where one entry's keys and values go: [L, KV, T, D] views


@runtime_checkable
class KVStore(Protocol):
    """LMDB, Redis, and the tiers in front of them. Batched reads and writes; `read_into` decodes entries
    straight into the caller's buffers (the blended cache)."""

    path: object

    def get_many(self, keys: list[bytes], fingerprint: str,
                 device: torch.device | str = "cpu") -> list[ChunkEntry | None]: ...

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]: ...

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def quarantine(self, key: bytes, why: str) -> None: ...

    def keys(self) -> Iterator[bytes]: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    # what frameworks' and tenants' deletes and a server's prompt recognition need (store.owners, store.texts)
    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None,
               text: str | None = None) -> None: ...

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None: ...

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]: ...

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]: ...

    def owners_of(self, group: str) -> list[str]: ...

    def remember_texts(self, texts: Sequence[str]) -> None: ...

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]: ...

    def texts(self) -> list[str]: ...

    def close(self) -> None: ...


def fits(entry: ChunkEntry, slot: Slot) -> bool:
    return tuple(entry.keys.shape) == tuple(slot[0].shape) and tuple(entry.values.shape) == tuple(slot[1].shape)


def misfit(shape: Sequence[int], slot: Slot) -> str:
    """Why an intact entry of `shape` cannot be used where the caller's model and prompt need `slot`."""
    return (f"its layout [L, KV, T, D] = {list(shape)} is not the {list(slot[0].shape)} its model and chunk "
            "need (another layout, or other token ids than its key's text)")


def read_into_via_get(store: KVStore, keys: list[bytes], fingerprint: str,
                      slots: Sequence[Slot]) -> list[ChunkEntry | None]:
    """`read_into` for a store that only decodes into its own tensors: get, then copy into the slots.
    An entry that does not fit its slot is quarantined and reads as a miss."""
    if not keys:
        return []
    found = store.get_many(keys, fingerprint, slots[0][0].device)
    out: list[ChunkEntry | None] = []
    for key, entry, slot in zip(keys, found, slots):
        if entry is not None and not fits(entry, slot):
            store.quarantine(key, misfit(entry.keys.shape, slot))
            entry = None
        if entry is not None:
            copy_tensor(entry.keys, slot[0])
            copy_tensor(entry.values, slot[1])
            entry = replace(entry, keys=slot[0], values=slot[1], scales=None)
        out.append(entry)
    return out
