"""The stored form of a chunk's KV cache: one self-describing, checksummed byte string per entry.

    [8-byte header length][header JSON][payload: K bytes, V bytes (, float8 scales of K and V)]

The header (format version 2) holds the entry's own store key, the model fingerprint, dtype, shape
[L, KV, T, D], the chunk's token ids and character offsets, and an xxh3-128 checksum over the other
header fields and the payload. Binding the key means an intact entry copied under another chunk's
key is damage, not a cache hit. Version 1 entries (blake2b, no key) are still read.

Reading is split so the hot path stays at memory speed:
- `parse_entry`: header, version, fingerprint, key, and a layout checked against the payload length
  (all cheap: nothing is allocated from a declared shape before it matches the bytes).
- `verify_entry`: the checksum and a scan of every value (finite, plausible, keys not all zero). A
  store runs it on an entry's first read in a process, on every `verify`, and never again for the
  same stored bytes; see `LMDBStore`.
The checksum detects damage; it does not authenticate. Anyone who can write the store can plant an
entry that passes it: only the processes that serve a deployment may write to its store.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
import xxhash

from .codec import check_values, copy_into, raw_bytes, tensor_from_payload
from .errors import CorruptEntryError, StoreError, StoreFullError, StoreUnavailableError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_LEN = struct.Struct("<Q")
# the dtypes an entry can be stored in, by the name its header records
STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}
FP8 = torch.float8_e4m3fn  # stored with a float32 scale per channel (layer, head, dim): x = code * scale
FP8_MAX = 448.0  # e4m3fn's largest finite value
_FP16_MAX = 65504.0
_MAX_HEADER = 64 << 20  # a header is token ids and offsets: far below this for any real chunk


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


def entry_key(fingerprint: str, prefix_ids: Iterable[int], text: str, variant: str) -> bytes:
    """Store key: a hash, so no text can steer where or what the store reads or writes."""
    digest = hashlib.sha256()
    for part in (fingerprint, variant, ",".join(map(str, prefix_ids)), text):
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(HEADER_LEN.pack(len(encoded)))
        digest.update(encoded)
    return digest.digest()


def _checksum(header: dict, payload: memoryview | bytes) -> str:
    """The checksum of `header` (its other fields) and `payload`, by the header's format version."""
    fields = json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode()
    if header.get("version") == 1:
        digest = hashlib.blake2b(digest_size=16)
    else:
        digest = xxhash.xxh3_128()
    digest.update(fields)
    digest.update(payload)
    return digest.hexdigest()


def encode_entry(fingerprint: str, entry: ChunkEntry, key: bytes = b"") -> bytes:
    """The entry's bytes under store `key` (recorded, so the checksum binds it). Refuses values no reader
    would accept (NaN, inf, |x| > 1e5, all-zero keys), so a broken model fails at ingest, named."""
    keys = entry.keys.detach().to("cpu").contiguous()
    values = entry.values.detach().to("cpu").contiguous()
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    dtype = str(keys.dtype).removeprefix("torch.")
    if dtype not in STORE_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"unsupported cache dtypes {keys.dtype}, {values.dtype}")
    payload = raw_bytes(keys) + raw_bytes(values)
    if keys.dtype == FP8:
        scale_shape = (*keys.shape[:2], 1, keys.shape[3])
        if entry.scales is None or any(tuple(t.shape) != scale_shape or t.dtype != torch.float32 for t in entry.scales):
            raise ValueError(f"a float8 entry needs float32 scales of shape {list(scale_shape)} for K and V")
        payload += b"".join(raw_bytes(t.detach().to("cpu").contiguous()) for t in entry.scales)
    header = {
        "version": FORMAT_VERSION,
        "key": key.hex(),
        "fingerprint": fingerprint,
        "dtype": dtype,
        "shape": list(keys.shape),
        "token_ids": list(entry.token_ids),
        "offsets": [list(o) for o in entry.offsets],
    }
    if entry.model:
        header["model"] = entry.model
    view = EntryView(header, memoryview(payload), dtype=keys.dtype, shape=tuple(keys.shape),
                     token_ids=tuple(entry.token_ids), offsets=tuple(tuple(o) for o in entry.offsets))
    try:
        check_values(view.key_bytes, view.value_bytes, view.dtype, view.scale_bytes)
    except CorruptEntryError as err:
        raise ValueError(f"refusing to store a chunk cache no reader would accept: {err}") from None
    header["checksum"] = _checksum(header, payload)
    head = json.dumps(header).encode()
    return HEADER_LEN.pack(len(head)) + head + payload


@dataclass(frozen=True)
class EntryView:
    """A parsed entry over its payload bytes (often a zero-copy view valid only inside its transaction)."""

    header: dict
    payload: memoryview
    dtype: torch.dtype  # as stored
    shape: tuple[int, int, int, int]  # [L, KV, T, D]
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]

    @property
    def checksum(self) -> str:
        return str(self.header.get("checksum"))

    @property
    def model(self) -> str:
        return str(self.header.get("model", ""))

    @property
    def _elements(self) -> int:
        return math.prod(self.shape)

    @property
    def key_bytes(self) -> memoryview:
        n = self._elements * _itemsize(self.dtype)
        return self.payload[:n]

    @property
    def value_bytes(self) -> memoryview:
        n = self._elements * _itemsize(self.dtype)
        return self.payload[n : 2 * n]

    @property
    def scale_bytes(self) -> tuple[memoryview, memoryview] | None:
        if self.dtype != FP8:
            return None
        n, m = self._elements, self.shape[0] * self.shape[1] * self.shape[3] * 4
        return self.payload[2 * n : 2 * n + m], self.payload[2 * n + m : 2 * n + 2 * m]

    @property
    def decoded_dtype(self) -> torch.dtype:
        """The dtype the entry reads back as (float8 decodes to float32)."""
        return torch.float32 if self.dtype == FP8 else self.dtype

    def decode(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               pin: bool = False) -> ChunkEntry:
        """The entry as new tensors on `device` in `dtype` (default its decoded dtype); one copy."""
        dtype = dtype or self.decoded_dtype
        keys = tensor_from_payload(self.key_bytes, self.shape, self.dtype, dtype=dtype, device=device,
                                   scale=self._scale(0), pin=pin)
        values = tensor_from_payload(self.value_bytes, self.shape, self.dtype, dtype=dtype, device=device,
                                     scale=self._scale(1), pin=pin)
        return ChunkEntry(keys=keys, values=values, token_ids=self.token_ids, offsets=self.offsets, model=self.model,
                          stored_dtype=FP8 if self.dtype == FP8 else None)

    def copy_into(self, slot: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Decode keys and values into `slot` ([L, KV, T, D] views of any dtype, device, strides)."""
        copy_into(self.key_bytes, self.shape, self.dtype, slot[0], scale=self._scale(0))
        copy_into(self.value_bytes, self.shape, self.dtype, slot[1], scale=self._scale(1))

    def _scale(self, i: int) -> memoryview | None:
        scales = self.scale_bytes
        return None if scales is None else scales[i]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def split_entry(raw: memoryview | bytes) -> tuple[dict, memoryview]:
    """Header dict and payload view of an encoded entry; any undecodable header is damage."""
    view = memoryview(raw)
    if len(view) < HEADER_LEN.size:
        raise CorruptEntryError("corrupted entry: shorter than its header")
    (head_len,) = HEADER_LEN.unpack(view[: HEADER_LEN.size])
    if head_len > min(_MAX_HEADER, len(view) - HEADER_LEN.size):
        raise CorruptEntryError(f"corrupted entry: header length {head_len} out of bounds")
    try:
        header = json.loads(bytes(view[HEADER_LEN.size : HEADER_LEN.size + head_len]))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise CorruptEntryError(f"corrupted entry: unreadable header ({type(err).__name__})") from err
    if not isinstance(header, dict):
        raise CorruptEntryError("corrupted entry: header is not an object")
    return header, view[HEADER_LEN.size + head_len :]


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
    expected = 2 * math.prod(shape) * _itemsize(dtype)
    if dtype == FP8:
        expected += 2 * shape[0] * shape[1] * shape[3] * 4
    if expected != payload_bytes:
        raise CorruptEntryError(f"corrupted entry: {payload_bytes} payload bytes for shape {shape} {header['dtype']}")
    return dtype, tuple(shape), tuple(ids), tuple(tuple(o) for o in offsets)


def header_bytes(raw: memoryview | bytes) -> bytes:
    """The encoded header alone (for a store's cheap "same bytes as before?" test); b"" if unreadable."""
    view = memoryview(raw)
    if len(view) < HEADER_LEN.size:
        return b""
    (head_len,) = HEADER_LEN.unpack(view[: HEADER_LEN.size])
    return bytes(view[HEADER_LEN.size : HEADER_LEN.size + min(head_len, _MAX_HEADER)])


def check_identity(view: EntryView, fingerprint: str | None, key: bytes | None) -> None:
    """`StoreError` for an intact entry of another model; `CorruptEntryError` for one that records
    another key than the one it is stored under."""
    if view.header.get("version") >= 2 and key is not None and view.header.get("key") != key.hex():
        raise CorruptEntryError(f"corrupted entry: it records key {str(view.header.get('key'))[:16]}..., not the key "
                                f"it is stored under ({key.hex()[:16]}...)")
    if fingerprint is not None and view.header.get("fingerprint") != fingerprint:
        raise StoreError(
            f"entry was written by model {view.header.get('fingerprint')}, not by the requested model {fingerprint}"
        )


def parse_entry(raw: memoryview | bytes, fingerprint: str | None = None, key: bytes | None = None,
                checked: bool = False, scan_values: bool = True) -> EntryView:
    """The entry's header and payload, its layout checked against the payload (cheap, every read).

    Unless `checked` (bytes the caller verified before) the checksum is checked first, and the values
    scanned (`verify_entry`) unless `scan_values` is False. `CorruptEntryError` for anything damaged
    or impossible, including an entry whose recorded key is not `key`; `StoreError` for an intact
    entry of another model or of a format version this library does not read."""
    header, payload = split_entry(raw)
    if not checked and _checksum(header, payload) != header.get("checksum"):
        raise CorruptEntryError("corrupted entry: checksum mismatch")
    version = header.get("version")
    if version not in READABLE_VERSIONS:
        raise StoreError(f"entry has format version {version!r}; this library reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))} (rebuild the store with `cacheclip ingest`)")
    dtype, shape, token_ids, offsets = _layout(header, len(payload))
    view = EntryView(header, payload, dtype=dtype, shape=shape, token_ids=token_ids, offsets=offsets)  # type: ignore[arg-type]
    check_identity(view, fingerprint, key)
    if not checked and scan_values:
        check_values(view.key_bytes, view.value_bytes, view.dtype, view.scale_bytes)
    return view


def verify_entry(raw: memoryview | bytes, key: bytes | None = None) -> EntryView:
    """Every check `parse_entry` makes, the checksum and the value scan included, for any model."""
    return parse_entry(raw, None, key, checked=False)


def decode_entry(raw: memoryview | bytes, fingerprint: str, device: torch.device | str = "cpu",
                 key: bytes | None = None) -> ChunkEntry:
    """Verify and decode an entry into new tensors (see `parse_entry` for what raises)."""
    return parse_entry(raw, fingerprint, key).decode(device)


__all__ = ["FORMAT_VERSION", "STORE_DTYPES", "FP8", "ChunkEntry", "EntryView", "StoreError", "CorruptEntryError",
           "StoreFullError", "StoreUnavailableError", "quantize_fp8", "as_stored", "entry_key", "encode_entry", "parse_entry", "verify_entry",
           "decode_entry", "split_entry"]
