"""Chunk-cache storage: the entry format (`entry`, `codec`), the LMDB store (`lmdb_store`, with its
upkeep in `maintenance`), per-request read tallies (`tally`) and the protocol every store and tier
follows (`protocol`)."""

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
