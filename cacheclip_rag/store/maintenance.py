"""An LMDB store's upkeep: full verification, LRU eviction, compaction, statistics."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from .entry import split_entry, verify_entry
from .errors import StoreError
from .tables import ACCESS, ENTRIES, QUARANTINE, STAMP


class Maintenance:
    """Mixed into `LMDBStore`: the operations an operator runs (`cacheclip verify | evict | compact |
    inspect`), over the store's own transactions and tables."""

    path: Path
    readonly: bool

    def quarantined(self) -> list[bytes]:
        if self._dbs[QUARANTINE] is None:
            return []
        with self._transaction() as txn:
            return [bytes(k) for k in txn.cursor(db=self._dbs[QUARANTINE]).iternext(keys=True, values=False)]

    def verify(self) -> dict[str, int]:
        """Every entry through every check a first read makes (checksum, layout, its key, each value),
        for any model; the bad ones are quarantined."""
        bad: list[tuple[bytes, bytes, str]] = []
        good = 0
        with self._transaction() as txn:
            for k, raw in txn.cursor(db=self._dbs[ENTRIES]):
                try:
                    verify_entry(raw, bytes(k))
                    good += 1
                except StoreError as err:
                    bad.append((bytes(k), bytes(raw), str(err)))
        if bad:
            self._quarantine(bad)
        return {"ok": good, "quarantined": len(bad)}

    def evict(self, max_bytes: int) -> int:
        """Drop least-recently-used entries until the entries total at most `max_bytes`; returns the count."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        with self._transaction() as txn:
            stamps = [(*STAMP.unpack(v), bytes(k)) for k, v in txn.cursor(db=self._dbs[ACCESS])]
        total = sum(size for _, size, _ in stamps)
        victims = []
        for _, size, key in sorted(stamps):  # oldest access first
            if total <= max_bytes:
                break
            victims.append(key)
            total -= size
        return self.delete(victims)

    def compact(self) -> tuple[int, int]:
        """Rewrite the file without free pages; returns (bytes before, bytes after).

        Refuses (`StoreError`) while another process has the store open: it would go on writing into
        the replaced file and lose those writes. Processes that open the store meanwhile wait for it.
        A full disk raises `StoreFullError` and leaves the store as it was."""
        import lmdb

        if self.readonly:
            raise StoreError(f"store {self.path} is open read-only")
        self.env  # reopen first if this object crossed a fork
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"cannot compact {self.path}: another process has the store open. Stop it "
                             "(servers, ingest runs) and retry; compaction needs the store to itself.") from None
        data = self.path / "data.mdb"
        tmp = self.path / "compact.tmp"
        try:
            with self._lock.exclusive():
                before = data.stat().st_size
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                try:
                    self._env.copy(str(tmp), compact=True)
                except lmdb.Error as err:
                    raise self._disk_error(err) from err
                self._env.close()
                os.replace(tmp / "data.mdb", data)  # atomic: the old or the new file, never a mix
            self._open_env()
            return before, data.stat().st_size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            fcntl.flock(self._lockfile, fcntl.LOCK_SH)

    def stats(self) -> dict:
        """Entries, bytes used, quarantined entries, file size, and per model fingerprint: its entries,
        bytes, tokens, bytes per token, storage dtypes and model names (as the writers recorded them)."""
        models: dict[str, dict] = {}
        total = 0
        with self._transaction() as txn:
            for _, raw in txn.cursor(db=self._dbs[ENTRIES]):
                try:
                    header = split_entry(raw)[0]
                    model, tokens = str(header.get("fingerprint", "?")), int(header["shape"][2])
                except (StoreError, KeyError, TypeError, ValueError, IndexError):
                    header, model, tokens = {}, "corrupted", 0
                row = models.setdefault(model, {"entries": 0, "bytes": 0, "tokens": 0, "dtypes": set(), "names": set()})
                row["entries"] += 1
                row["bytes"] += len(raw)
                row["tokens"] += tokens
                row["dtypes"].add(str(header.get("dtype", "?")))
                if header.get("model"):
                    row["names"].add(str(header["model"]))
                total += len(raw)
        for row in models.values():
            row["bytes_per_token"] = row["bytes"] / row["tokens"] if row["tokens"] else None
            row["dtypes"], row["names"] = sorted(row["dtypes"]), sorted(row["names"])
        return {"entries": sum(r["entries"] for r in models.values()), "bytes": total, "models": models,
                "path": str(self.path), "quarantined": len(self.quarantined()),
                "file_bytes": (self.path / "data.mdb").stat().st_size}
