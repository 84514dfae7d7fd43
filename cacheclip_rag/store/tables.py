"""The LMDB store's tables and the access record it keeps per entry."""

import struct

ENTRIES, ACCESS, QUARANTINE, META = b"entries", b"access", b"quarantine", b"meta"
# who uses an entry (`owners`): owner -> its keys and group; group -> its owners; key -> owner count
OWNERS, GROUPS, REFS = b"owners", b"groups", b"refs"
TABLES = (ENTRIES, ACCESS, QUARANTINE, META, OWNERS, GROUPS, REFS)
STAMP = struct.Struct("<dQ")  # last access time (s), entry size (bytes)
COUNT = struct.Struct("<Q")
LOCK_FILE = "cacheclip.lock"
