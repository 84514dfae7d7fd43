"""Who uses a stored entry, so deleting a document frees exactly the caches no other document needs.

An owner (a framework's node id) retains the keys of its chunk's entries (the primary's and the aux's),
optionally inside a group (the document it came from). Releasing owners, or a whole group, drops their
references; an entry whose last owner is released is deleted. A chunk shared by two documents keeps
its caches until both are gone. Entries nobody retained (plain `ingest`) are never deleted here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import hashlib

from .tables import ACCESS, COUNT, ENTRIES, GROUPS, OWNERS, REFS, SEQ, TEXT_IDS, TEXTS


class Owners:
    """Mixed into `LMDBStore`: `retain`, `release`, `owners_of`, over the store's own transactions; and
    the ingested chunks' texts (`remember_texts`, `texts`), which a server recognises in prompts."""

    def remember_texts(self, texts: Iterable[str]) -> None:
        """Record each new text, numbered in arrival order (a text seen before keeps its number)."""
        items = [(hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest(), t.encode("utf-8", "surrogatepass"))
                 for t in texts]
        if not items or self.readonly:
            return
        with self._transaction(write=True) as txn:
            cursor = txn.cursor(db=self._dbs[TEXTS])
            following = SEQ.unpack(bytes(cursor.key()))[0] + 1 if cursor.last() else 0
            for digest, text in items:
                if txn.get(digest, db=self._dbs[TEXT_IDS]) is not None:
                    continue
                txn.put(SEQ.pack(following), text, db=self._dbs[TEXTS])
                txn.put(digest, SEQ.pack(following), db=self._dbs[TEXT_IDS])
                following += 1

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """The texts recorded from number `cursor` on, and the cursor to ask from next time."""
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
        return self.texts_since(0)[0]

    def retain(self, owner: str, keys: Sequence[bytes], group: str | None = None) -> None:
        """Record that `owner` uses `keys` (again: a no-op); `group` names what it belongs to."""
        name = owner.encode("utf-8", "surrogatepass")
        with self._transaction(write=True) as txn:
            if txn.get(name, db=self._dbs[OWNERS]) is not None:
                return
            txn.put(name, json.dumps({"keys": [k.hex() for k in keys], "group": group}).encode(), db=self._dbs[OWNERS])
            for key in dict.fromkeys(keys):
                old = txn.get(key, db=self._dbs[REFS])
                txn.put(key, COUNT.pack((COUNT.unpack(old)[0] if old is not None else 0) + 1), db=self._dbs[REFS])
            if group is not None:
                gname = group.encode("utf-8", "surrogatepass")
                members = json.loads(bytes(txn.get(gname, db=self._dbs[GROUPS]) or b"[]"))
                txn.put(gname, json.dumps([*members, owner]).encode(), db=self._dbs[GROUPS])

    def owners_of(self, group: str) -> list[str]:
        with self._transaction() as txn:
            raw = txn.get(group.encode("utf-8", "surrogatepass"), db=self._dbs[GROUPS])
            return json.loads(bytes(raw)) if raw is not None else []

    def release(self, owners: Iterable[str] = (), group: str | None = None) -> list[bytes]:
        """Drop the references of `owners` (and of every owner in `group`); delete each entry left with
        none. Returns the keys of the deleted entries. Unknown owners are ignored."""
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
                    old = txn.get(key, db=self._dbs[REFS])
                    left = (COUNT.unpack(old)[0] if old is not None else 1) - 1
                    if left > 0:
                        txn.put(key, COUNT.pack(left), db=self._dbs[REFS])
                        continue
                    txn.delete(key, db=self._dbs[REFS])
                    if txn.delete(key, db=self._dbs[ENTRIES]):
                        deleted.append(key)
                    txn.delete(key, db=self._dbs[ACCESS])
                    self._verified.pop(key, None)
        return deleted
