"""What every chunk-cache store offers, and the read-into form built on `get_many` for those that
have no faster one."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch

from .codec import copy_tensor
from .entry import ChunkEntry, parse_entry
from .errors import CorruptEntryError
from .tally import record_read

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


def into_slots(slots: Sequence[Slot]):
    """`decode_received`'s use for `read_into`: entry i decoded straight into `slots[i]` (a misfit is damage)."""

    def use(i: int, view) -> ChunkEntry:
        if tuple(slots[i][0].shape) != view.shape or tuple(slots[i][1].shape) != view.shape:
            raise CorruptEntryError(misfit(view.shape, slots[i]))
        view.copy_into(slots[i])
        return ChunkEntry(slots[i][0], slots[i][1], token_ids=view.token_ids, offsets=view.offsets, model=view.model)

    return use


def decode_received(store: KVStore, tier: str, keys: Sequence[bytes], raws: Sequence[bytes | None], fingerprint: str,
                    use, started: float) -> list:
    """A shared tier's received bytes, each verified (`parse_entry`) and given to `use(i, view)`; a damaged one
    quarantined and read as a miss; the reads tallied for `tier` since `started`."""
    found: list = []
    for key, raw in zip(keys, raws):
        if raw is None:
            found.append(None)
            continue
        try:
            found.append(use(len(found), parse_entry(raw, fingerprint, key)))
        except CorruptEntryError as err:
            store.quarantine(key, f"corrupted: {err}")
            found.append(None)
    record_read(tier, found, time.perf_counter() - started)
    return found


class ReceivedEntries:
    """`get`, `get_many`, `read_into` and `put` of a store whose entries arrive as bytes (Redis, S3): each one
    verified on arrival (`decode_received`). A store gives `TIER` (its name in `timings.store`), `_raw_many`
    (each key's bytes, None for a miss), `put_many` and `quarantine`."""

    TIER = ""

    def _raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def _decoded(self, keys: list[bytes], fingerprint: str, use) -> list:
        started = time.perf_counter()
        return decode_received(self, self.TIER, keys, self._raw_many(keys), fingerprint, use, started)

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def get_many(self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu") -> list[ChunkEntry | None]:
        """Entries for `keys` as new tensors, each verified as it arrives."""
        return self._decoded(keys, fingerprint, lambda i, view: view.decode(device))

    def read_into(self, keys: list[bytes], fingerprint: str, slots: Sequence[Slot]) -> list[ChunkEntry | None]:
        """Entries decoded from the received bytes straight into `slots` (see `LMDBStore.read_into`)."""
        return self._decoded(keys, fingerprint, into_slots(slots))

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        raise NotImplementedError
