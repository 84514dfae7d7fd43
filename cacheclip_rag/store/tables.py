"""The LMDB store's tables and the access record it keeps per entry."""

import struct

ENTRIES, ACCESS, QUARANTINE, META = b"entries", b"access", b"quarantine", b"meta"
TABLES = (ENTRIES, ACCESS, QUARANTINE, META)
STAMP = struct.Struct("<dQ")  # last access time (s), entry size (bytes)
LOCK_FILE = "cacheclip.lock"
