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
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HEADER_LEN = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StoreError(RuntimeError):
    """A stored entry cannot be used: wrong model, wrong format version, or corrupted."""


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
    payload = keys.view(-1).view(torch.uint8).numpy().tobytes() + values.view(-1).view(torch.uint8).numpy().tobytes()
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


def _split(raw: memoryview | bytes) -> tuple[dict, memoryview]:
    """Header dict and payload view of an encoded entry."""
    view = memoryview(raw)
    if len(view) < _HEADER_LEN.size:
        raise StoreError("corrupted entry: shorter than its header")
    (head_len,) = _HEADER_LEN.unpack(view[: _HEADER_LEN.size])
    try:
        header = json.loads(bytes(view[_HEADER_LEN.size : _HEADER_LEN.size + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"corrupted entry: unreadable header ({err})") from err
    if not isinstance(header, dict):
        raise StoreError("corrupted entry: header is not an object")
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
        raise StoreError("corrupted entry: checksum mismatch")
    dtype = _DTYPES[header["dtype"]]
    shape = tuple(header["shape"])
    half = len(payload) // 2
    flat = torch.frombuffer(payload, dtype=torch.uint8)  # zero-copy view of the LMDB page
    keys = torch.empty(shape, dtype=dtype, device=device)
    values = torch.empty(shape, dtype=dtype, device=device)
    keys.view(-1).view(torch.uint8).copy_(flat[:half])
    values.view(-1).view(torch.uint8).copy_(flat[half:])
    return ChunkEntry(
        keys=keys,
        values=values,
        token_ids=tuple(header["token_ids"]),
        offsets=tuple(tuple(o) for o in header["offsets"]),
    )


class LMDBStore:
    """The LMDB-backed `KVStore`. The map grows on demand (doubling) when a write finds it full."""

    def __init__(self, path: str | Path, map_size: int = 1 << 30, readonly: bool = False):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.readonly = readonly
        self.env = lmdb.open(
            str(self.path), map_size=map_size, subdir=True, readonly=readonly, lock=True,
            max_readers=256, metasync=True, sync=True,
        )

    def __enter__(self) -> LMDBStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.env.close()

    def contains(self, key: bytes) -> bool:
        with self.env.begin(buffers=True) as txn:
            return txn.get(key) is not None

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(key)
            return None if raw is None else decode_entry(raw, fingerprint, device)

    def get_many(
        self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu"
    ) -> list[ChunkEntry | None]:
        with self.env.begin(buffers=True) as txn:
            return [None if (raw := txn.get(k)) is None else decode_entry(raw, fingerprint, device) for k in keys]

    def put(self, key: bytes, fingerprint: str, entry: ChunkEntry) -> None:
        self.put_many([(key, fingerprint, entry)])

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Write all items in one transaction: all are committed or none."""
        encoded = [(k, encode_entry(f, e)) for k, f, e in items]
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, raw in encoded:
                        txn.put(k, raw)
                return
            except lmdb.MapFullError:
                self._grow(sum(len(raw) for _, raw in encoded))

    def _grow(self, needed: int) -> None:
        size = self.env.info()["map_size"]
        new_size = max(size * 2, size + 2 * needed)
        log.info("growing LMDB map %s from %d to %d bytes", self.path, size, new_size)
        self.env.set_mapsize(new_size)

    def keys(self) -> Iterator[bytes]:
        with self.env.begin() as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                yield bytes(key)

    def stats(self) -> dict:
        """Entries, bytes used, and entries per model fingerprint."""
        models: dict[str, int] = {}
        total = 0
        with self.env.begin(buffers=True) as txn:
            for _, raw in txn.cursor():
                try:
                    model = _split(raw)[0].get("fingerprint", "?")
                except StoreError:
                    model = "corrupted"
                models[model] = models.get(model, 0) + 1
                total += len(raw)
        return {"entries": sum(models.values()), "bytes": total, "models": models, "path": str(self.path)}


__all__ = ["ChunkEntry", "KVStore", "LMDBStore", "StoreError", "entry_key", "FORMAT_VERSION"]
