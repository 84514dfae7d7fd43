"""The remembered-texts log every store keeps (what servers recognise in prompts): texts in arrival order,
and, when a text is forgotten (its last owner released), a tombstone in its place at the log's end, so
every reader of `texts_since` (a server's recognition index, a replica's) drops it at its next read.

A tombstone names the forgotten text by its sha256 in its namespace (`marked` as the text was), never by
its words: the store keeps nothing of a deleted text. It starts with a NUL character, which no ingested
text can hold (`config.check_text`), so no client text can pose as one.

Owners hold texts (`text_ref`: the key counting a text's owners, kept beside the entry keys' counts), and
each text lists every entry computed from it (`record_entries`: at ingest and on a request's miss), so
forgetting a text deletes all of them.
"""

from __future__ import annotations

import hashlib

from .namespaced import _FORGOTTEN as FORGOTTEN
from .namespaced import marked, split_marked
_REF = b"\x00text:"


def text_digest(text: str) -> bytes:
    """The text's name in the store's tables (sha256 of its UTF-8)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def text_ref(text: str) -> bytes:
    """The reference-count key of `text` (38 bytes: never an entry key's size)."""
    return digest_ref(text_digest(text))


def digest_ref(digest: bytes) -> bytes:
    return _REF + digest


def is_text_ref(key: bytes) -> bool:
    return key.startswith(_REF)


def ref_digest(ref: bytes) -> bytes:
    return ref[len(_REF):]


def tombstone(text: str) -> str:
    """The log record that forgets `text` (as stored, namespace-marked): its namespace and the sha256 of
    its words, which is how a recognition index names the texts it holds."""
    namespace, words = split_marked(text)
    return marked(namespace, FORGOTTEN + hashlib.sha256(words.encode("utf-8", "surrogatepass")).hexdigest())


def forgotten(text: str) -> bytes | None:
    """The sha256 a tombstone (already split from its namespace) names; None for a text."""
    if not text.startswith(FORGOTTEN):
        return None
    return bytes.fromhex(text[len(FORGOTTEN):])


def live(log: list[str]) -> list[str]:
    """The texts of a log, tombstones left out."""
    return [t for t in log if forgotten(split_marked(t)[1]) is None]
