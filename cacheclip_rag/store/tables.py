"""The LMDB store's tables and the access record it keeps per entry."""

import struct

ENTRIES, ACCESS, QUARANTINE, META = b"entries", b"access", b"quarantine", b"meta"
# who uses an entry (`owners`): owner -> its keys and group; group -> its owners; key -> owner count
OWNERS, GROUPS, REFS = b"owners", b"groups", b"refs"
# every ingested chunk's text in the order it came (8-byte sequence number -> text), and each text's
# number by its hash: what a server recognises in prompts, read incrementally (`texts_since`)
TEXTS, TEXT_IDS = b"texts", b"text_ids"
# per owned text (by its sha256): the keys of every entry computed from it, deleted with it (`texts`)
TEXT_KEYS = b"text_keys"
TABLES = (ENTRIES, ACCESS, QUARANTINE, META, OWNERS, GROUPS, REFS, TEXTS, TEXT_IDS, TEXT_KEYS)
SEQ = struct.Struct(">Q")  # big-endian: LMDB orders the keys by number
STAMP = struct.Struct("<dQ")  # last access time (s), entry size (bytes)
COUNT = struct.Struct("<Q")
LOCK_FILE = "cacheclip.lock"
