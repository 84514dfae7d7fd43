"""LMDB store of precomputed chunk KV caches.

One entry per (model fingerprint, shared-prefix token ids, chunk text, variant). An entry is

    [8-byte header length][header JSON][payload: K bytes, V bytes]

The header holds the format version, the fingerprint digest, dtype, shape [L, KV, T, D], the
chunk's token ids and character offsets, and a blake2b checksum over header fields and payload. A
float8_e4m3fn payload is followed by the float32 per-channel scales of K and V ([L, KV, 1, D] each)
and is read back as float32.
Reads verify the checksum on a zero-copy view inside the read transaction, then copy once into the
destination tensor. A mismatch of fingerprint or format version, or a bad checksum, raises; it is
never served.
"""

from __future__ import annotations

import contextvars
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import threading
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Protocol

import lmdb
import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HEADER_LEN = struct.Struct("<Q")
# the dtypes an entry can be stored in, by the name its header records
STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}
FP8 = torch.float8_e4m3fn  # stored with a float32 scale per channel (layer, head, dim): x = code * scale
FP8_MAX = 448.0  # e4m3fn's largest finite value


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
    model: str = field(default="", compare=False)  # the model's name, for people reading `inspect`
    # float8 keys/values only: their float32 scales per channel, [L, KV, 1, D] each (see `quantize_fp8`)
    scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)
    # how a decoded entry was stored when that is not its own dtype (float8, read back as float32)
    stored_dtype: torch.dtype | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        scales = sum(t.numel() * t.element_size() for t in self.scales) if self.scales else 0
        return self.keys.numel() * self.keys.element_size() * 2 + scales


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 codes and float32 scales per channel (amax over the tokens / 448), t: [L, KV, T, D].
    Keys have outlier channels, so one scale per channel keeps the small ones from rounding to zero."""
    x = t.detach().float()
    scale = (x.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


_FP16_MAX = 65504.0


def as_stored(entry: ChunkEntry, dtype: torch.dtype | None) -> ChunkEntry:
    """The entry in the storage dtype; an entry whose values overflow float16 is kept in bfloat16 (same
    size, fp32's range) rather than stored as inf; float8 gets a scale per channel (`quantize_fp8`)."""
    if dtype is None or entry.keys.dtype == dtype:
        return entry
    if dtype == FP8:
        (keys, key_scale), (values, value_scale) = quantize_fp8(entry.keys), quantize_fp8(entry.values)
        return replace(entry, keys=keys, values=values, scales=(key_scale, value_scale))
    if dtype == torch.float16 and max(float(entry.keys.abs().amax()), float(entry.values.abs().amax())) > _FP16_MAX:
        dtype = torch.bfloat16
    return replace(entry, keys=entry.keys.to(dtype), values=entry.values.to(dtype))


@cache
def _fp8_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes: decoding is a numpy table lookup (fork-safe)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy()


class ReadTally:
    """One request's store reads by tier ("device", "lmdb", "redis"): hits, misses and seconds. Stores
    record into the tally set for the current context (`tally_reads`); none is set outside a request."""

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, tier: str, hits: int, misses: int, seconds: float) -> None:
        with self._lock:
            for name, value in (("hits", hits), ("misses", misses), ("s", seconds)):
                key = f"{tier}_{name}"
                self._counts[key] = self._counts.get(key, 0) + value

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


_TALLY: contextvars.ContextVar[ReadTally | None] = contextvars.ContextVar("cacheclip_read_tally", default=None)


@contextmanager
def tally_reads() -> Iterator[ReadTally]:
    """Count the store reads made in this context (threads started with a copy of it included)."""
    tally = ReadTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def record_read(tier: str, found: Sequence[object | None], seconds: float) -> None:
    tally = _TALLY.get()
    if tally is not None:
        hits = sum(e is not None for e in found)
        tally.add(tier, hits, len(found) - hits, seconds)


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
    if dtype not in STORE_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"unsupported cache dtypes {keys.dtype}, {values.dtype}")
    payload = _raw_bytes(keys) + _raw_bytes(values)
    if keys.dtype == FP8:
        scale_shape = (*keys.shape[:2], 1, keys.shape[3])
        if entry.scales is None or any(tuple(t.shape) != scale_shape or t.dtype != torch.float32 for t in entry.scales):
            raise ValueError(f"a float8 entry needs float32 scales of shape {list(scale_shape)} for K and V")
        payload += b"".join(_raw_bytes(t.detach().to("cpu").contiguous()) for t in entry.scales)
    header = {
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "dtype": dtype,
        "shape": list(keys.shape),
        "token_ids": list(entry.token_ids),
        "offsets": [list(o) for o in entry.offsets],
    }
    if entry.model:
        header["model"] = entry.model
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
        with warnings.catch_warnings():  # LMDB's read-only page: torch warns it is not writable; we only read it
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(raw, dtype=torch.uint8)
        flat.copy_(source)
    return out


_MAX_HEADER = 64 << 20  # a header is token ids and offsets: far below this for any real chunk
_MAX_ABS = 1e5  # no real K/V element comes near this (fp16 tops out at 65504); a scaled payload does


def _split(raw: memoryview | bytes) -> tuple[dict, memoryview]:
    """Header dict and payload view of an encoded entry; any undecodable header is damage."""
    view = memoryview(raw)
    if len(view) < _HEADER_LEN.size:
        raise CorruptEntryError("corrupted entry: shorter than its header")
    (head_len,) = _HEADER_LEN.unpack(view[: _HEADER_LEN.size])
    if head_len > min(_MAX_HEADER, len(view) - _HEADER_LEN.size):
        raise CorruptEntryError(f"corrupted entry: header length {head_len} out of bounds")
    try:
        header = json.loads(bytes(view[_HEADER_LEN.size : _HEADER_LEN.size + head_len]))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise CorruptEntryError(f"corrupted entry: unreadable header ({type(err).__name__})") from err
    if not isinstance(header, dict):
        raise CorruptEntryError("corrupted entry: header is not an object")
    return header, view[_HEADER_LEN.size + head_len :]


def _verified(raw: memoryview | bytes) -> tuple[dict, memoryview]:
    """Header and payload whose checksum holds, else `CorruptEntryError`. Integrity comes before any
    field is believed: a flipped bit in the version or fingerprint is damage, not another model."""
    header, payload = _split(raw)
    if _checksum(header, payload) != header.get("checksum"):
        raise CorruptEntryError("corrupted entry: checksum mismatch")
    return header, payload


def _layout(header: dict, payload_bytes: int) -> tuple[torch.dtype, tuple[int, ...], tuple, tuple]:
    """dtype, shape [L, KV, T, D], token ids and offsets, each checked against the others and the
    payload's length before anything is allocated (a crafted shape must not allocate terabytes)."""
    dtype = STORE_DTYPES.get(header.get("dtype"))  # type: ignore[arg-type]
    shape, ids, offsets = header.get("shape"), header.get("token_ids"), header.get("offsets")
    if dtype is None:
        raise CorruptEntryError(f"corrupted entry: unknown dtype {header.get('dtype')!r}")
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(n) is int and n >= 0 for n in shape)):
        raise CorruptEntryError(f"corrupted entry: shape {shape!r} is not [L, KV, T, D]")
    if not (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)):
        raise CorruptEntryError("corrupted entry: token ids missing or not integers")
    if not (isinstance(offsets, list) and all(isinstance(o, list) and len(o) == 2 and all(type(c) is int for c in o)
                                              for o in offsets)):
        raise CorruptEntryError("corrupted entry: character offsets missing or malformed")
    if shape[2] != len(ids) or len(offsets) not in (0, len(ids)):  # the prefix entry has no offsets
        raise CorruptEntryError(f"corrupted entry: {shape[2]} cached rows for {len(ids)} token ids and "
                                f"{len(offsets)} offsets")
    expected = 2 * math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if dtype == FP8:
        expected += 2 * shape[0] * shape[1] * shape[3] * 4
    if expected != payload_bytes:
        raise CorruptEntryError(f"corrupted entry: {payload_bytes} payload bytes for shape {shape} {header['dtype']}")
    return dtype, tuple(shape), tuple(ids), tuple(tuple(o) for o in offsets)


# |x| <= _MAX_ABS as a bound on the magnitude bits (sign cleared) of each format: IEEE floats order
# like their bit patterns, and NaN and inf lie above every finite bound, so one integer max per
# tensor checks finiteness and magnitude, and max == 0 means all zeros
_MAGNITUDE = {torch.float32: (np.uint32, 0x7FFFFFFF, int(np.array(_MAX_ABS, np.float32).view(np.uint32))),
              torch.float16: (np.uint16, 0x7FFF, 0x7BFF),  # fp16's largest finite value is below _MAX_ABS
              torch.bfloat16: (np.uint16, 0x7FFF, int(np.array(_MAX_ABS, np.float32).view(np.uint32)) >> 16)}


def _check_values(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Finite, of plausible magnitude, keys not all zero. On the CPU with numpy on the bit patterns,
    single-threaded (fork-safe, see `_tensor_from_bytes`), one pass a tensor over data just copied;
    on a GPU with torch, with one sync."""
    if keys.device.type != "cpu":
        for name, t in (("keys", keys), ("values", values)):
            if t.numel() and not bool(torch.isfinite(t).all() & (t.abs().amax() <= _MAX_ABS)):
                raise CorruptEntryError(f"corrupted entry: {name} hold NaN, inf or values beyond {_MAX_ABS:g}")
        if keys.numel() and not bool(keys.any()):
            raise CorruptEntryError("corrupted entry: keys are all zero")
        return
    unsigned, mask, limit = _MAGNITUDE[keys.dtype]
    for name, t in (("keys", keys), ("values", values)):
        if t.numel() == 0:
            continue
        top = int(np.bitwise_and(t.view(_INT_OF_SIZE[t.element_size()]).numpy().view(unsigned), mask).max())
        if top > limit:
            raise CorruptEntryError(f"corrupted entry: {name} hold NaN, inf or values beyond {_MAX_ABS:g}")
        if name == "keys" and top == 0:
            raise CorruptEntryError("corrupted entry: keys are all zero")


def _dequantized_fp8(payload: memoryview, shape: tuple[int, ...], device: torch.device | str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V from float8 codes and their per-channel scales (layout checked by `_layout`).
    On the CPU numpy decodes (a table lookup, then the scale), single-threaded as `_tensor_from_bytes`."""
    n, scale_shape = math.prod(shape), (shape[0], shape[1], 1, shape[3])
    m = math.prod(scale_shape)
    parts = (payload[:n], payload[n : 2 * n])
    scales = [payload[2 * n + 4 * m * i : 2 * n + 4 * m * (i + 1)] for i in range(2)]
    out = []
    for codes, scale in zip(parts, scales):
        if torch.device(device).type == "cpu":
            values = _fp8_table()[np.frombuffer(codes, dtype=np.uint8)].reshape(shape)
            values *= np.frombuffer(scale, dtype=np.float32).reshape(scale_shape)
            out.append(torch.from_numpy(values))
        else:
            q = _tensor_from_bytes(codes, shape, FP8, device)
            out.append(q.float() * _tensor_from_bytes(scale, scale_shape, torch.float32, device))
    return out[0], out[1]


def decode_entry(raw: memoryview | bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry:
    """Verify and decode an entry; `raw` may be a zero-copy buffer valid only inside its transaction.

    `CorruptEntryError` for anything damaged or impossible (checksum, header, layout, values);
    `StoreError` for a whole entry of another format version or model."""
    header, payload = _verified(raw)
    if header.get("version") != FORMAT_VERSION:
        raise StoreError(f"entry has format version {header.get('version')}, this library reads {FORMAT_VERSION}")
    if header.get("fingerprint") != fingerprint:
        raise StoreError(
            f"entry was written by model {header.get('fingerprint')}, not by the requested model {fingerprint}"
        )
    dtype, shape, token_ids, offsets = _layout(header, len(payload))
    if dtype == FP8:
        keys, values = _dequantized_fp8(payload, shape, device)
    else:
        half = len(payload) // 2
        keys = _tensor_from_bytes(payload[:half], shape, dtype, device)
        values = _tensor_from_bytes(payload[half:], shape, dtype, device)
    _check_values(keys, values)
    return ChunkEntry(keys=keys, values=values, token_ids=token_ids, offsets=offsets, model=str(header.get("model", "")),
                      stored_dtype=FP8 if dtype == FP8 else None)


class StoreFullError(StoreError):
    """The store reached its size cap or the disk is full; the failed write left everything as it was."""


_ENTRIES, _ACCESS, _QUARANTINE, _META = b"entries", b"access", b"quarantine", b"meta"
_STAMP = struct.Struct("<dQ")
# How LMDB reports a write the filesystem refused (ENOSPC, EFBIG past a size limit, EDQUOT; a short
# write at commit surfaces as EIO)
_DISK_FULL = ("No space left", "File too large", "Disk quota", "Input/output error")  # last access time (s), entry size (bytes)


class _SharedExclusiveLock:
    """Many holders in shared mode or one in exclusive mode (threads of one process); a waiting
    exclusive request stops new shared ones, so map growth is not starved by a stream of reads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


_MARKER = b"cacheclip-store"
_LOCK_FILE = "cacheclip.lock"


class LMDBStore:
    """The LMDB-backed `KVStore`.

    - Atomic: `put_many` commits all its items or none (LMDB transactions, synced to disk), so a
      writer killed at any moment leaves only whole, checksummed entries.
    - Threads: every method may be called from any number of threads at once. Each transaction runs
      under a shared in-process lock and a map resize under the exclusive one: LMDB may move the map
      only while no transaction of this process is open (a reader's zero-copy view would point into
      unmapped memory, a segfault).
    - Processes: each process opens its own environment; a store object carried across `fork` reopens
      itself in the child. Readers and writers in several processes may share one directory; LMDB
      serialises writers. Reads and writes copy bytes with numpy, never with a parallel torch op, so
      they work in a child forked after the parent used torch's OpenMP pool (which would hang there).
      Torch work of your own in such a child still can: use the `spawn` start method, or call
      `torch.set_num_threads(1)` first in the child, as torch's DataLoader workers do. Readers left by
      killed processes are cleared on open and whenever the reader table fills.
    - Growth: the map doubles when a write finds it full, up to `max_bytes`; past it (or on a full
      disk) `StoreFullError` is raised and nothing stored is touched. Other processes adopt a grown map.
    - Integrity: an entry is believed only after its checksum; one that is damaged or impossible
      (shape, rows, payload length, non-finite or absurd values) is moved to a quarantine table,
      logged, and reported as missing (so it is recomputed); it is never served. An intact entry of
      another model or format version raises `StoreError`. A truncated file is refused on open.
    - Space: `evict(max_bytes)` drops least-recently-used entries; `compact()` rewrites the file
      without free pages, and refuses while another process has the store open (a file lock that
      every open store holds shared).
    - Only our own directories are opened: another program's LMDB is refused, never modified.
      `readonly=True` works on read-only media (no lock file is written there).
    """

    def __init__(self, path: str | Path, map_size: int = 1 << 30, readonly: bool = False,
                 max_bytes: int | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self.max_bytes = max_bytes
        if max_bytes is not None and max_bytes < 1 << 20:
            raise ValueError(f"max_bytes must be at least 1 MiB, got {max_bytes}")
        self._map_size = min(map_size, max_bytes) if max_bytes else map_size
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"{self.path} is a file, not a store directory")
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / "data.mdb").exists():
            raise StoreError(f"no store at {self.path}")
        self._open()

    # ---- opening -----------------------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        self._lock = _SharedExclusiveLock()
        self._lockfile = self._hold_lock_file()
        try:
            self._open_env()
        except BaseException:
            self._release_lock_file()
            raise

    def _hold_lock_file(self) -> int | None:
        """A shared flock held while the store is open; compaction needs it exclusively. Opening waits
        while another process compacts (a few seconds at most)."""
        try:
            fd = os.open(self.path / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            if not self.readonly:
                raise
            return None  # read-only media: nobody can compact it either
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _release_lock_file(self) -> None:
        if self._lockfile is not None:
            os.close(self._lockfile)  # closing drops this process's flock
            self._lockfile = None

    def _open_env(self) -> None:
        stale = self.path / "compact.tmp"
        if stale.exists() and not self.readonly:  # a compaction killed midway; we hold the lock file,
            shutil.rmtree(stale, ignore_errors=True)  # so none is running now
        writable_lock = os.access(self.path, os.W_OK) and (
            not (self.path / "lock.mdb").exists() or os.access(self.path / "lock.mdb", os.W_OK))
        use_lock = not self.readonly or writable_lock
        for _ in range(100):  # another process may grow the map while we open the file or its tables
            try:
                self._env = lmdb.open(
                    str(self.path), map_size=self._map_size, subdir=True, readonly=self.readonly, lock=use_lock,
                    max_readers=256, max_dbs=4, metasync=True, sync=True,
                )
                break
            except lmdb.MapResizedError:  # a failed open leaves nothing open; try again
                time.sleep(0.01)
            except lmdb.Error as err:
                raise StoreError(f"cannot open the store at {self.path}: {err}") from err
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        if use_lock:
            self._env.reader_check()  # slots of readers whose process died
        self._check_not_truncated()
        self._refuse_foreign()
        create = not self.readonly
        for _ in range(100):
            try:
                self._dbs = {name: self._env.open_db(name, create=create) if create or self._has_db(name) else None
                             for name in (_ENTRIES, _ACCESS, _QUARANTINE, _META)}
                break
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
            except lmdb.Error as err:
                self._env.close()
                raise StoreError(f"{self.path} is not a cacheclip store ({err})") from err
        else:
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        if self._dbs[_ENTRIES] is None:
            raise StoreError(f"{self.path} is not a cacheclip store (no entries table)")
        if create:
            with self._transaction(write=True) as txn:
                txn.put(b"format", _MARKER, db=self._dbs[_META], overwrite=False)

    def _refuse_foreign(self) -> None:
        """An existing LMDB whose main table names anything but our four tables is another program's:
        refuse it before a single table is added to it (opening the environment wrote nothing to it).
        Read through this environment: a second one on the same files in one process would drop
        LMDB's per-process file locks when closed."""
        for _ in range(100):
            try:
                with self._env.begin() as txn:
                    names = {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}
                break
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)
        else:
            self._env.close()
            raise StoreError(f"{self.path}: the map kept being resized by other processes")
        foreign = names - {_ENTRIES, _ACCESS, _QUARANTINE, _META}
        if foreign:
            self._env.close()
            shown = ", ".join(sorted(n.decode("utf-8", "replace") for n in foreign)[:5])
            raise StoreError(f"{self.path} holds another program's LMDB database (keys: {shown}); "
                             "it is not a cacheclip store and was left untouched")

    def _check_not_truncated(self) -> None:
        """Pages past the end of the file would be a SIGBUS on first touch: refuse the file instead."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * psize
        size = (self.path / "data.mdb").stat().st_size
        if size < needed:
            self._env.close()
            raise StoreError(f"{self.path / 'data.mdb'} is truncated: {size:,} bytes, but its last committed "
                             f"page ends at {needed:,}. Restore it from a copy, or move it away to start empty.")

    def _has_db(self, name: bytes) -> bool:
        with self._env.begin() as txn:  # MapResizedError here is retried by the caller's loop
            return txn.get(name) is not None

    @property
    def env(self) -> lmdb.Environment:
        """This process's environment (reopened after a fork: LMDB handles must not cross one)."""
        if os.getpid() != self._pid:
            # The parent's handle must not be used here. Closing it in the child only unmaps the file
            # and forgets it (LMDB clears reader slots of this pid only, and fcntl locks are not
            # inherited), which lets this process open its own environment on the same files. The
            # inherited lock-file descriptor shares the parent's flock: keep it open (closing it here
            # would not release the parent's lock, and the child takes its own).
            self._env.close()
            self._lockfile = None
            self._open()
        return self._env

    def __enter__(self) -> LMDBStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock.exclusive():
            self._env.close()
        self._release_lock_file()

    # ---- transactions ------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """A transaction, committed on success; a map grown by another process is adopted first, and
        a reader table full of dead processes' slots is cleared."""
        env = self.env
        for _ in range(100):
            with self._lock.shared():
                try:
                    txn = env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                except lmdb.ReadersFullError:
                    txn = None
                    env.reader_check()
                if txn is not None:
                    with txn:
                        yield txn
                    return
            with self._lock.exclusive():
                env.set_mapsize(0)  # 0: adopt the size another process set
        raise StoreError(f"{self.path}: could not begin a transaction (map resized or reader table full)")

    def contains(self, key: bytes) -> bool:
        with self._transaction() as txn:
            return txn.get(key, db=self._dbs[_ENTRIES]) is not None

    def get(self, key: bytes, fingerprint: str, device: torch.device | str = "cpu") -> ChunkEntry | None:
        return self.get_many([key], fingerprint, device)[0]

    def get_many(
        self, keys: list[bytes], fingerprint: str, device: torch.device | str = "cpu"
    ) -> list[ChunkEntry | None]:
        """Entries for `keys` (None where missing or quarantined now); records the access for LRU."""
        started = time.perf_counter()
        found: list[ChunkEntry | None] = []
        corrupted: list[tuple[bytes, bytes, str]] = []
        with self._transaction() as txn:
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
        record_read("lmdb", found, time.perf_counter() - started)
        return found

    def quarantine(self, key: bytes, why: str) -> None:
        """Move an entry that its reader found unusable (e.g. the wrong layout for its model) aside."""
        with self._transaction() as txn:
            raw = txn.get(key, db=self._dbs[_ENTRIES])
            raw = None if raw is None else bytes(raw)
        if raw is not None:
            self._quarantine([(key, raw, why)])

    def _quarantine(self, items: list[tuple[bytes, bytes, str]]) -> None:
        for key, _, why in items:
            log.error("store %s: entry %s is corrupted (%s); quarantined, it will be recomputed", self.path, key.hex(), why)
        if self.readonly:
            raise StoreError(f"corrupted entries in read-only store {self.path}: {[k.hex() for k, _, _ in items]}")
        with self._transaction(write=True) as txn:
            for key, raw, _ in items:
                txn.put(key, raw, db=self._dbs[_QUARANTINE])
                txn.delete(key, db=self._dbs[_ENTRIES])
                txn.delete(key, db=self._dbs[_ACCESS])

    def _touch(self, keys: list[bytes]) -> None:
        if not keys:
            return
        now = time.time()
        try:
            with self._transaction(write=True) as txn:
                for k in keys:
                    old = txn.get(k, db=self._dbs[_ACCESS])
                    size = _STAMP.unpack(old)[1] if old is not None else 0
                    txn.put(k, _STAMP.pack(now, size), db=self._dbs[_ACCESS])
        except (lmdb.Error, StoreError) as err:
            # access times are a hint for eviction: a full map or disk must never fail a read
            log.debug("store %s: access times not recorded (%s)", self.path, err)

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
                with self._transaction(write=True) as txn:
                    for k, raw in encoded:
                        txn.put(k, raw, db=self._dbs[_ENTRIES])
                        txn.put(k, _STAMP.pack(now, len(raw)), db=self._dbs[_ACCESS])
                return
            except lmdb.MapFullError:
                self._grow(sum(len(raw) for _, raw in encoded))  # outside the transaction: it moves the map
            except lmdb.Error as err:
                raise self._disk_error(err) from err

    def _disk_error(self, err: lmdb.Error) -> Exception:
        if any(cause in str(err) for cause in _DISK_FULL):
            return StoreFullError(
                f"writing to {self.path} failed ({err}): the disk is full (or failing). This write was "
                "rolled back; everything stored before is intact. Free space, then retry."
            )
        return err

    def _grow(self, needed: int) -> None:
        with self._lock.exclusive():  # no transaction of this process may be open while the map moves
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
        """Every entry's key (a snapshot: no transaction stays open while the caller iterates)."""
        with self._transaction() as txn:
            keys = [bytes(k) for k in txn.cursor(db=self._dbs[_ENTRIES]).iternext(keys=True, values=False)]
        return iter(keys)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove entries; returns how many existed."""
        removed = 0
        with self._transaction(write=True) as txn:
            for k in keys:
                removed += bool(txn.delete(k, db=self._dbs[_ENTRIES]))
                txn.delete(k, db=self._dbs[_ACCESS])
        # LMDB reuses pages freed by a commit only after the next commit; make the space usable now
        with self._transaction(write=True) as txn:
            txn.put(b"last_delete", _STAMP.pack(time.time(), removed), db=self._dbs[_META])
        return removed

    def evict(self, max_bytes: int) -> int:
        """Drop least-recently-used entries until the entries total at most `max_bytes`; returns the count."""
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        with self._transaction() as txn:
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

        Refuses (`StoreError`) while another process has the store open: it would go on writing into
        the replaced file and lose those writes. Processes that open the store meanwhile wait for it.
        A full disk raises `StoreFullError` and leaves the store as it was."""
        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        self.env  # reopen first if this object crossed a fork
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"cannot compact {self.path}: another process has the store open. Stop it "
                             "(servers, ingest runs) and retry; compaction needs the store to itself.") from None
        data = self.path / "data.mdb"
        tmp = self.path / "compact.tmp"
        try:
            with self._lock.exclusive():
                before = data.stat().st_size
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                try:
                    self._env.copy(str(tmp), compact=True)
                except lmdb.Error as err:
                    raise self._disk_error(err) from err
                self._env.close()
                os.replace(tmp / "data.mdb", data)  # atomic: the old or the new file, never a mix
            self._open_env()
            return before, data.stat().st_size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            fcntl.flock(self._lockfile, fcntl.LOCK_SH)

    def quarantined(self) -> list[bytes]:
        if self._dbs[_QUARANTINE] is None:
            return []
        with self._transaction() as txn:
            return [bytes(k) for k in txn.cursor(db=self._dbs[_QUARANTINE]).iternext(keys=True, values=False)]

    def verify(self) -> dict[str, int]:
        """Check every entry's checksum and layout (any model); quarantine the bad ones."""
        bad: list[tuple[bytes, bytes, str]] = []
        good = 0
        with self._transaction() as txn:
            for k, raw in txn.cursor(db=self._dbs[_ENTRIES]):
                try:
                    header, payload = _verified(raw)
                    _layout(header, len(payload))
                    good += 1
                except StoreError as err:
                    bad.append((bytes(k), bytes(raw), str(err)))
        if bad:
            self._quarantine(bad)
        return {"ok": good, "quarantined": len(bad)}

    def stats(self) -> dict:
        """Entries, bytes used, quarantined entries, file size, and per model fingerprint: its entries,
        bytes, tokens, bytes per token, storage dtypes and model names (as the writers recorded them)."""
        models: dict[str, dict] = {}
        total = 0
        with self._transaction() as txn:
            for _, raw in txn.cursor(db=self._dbs[_ENTRIES]):
                try:
                    header = _split(raw)[0]
                    model, tokens = str(header.get("fingerprint", "?")), int(header["shape"][2])
                except (StoreError, KeyError, TypeError, ValueError, IndexError):
                    header, model, tokens = {}, "corrupted", 0
                row = models.setdefault(model, {"entries": 0, "bytes": 0, "tokens": 0, "dtypes": set(), "names": set()})
                row["entries"] += 1
                row["bytes"] += len(raw)
                row["tokens"] += tokens
                row["dtypes"].add(str(header.get("dtype", "?")))
                if header.get("model"):
                    row["names"].add(str(header["model"]))
                total += len(raw)
        for row in models.values():
            row["bytes_per_token"] = row["bytes"] / row["tokens"] if row["tokens"] else None
            row["dtypes"], row["names"] = sorted(row["dtypes"]), sorted(row["names"])
        return {"entries": sum(r["entries"] for r in models.values()), "bytes": total, "models": models,
                "path": str(self.path), "quarantined": len(self.quarantined()),
                "file_bytes": (self.path / "data.mdb").stat().st_size}


__all__ = ["ReadTally", "tally_reads", "ChunkEntry", "CorruptEntryError", "KVStore", "LMDBStore", "StoreError", "StoreFullError", "entry_key", "FORMAT_VERSION"]
