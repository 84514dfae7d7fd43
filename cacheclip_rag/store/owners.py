"""Who uses a stored entry, so deleting a document frees exactly the caches no other document needs.

An owner (a framework's node id, a server tenant's document id) holds texts (`retain(..., text=...)`):
releasing its last owner forgets a text, which deletes every entry computed from it (recorded by
`record_entries`, at ingest and on a request's miss), its remembered words, and appends a tombstone to the
texts' log so recognition indexes drop it (see `texts`). Owners may also hold entry keys directly (the
older form, still honoured: an entry whose last owner is released is deleted). Owners sit optionally in a
group (the document a node came from). A text shared by two documents keeps its caches until both are
gone. Texts nobody retained (plain `ingest`) are never deleted here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from .tables import ACCESS, COUNT, ENTRIES, GROUPS, OWNERS, REFS, SEQ, TEXT_IDS, TEXT_KEYS, TEXTS
from .texts import digest_ref, live, text_digest, text_ref, tombstone


class Owners:
    """Mixed into `LMDBStore`: `retain`, `release`, `owners_of`, `record_entries`, over the store's own
    transactions; and the ingested chunks' texts (`remember_texts`, `texts`), which a server recognises in
    prompts."""

    def remember_texts(self, texts: Iterable[str]) -> None:
        """Record each new text, numbered in arrival order (a text seen before keeps its number)."""
        items = [(text_digest(t), t.encode("utf-8", "surrogatepass")) for t in texts]
        if not items or self.readonly:
            return
        with self._transaction(write=True) as txn:
            following = self._following(txn)
            for digest, text in items:
                if txn.get(digest, db=self._dbs[TEXT_IDS]) is not None:
                    continue
                txn.put(SEQ.pack(following), text, db=self._dbs[TEXTS])
                txn.put(digest, SEQ.pack(following), db=self._dbs[TEXT_IDS])
                following += 1

    def _following(self, txn) -> int:
        cursor = txn.cursor(db=self._dbs[TEXTS])
        return SEQ.unpack(bytes(cursor.key()))[0] + 1 if cursor.last() else 0

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """The log from number `cursor` on (texts and tombstones), and the cursor to ask from next time."""
        if self._dbs.get(TEXTS) is None:
            return [], cursor
        out, following = [], cursor
        with self._transaction() as txn:
            walk = txn.cursor(db=self._dbs[TEXTS])
            if walk.set_range(SEQ.pack(cursor)):
                for key, value in walk:
                    out.append(bytes(value).decode("utf-8", "surrogatepass"))
                    following = SEQ.unpack(bytes(key))[0] + 1
        return out, following

    def texts(self) -> list[str]:
        return live(self.texts_since(0)[0])

    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None,
               text: str | None = None) -> None:
        """Record that `owner` uses `keys` and `text` (again: a no-op; a new text is added to what it holds);
        `group` names what it belongs to."""
        name = owner.encode("utf-8", "surrogatepass")
        with self._transaction(write=True) as txn:
            raw = txn.get(name, db=self._dbs[OWNERS])
            record = json.loads(bytes(raw)) if raw is not None else None
            if record is None:
                record = {"keys": [k.hex() for k in dict.fromkeys(keys)], "group": group, "texts": []}
                for key in dict.fromkeys(keys):
                    self._count(txn, key, +1)
                if group is not None:
                    gname = group.encode("utf-8", "surrogatepass")
                    members = json.loads(bytes(txn.get(gname, db=self._dbs[GROUPS]) or b"[]"))
                    txn.put(gname, json.dumps([*members, owner]).encode(), db=self._dbs[GROUPS])
            digest = text_digest(text).hex() if text is not None else None
            if digest is not None and digest not in record.setdefault("texts", []):
                record["texts"].append(digest)
                self._count(txn, text_ref(text), +1)
            elif raw is not None:
                return
            txn.put(name, json.dumps(record).encode(), db=self._dbs[OWNERS])

    def _count(self, txn, key: bytes, step: int) -> int:
        old = txn.get(key, db=self._dbs[REFS])
        left = (COUNT.unpack(old)[0] if old is not None else (1 if step < 0 else 0)) + step
        if left > 0:
            txn.put(key, COUNT.pack(left), db=self._dbs[REFS])
        else:
            txn.delete(key, db=self._dbs[REFS])
        return left

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        """Per text, the keys of entries computed from it, noted for the texts some owner holds (so
        forgetting the text deletes them); texts nobody owns are left alone (nothing to delete them for)."""
        if not items or self.readonly:
            return
        with self._transaction() as txn:  # most texts are nobody's: no write (and no sync) for them
            items = [(t, keys) for t, keys in items if txn.get(text_ref(t), db=self._dbs[REFS]) is not None]
        if not items:
            return
        with self._transaction(write=True) as txn:
            for text, keys in items:
                if txn.get(text_ref(text), db=self._dbs[REFS]) is None:
                    continue
                digest = text_digest(text)
                known = json.loads(bytes(txn.get(digest, db=self._dbs[TEXT_KEYS]) or b"[]"))
                new = [k.hex() for k in dict.fromkeys(keys) if k.hex() not in known]
                if new:
                    txn.put(digest, json.dumps(known + new).encode(), db=self._dbs[TEXT_KEYS])

    def owners_of(self, group: str) -> list[str]:
        with self._transaction() as txn:
            raw = txn.get(group.encode("utf-8", "surrogatepass"), db=self._dbs[GROUPS])
            return json.loads(bytes(raw)) if raw is not None else []

    def release(self, owners: Iterable[str] = (), group: str | None = None) -> list[bytes]:
        """Drop the references of `owners` (and of every owner in `group`); delete each entry left with
        none, and forget each text left with none (its entries, its words, a tombstone in the log). Returns
        the keys of the deleted entries, then the `text_ref` of each forgotten text. Unknown owners are
        ignored."""
        owners = list(owners) + (self.owners_of(group) if group is not None else [])
        deleted: list[bytes] = []
        with self._transaction(write=True) as txn:
            for owner in dict.fromkeys(owners):
                name = owner.encode("utf-8", "surrogatepass")
                raw = txn.get(name, db=self._dbs[OWNERS])
                if raw is None:
                    continue
                record = json.loads(bytes(raw))
                txn.delete(name, db=self._dbs[OWNERS])
                if record.get("group") is not None:
                    gname = record["group"].encode("utf-8", "surrogatepass")
                    members = [m for m in json.loads(bytes(txn.get(gname, db=self._dbs[GROUPS]) or b"[]")) if m != owner]
                    if members:
                        txn.put(gname, json.dumps(members).encode(), db=self._dbs[GROUPS])
                    else:
                        txn.delete(gname, db=self._dbs[GROUPS])
                for key in map(bytes.fromhex, dict.fromkeys(record["keys"])):
                    if self._count(txn, key, -1) <= 0 and self._delete_entry(txn, key):
                        deleted.append(key)
                for digest in map(bytes.fromhex, record.get("texts", [])):
                    ref = digest_ref(digest)
                    if self._count(txn, ref, -1) <= 0:
                        deleted += self._forget_text(txn, digest) + [ref]
        return deleted

    def _delete_entry(self, txn, key: bytes) -> bool:
        gone = bool(txn.delete(key, db=self._dbs[ENTRIES]))
        txn.delete(key, db=self._dbs[ACCESS])
        self._verified.pop(key, None)
        return gone

    def _forget_text(self, txn, digest: bytes) -> list[bytes]:
        """The text's entries deleted (returned), its words removed, a tombstone at the log's end."""
        keys = [bytes.fromhex(k) for k in json.loads(bytes(txn.get(digest, db=self._dbs[TEXT_KEYS]) or b"[]"))]
        txn.delete(digest, db=self._dbs[TEXT_KEYS])
        deleted = [k for k in keys if self._delete_entry(txn, k)]
        seq = txn.get(digest, db=self._dbs[TEXT_IDS])
        if seq is not None:  # numbered before the text goes: a number is never given twice (readers' cursors)
            following = self._following(txn)
            words = bytes(txn.get(seq, db=self._dbs[TEXTS]) or b"").decode("utf-8", "surrogatepass")
            txn.delete(seq, db=self._dbs[TEXTS])
            txn.delete(digest, db=self._dbs[TEXT_IDS])
            txn.put(SEQ.pack(following), tombstone(words).encode("utf-8", "surrogatepass"), db=self._dbs[TEXTS])
        return deleted

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        """Forget texts by digest whoever holds them (a tier behind told so by the one in front); returns
        the keys of the entries recorded for them that were deleted."""
        if self.readonly or not digests:
            return []
        with self._transaction(write=True) as txn:
            return [k for d in digests for k in self._forget_text(txn, d)]
