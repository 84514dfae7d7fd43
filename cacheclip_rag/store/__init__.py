"""Chunk-cache storage, every store behind one protocol (`protocol`): the entry format (`entry`, `codec`,
`errors`), the LMDB store (`lmdb_store`, with its upkeep in `maintenance`), the Redis store (`redis_store`)
and a local store in front of it (`tiered_store`), the host and GPU tiers (`tiers`), a tenant's view of a
store (`namespaced`), and per-request read tallies (`tally`). Redis and the tiers are imported only by
who uses them."""

from .entry import (FORMAT_VERSION, FP8, FP8_MAX, STORE_DTYPES, ChunkEntry, EntryView, _checksum, as_stored, decode_entry,
                    encode_entry, entry_key, parse_entry, quantize_fp8, verify_entry)
from .errors import CorruptEntryError, StoreError, StoreFullError, StoreUnavailableError
from .lmdb_store import LMDBStore
from .protocol import KVStore, Slot, read_into_via_get
from .tally import ReadTally, record_read, tally_reads

__all__ = [
    "FORMAT_VERSION", "FP8", "FP8_MAX", "STORE_DTYPES", "ChunkEntry", "CorruptEntryError", "EntryView", "KVStore",
    "LMDBStore", "ReadTally", "Slot", "StoreError", "StoreFullError", "StoreUnavailableError", "as_stored", "decode_entry", "encode_entry",
    "entry_key", "parse_entry", "quantize_fp8", "read_into_via_get", "record_read", "tally_reads", "verify_entry",
]
