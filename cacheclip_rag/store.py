"""LMDB store of precomputed chunk KV caches.

One entry per (model fingerprint, shared-prefix token ids, chunk text, variant). An entry is

    [8-byte header length][header JSON][payload: K bytes, V bytes]

The header holds the format version, the fingerprint digest, dtype, shape [L, KV, T, D], the
chunk's token ids and character offsets, and a blake2b checksum over header fields and payload.
Reads verify the checksum on a zero-copy view inside the read transaction, then copy once into the
destination tensor. A mismatch of fingerprint or format version, or a bad checksum, raises; it is
never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb
import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HEADER_LEN = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StoreError(RuntimeError):
    """A stored entry cannot be used: wrong model, wrong format version, or corrupted."""


class CorruptEntryError(StoreError):
    """An entry's bytes are damaged (header unreadable or checksum mismatch)."""


@dataclass(frozen=True)
class ChunkEntry:
    """A chunk's precomputed cache. keys, values: [L, KV, T, D]."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


def entry_key(fingerprint: str, prefix_ids: Iterable[int], text: str, variant: str) -> bytes:
    """Store key: a hash, so no text can steer where or what the store reads or writes."""
    digest = hashlib.sha256()
    for part in (fingerprint, variant, ",".join(map(str, prefix_ids)), text):
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(_HEADER_LEN.pack(len(encoded)))
        digest.update(encoded)
    return digest.digest()


class KVStore(Protocol):
    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None: ...
    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None: ...
    def contains(self, key: bytes) -> bool: ...
    def close(self) -> None: ...


def _checksum(header: dict, payload: memoryview | bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    digest.update(payload)
    return digest.hexdigest()


def encode_entry(fingerprint: str, entry: ChunkEntry) -> bytes:
    keys = entry.keys.detach().to("cpu").contiguous()
    values = entry.values.detach().to("cpu").contiguous()
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    dtype = str(keys.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported cache dtype {keys.dtype}")
    payload = _raw_bytes(keys) + _raw_bytes(values)
    header = {
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "dtype": dtype,
        "shape": list(keys.shape),
        "token_ids": list(entry.token_ids),
        "offsets": [list(o) for o in entry.offsets],
    }
    header["checksum"] = _checksum(header, payload)
    head = json.dumps(header).encode()
    return _HEADER_LEN.pack(len(head)) + head + payload


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's bytes in row-major order. numpy does the gather and copy: a torch op here could
    enter OpenMP's pool, which hangs forever in a child forked after the parent started it."""
    as_int = tensor.view(_INT_OF_SIZE[tensor.element_size()])  # numpy has no bfloat16; bytes are bytes
    return as_int.numpy().tobytes()


def _tensor_from_bytes(raw: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device | str) -> torch.Tensor:
    """Copy `raw` (a zero-copy LMDB view, valid only inside its transaction) into a new tensor.

    On the CPU the copy is numpy's single-threaded memcpy, never a torch op: torch's parallel copy
    uses OpenMP, whose pool hangs forever in a process forked after the parent used it (libgomp is
    not fork-safe), so a forked reader would block on its first large entry. The copy is
    memory-bound, so one thread loses little. Other devices take torch's host-to-device copy, which
    does not use the CPU pool."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1).view(torch.uint8)
    if flat.numel() != len(raw):
        raise CorruptEntryError(f"corrupted entry: {len(raw)} payload bytes for shape {list(shape)} {dtype}")
    if out.device.type == "cpu":
        np.copyto(flat.numpy(), np.frombuffer(raw, dtype=np.uint8))
    else:
        flat.copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return out


def _split(raw: memoryview | bytes) -> tuple[dict, memoryview]:
    """Header dict and payload view of an encoded entry."""
    view = memoryview(raw)
    if len(view) < _HEADER_LEN.size:
        raise CorruptEntryError("corrupted entry: shorter than its header")
    (head_len,) = _HEADER_LEN.unpack(view[: _HEADER_LEN.size])
    try:
        header = json.loads(bytes(view[_HEADER_LEN.size : _HEADER_LEN.size + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptEntryError(f"corrupted entry: unreadable header ({err})") from err
    if not isinstance(header, dict):
        raise CorruptEntryError("corrupted entry: header is not an object")
    return header, view[_HEADER_LEN.size + head_len :]


def decode_entry(raw: memoryview | bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry:
    """Verify and decode an entry; `raw` may be a zero-copy buffer valid only inside its transaction."""
    header, payload = _split(raw)
    if header.get("version") != FORMAT_VERSION:
        raise StoreError(f"entry has format version {header.get('version')}, this library reads {FORMAT_VERSION}")
    if header.get("fingerprint") != fingerprint:
        raise StoreError(
            f"entry was written by model {header.get('fingerprint')}, not by the requested model {fingerprint}"
        )
    if _checksum(header, payload) != header.get("checksum"):
        raise CorruptEntryError("corrupted entry: checksum mismatch")
    dtype = _DTYPES[header["dtype"]]
    shape = tuple(header["shape"])
    half = len(payload) // 2
    keys = _tensor_from_bytes(payload[:half], shape, dtype, device)
    values = _tensor_from_bytes(payload[half:], shape, dtype, device)
    return ChunkEntry(
        keys=keys,
        values=values,
        token_ids=tuple(header["token_ids"]),
        offsets=tuple(tuple(o) for o in header["offsets"]),
    )


class StoreFullError(StoreError):
    """The store reached its size cap or the disk is full; the failed write left everything as it was."""


_ENTRIES, _ACCESS, _QUARANTINE, _META = b"entries", b"access", b"quarantine", b"meta"
_STAMP = struct.Struct("<dQ")
# How LMDB reports a write the filesystem refused (ENOSPC, EFBIG past a size limit, EDQUOT; a short
# write at commit surfaces as EIO)
_DISK_FULL = ("No space left", "File too large", "Disk quota", "Input/output error")  # last access time (s), entry size (bytes)


class LMDBStore:
    """The LMDB-backed `KVStore`.

    - Atomic: `put_many` commits all its items or none (LMDB transactions, synced to disk), so a
      writer killed at any moment leaves only whole, checksummed entries.
    - Processes: each process opens its own environment; a store object carried across `fork` reopens
      itself in the child. Readers and writers in several processes may share one directory; LMDB
      serialises writers. Reads and writes copy bytes with numpy, never with a parallel torch op, so
      they work in a child forked after the parent used torch's OpenMP pool (which would hang there).
      Torch work of your own in such a child still can: use the `spawn` start method, or call
      `torch.set_num_threads(1)` first in the child, as torch's DataLoader workers do.
    - Growth: the map doubles when a write finds it full, up to `max_bytes`; past it (or on a full
      disk) `StoreFullError` is raised and nothing stored is touched. Other processes adopt a grown map.
    - Integrity: an entry whose checksum or header fails is moved to a quarantine table, logged, and
      reported as missing (so it is recomputed); it is never served. Another model's or format
      version's entry raises `StoreError`.
    - Space: `evict(max_bytes)` drops least-recently-used entries; `compact()` rewrites the file
      without free pages (run it while no other process has the store open).
    """

    def __init__(self, path: str | Path, map_size: int = 1 << 30, readonly: bool = False,
                 max_bytes: int | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        if max_bytes is not None and max_bytes < 1 << 20:
            raise ValueError(f"max_bytes must be at least 1 MiB, got {max_bytes}")
        self._map_size = min(map_size, max_bytes) if max_bytes else map_size
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / "data.mdb").exists():
            raise StoreError(f"no store at {self.path}")
        self._open()

    def _open(self) -> None:
        self._pid = os.getpid()
        create = not self.readonly
        for _ in range(100):  # another process may grow the map while we open the file or its tables
            try:
                self._env = lmdb.open(
                    str(self.path), map_size=self._map_size, subdir=True, readonly=self.readonly, lock=True,
                    max_readers=256, max_dbs=4, metasync=True, sync=True,
                )
                break
            except lmdb.MapResizedError:  # a failed open leaves nothing open; try again
                time.sleep(0.01)
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        for _ in range(100):
            try:
                self._dbs = {name: self._env.open_db(name, create=create) if create or self._has_db(name) else None
                             for name in (_ENTRIES, _ACCESS, _QUARANTINE, _META)}
                break
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        if self._dbs[_ENTRIES] is None:
            raise StoreError(f"{self.path} is not a cacheclip store (no entries table)")

    def _has_db(self, name: bytes) -> bool:
        with self._env.begin() as txn:
            return txn.get(name) is not None

    @property
    def env(self) -> lmdb.Environment:
        """This process's environment (reopened after a fork: LMDB handles must not cross one)."""
        if os.getpid() != self._pid:
            # The parent's handle must not be used here. Closing it in the child only unmaps the file
            # and forgets it (LMDB clears reader slots of this pid only, and fcntl locks are not
            # inherited), which lets this process open its own environment on the same files.
            self._env.close()
            self._open()
        return self._env

    def __enter__(self) -> LMDBStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._env.close()

    def _begin(self, write: bool = False) -> lmdb.Transaction:
        """A transaction; a map grown by another process in the meantime is adopted first."""
        env = self.env
        for _ in range(100):
            try:
                return env.begin(write=write, buffers=True)
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # 0: adopt the size another process set
        raise StoreError(f"{self.path}: the map kept being resized by other processes")

    def _read(self) -> lmdb.Transaction:
        return self._begin(write=False)

    def contains(self, key: bytes) -> bool:
        with self._read() as txn:
            return txn.get(key, db=self._dbs[_ENTRIES]) is not None

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def get_many(
        self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu"
    ) -> list[ChunkEntry | None]:
        """Entries for `keys` (None where missing or quarantined now); records the access for LRU."""
        found: list[ChunkEntry | None] = []
        corrupted: list[tuple[bytes, bytes, str]] = []
        with self._read() as txn:
            for k in keys:
                raw = txn.get(k, db=self._dbs[_ENTRIES])
                try:
                    found.append(None if raw is None else decode_entry(raw, fingerprint, device))
                except CorruptEntryError as err:
                    corrupted.append((k, bytes(raw), str(err)))
                    found.append(None)
        if corrupted:
            self._quarantine(corrupted)
        if not self.readonly:
            self._touch([k for k, e in zip(keys, found) if e is not None])
        return found

    def _quarantine(self, items: list[tuple[bytes, bytes, str]]) -> None:
        for key, _, why in items:
            log.error("store %s: entry %s is corrupted (%s); quarantined, it will be recomputed", self.path, key.hex(), why)
        if self.readonly:
            raise StoreError(f"corrupted entries in read-only store {self.path}: {[k.hex() for k, _, _ in items]}")
        with self._begin(write=True) as txn:
            for key, raw, _ in items:
                txn.put(key, raw, db=self._dbs[_QUARANTINE])
                txn.delete(key, db=self._dbs[_ENTRIES])
                txn.delete(key, db=self._dbs[_ACCESS])

    def _touch(self, keys: list[bytes]) -> None:
        if not keys:
            return
        now = time.time()
        try:
            with self._begin(write=True) as txn:
                for k in keys:
                    old = txn.get(k, db=self._dbs[_ACCESS])
                    size = _STAMP.unpack(old)[1] if old is not None else 0
                    txn.put(k, _STAMP.pack(now, size), db=self._dbs[_ACCESS])
        except (lmdb.MapFullError, StoreError):
            pass  # access times are a hint for eviction; never fail a read over one

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Write all items in one transaction: all are committed or none."""
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        encoded = [(k, encode_entry(f, e)) for k, f, e in items]
        now = time.time()
        while True:
            try:
                with self._begin(write=True) as txn:
                    for k, raw in encoded:
                        txn.put(k, raw, db=self._dbs[_ENTRIES])
                        txn.put(k, _STAMP.pack(now, len(raw)), db=self._dbs[_ACCESS])
                return
            except lmdb.MapFullError:
                self._grow(sum(len(raw) for _, raw in encoded))
            except lmdb.Error as err:
                if any(cause in str(err) for cause in _DISK_FULL):
                    raise StoreFullError(
                        f"writing to {self.path} failed ({err}): the disk is full (or failing). This write was "
                        "rolled back; everything stored before is intact. Free space, then reopen the store."
                    ) from err
                raise

    def _grow(self, needed: int) -> None:
        size = self.env.info()["map_size"]
        new_size = max(size * 2, size + 2 * needed)
        if self.max_bytes is not None:
            if size >= self.max_bytes:
                raise StoreFullError(
                    f"store {self.path} is full: its cap is {self.max_bytes:,} bytes; evict() entries or raise max_bytes"
                )
            new_size = min(new_size, self.max_bytes)
        log.info("growing LMDB map %s from %d to %d bytes", self.path, size, new_size)
        try:
            self.env.set_mapsize(new_size)
        except lmdb.Error as err:
            raise StoreFullError(f"cannot grow {self.path} to {new_size:,} bytes: {err}") from err

    def keys(self) -> Iterator[bytes]:
        with self._read() as txn:
            for key in txn.cursor(db=self._dbs[_ENTRIES]).iternext(keys=True, values=False):
                yield bytes(key)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove entries; returns how many existed."""
        removed = 0
        with self._begin(write=True) as txn:
            for k in keys:
                removed += bool(txn.delete(k, db=self._dbs[_ENTRIES]))
                txn.delete(k, db=self._dbs[_ACCESS])
        # LMDB reuses pages freed by a commit only after the next commit; make the space usable now
        with self._begin(write=True) as txn:
            txn.put(b"last_delete", _STAMP.pack(time.time(), removed), db=self._dbs[_META])
        return removed

    def evict(self, max_bytes: int) -> int:
        """Drop least-recently-used entries until the entries total at most `max_bytes`; returns the count."""
        with self._read() as txn:
            stamps = [(*_STAMP.unpack(v), bytes(k)) for k, v in txn.cursor(db=self._dbs[_ACCESS])]
        total = sum(size for _, size, _ in stamps)
        victims = []
        for _, size, key in sorted(stamps):  # oldest access first
            if total <= max_bytes:
                break
            victims.append(key)
            total -= size
        return self.delete(victims)

    def compact(self) -> tuple[int, int]:
        """Rewrite the file without free pages; returns (bytes before, bytes after).
        Needs exclusive use: no other process may have the store open."""
        data = self.path / "data.mdb"
        before = data.stat().st_size
        tmp = self.path / "compact.tmp"
        tmp.mkdir(exist_ok=True)
        (tmp / "data.mdb").unlink(missing_ok=True)
        self.env.copy(str(tmp), compact=True)
        self._env.close()
        os.replace(tmp / "data.mdb", data)  # atomic: the old or the new file, never a mix
        tmp.rmdir()
        self._open()
        return before, data.stat().st_size

    def quarantined(self) -> list[bytes]:
        if self._dbs[_QUARANTINE] is None:
            return []
        with self._read() as txn:
            return [bytes(k) for k in txn.cursor(db=self._dbs[_QUARANTINE]).iternext(keys=True, values=False)]

    def verify(self) -> dict[str, int]:
        """Check every entry's header and checksum (any model); quarantine the bad ones."""
        bad: list[tuple[bytes, bytes, str]] = []
        good = 0
        with self._read() as txn:
            for k, raw in txn.cursor(db=self._dbs[_ENTRIES]):
                try:
                    header, payload = _split(raw)
                    if _checksum(header, payload) != header.get("checksum"):
                        raise CorruptEntryError("checksum mismatch")
                    good += 1
                except StoreError as err:
                    bad.append((bytes(k), bytes(raw), str(err)))
        if bad:
            self._quarantine(bad)
        return {"ok": good, "quarantined": len(bad)}

    def stats(self) -> dict:
        """Entries, bytes used, entries per model fingerprint, quarantined entries, file size."""
        models: dict[str, int] = {}
        total = 0
        with self._read() as txn:
            for _, raw in txn.cursor(db=self._dbs[_ENTRIES]):
                try:
                    model = _split(raw)[0].get("fingerprint", "?")
                except StoreError:
                    model = "corrupted"
                models[model] = models.get(model, 0) + 1
                total += len(raw)
        return {"entries": sum(models.values()), "bytes": total, "models": models, "path": str(self.path),
                "quarantined": len(self.quarantined()), "file_bytes": (self.path / "data.mdb").stat().st_size}


__all__ = ["ChunkEntry", "CorruptEntryError", "KVStore", "LMDBStore", "StoreError", "StoreFullError", "entry_key", "FORMAT_VERSION"]
