"""`RedisStore`'s remembered texts and owners, shared by every replica (the LMDB form: `owners`): a hash
of texts by digest and a log of digests (`texts_since`); per owner a record (keys, group) and a set of the
texts it holds; a hash of reference counts; per owned text a set of the entry keys computed from it.
Forgetting a text deletes those entries and its words and logs a tombstone (`texts`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .texts import digest_ref, is_text_ref, live, ref_digest, text_digest, text_ref, tombstone


class RedisOwners:
    """Mixed into `RedisStore` (which gives `client`, `namespace`, `_call` and `delete`)."""

    def remember_texts(self, texts: Sequence[str]) -> None:
        """Each new text in a hash by its digest, and its digest appended to a log (`texts_since`)."""
        for text in dict.fromkeys(texts):
            self._log(text)

    def _log(self, text: str) -> None:
        digest = text_digest(text).hex()
        if self._call(self.client.hsetnx, f"{self.namespace}:texts", digest, text.encode("utf-8", "surrogatepass")):
            self._call(self.client.rpush, f"{self.namespace}:textlog", digest)

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        digests = self._call(self.client.lrange, f"{self.namespace}:textlog", cursor, -1)
        if not digests:
            return [], cursor
        values = self._call(self.client.hmget, f"{self.namespace}:texts", digests)
        return [v.decode("utf-8", "surrogatepass") for v in values if v is not None], cursor + len(digests)

    def texts(self) -> list[str]:
        return live(self.texts_since(0)[0])

    def _owner(self, owner: str) -> bytes:
        return f"{self.namespace}:own:".encode() + owner.encode("utf-8", "surrogatepass")

    def _owner_texts(self, owner: str) -> bytes:
        return f"{self.namespace}:owntexts:".encode() + owner.encode("utf-8", "surrogatepass")

    def _group(self, group: str) -> bytes:
        return f"{self.namespace}:grp:".encode() + group.encode("utf-8", "surrogatepass")

    def _text_keys(self, digest: bytes) -> str:
        return f"{self.namespace}:textkeys:{digest.hex()}"

    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None,
               text: str | None = None) -> None:
        record = json.dumps({"keys": [k.hex() for k in dict.fromkeys(keys)], "group": group}).encode()
        if self._call(lambda: self.client.set(self._owner(owner), record, nx=True)):  # a new owner
            pipe = self.client.pipeline(transaction=True)
            for key in dict.fromkeys(keys):
                pipe.hincrby(f"{self.namespace}:refs", key.hex(), 1)
            if group is not None:
                pipe.sadd(self._group(group), owner)
            self._call(pipe.execute)
        if text is not None and self._call(self.client.sadd, self._owner_texts(owner), text_digest(text).hex()):
            self._call(self.client.hincrby, f"{self.namespace}:refs", text_ref(text).hex(), 1)

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        """Per owned text, the keys of entries computed from it (see `owners.Owners.record_entries`)."""
        for text, keys in items:
            if keys and self._call(self.client.hexists, f"{self.namespace}:refs", text_ref(text).hex()):
                self._call(self.client.sadd, self._text_keys(text_digest(text)), *[k.hex() for k in keys])

    def owners_of(self, group: str) -> list[str]:
        return sorted(m.decode("utf-8", "surrogatepass") for m in self._call(self.client.smembers, self._group(group)))

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]:
        owners = list(owners) + (self.owners_of(group) if group is not None else [])
        deleted: list[bytes] = []
        for owner in dict.fromkeys(owners):
            raw = self._call(self.client.getdel, self._owner(owner))
            if raw is None:
                continue
            record = json.loads(raw)
            if record.get("group") is not None:
                self._call(self.client.srem, self._group(record["group"]), owner)
            held = self._call(self.client.smembers, self._owner_texts(owner))
            self._call(self.client.delete, self._owner_texts(owner))
            refs = record["keys"] + [digest_ref(bytes.fromhex(d.decode())).hex() for d in held]
            for hexkey in refs:
                if self._call(self.client.hincrby, f"{self.namespace}:refs", hexkey, -1) > 0:
                    continue
                self._call(self.client.hdel, f"{self.namespace}:refs", hexkey)
                key = bytes.fromhex(hexkey)
                if is_text_ref(key):
                    deleted += self.forget_texts([ref_digest(key)]) + [key]
                elif self.delete([key]):
                    deleted.append(key)
        return deleted

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        """Each text's recorded entries deleted (returned), its words removed, a tombstone logged."""
        deleted: list[bytes] = []
        for digest in digests:
            keys = [bytes.fromhex(k.decode()) for k in self._call(self.client.smembers, self._text_keys(digest))]
            self._call(self.client.delete, self._text_keys(digest))
            deleted += [k for k in keys if self.delete([k])]
            words = self._call(self.client.hget, f"{self.namespace}:texts", digest.hex())
            if words is not None:
                self._call(self.client.hdel, f"{self.namespace}:texts", digest.hex())
                mark = tombstone(words.decode("utf-8", "surrogatepass"))  # logged each time (a text may come and go)
                self._call(self.client.hset, f"{self.namespace}:texts", text_digest(mark).hex(), mark.encode())
                self._call(self.client.rpush, f"{self.namespace}:textlog", text_digest(mark).hex())
        return deleted
