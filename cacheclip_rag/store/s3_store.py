"""A cold tier on S3-compatible object storage (AWS S3, MinIO, R2, Ceph RGW, ...): a corpus bounded by the
bucket, not by one machine's disk.

An entry is one object, `{prefix}/e/{key hex}`, holding the LMDB store's entry bytes exactly
(`store.encode_entry`: format version, fingerprint, xxh3 checksum), so a damaged or foreign object is
refused (`parse_entry`), moved to `q/`, and recomputed, never served. An S3 PUT is atomic (a reader sees
the whole object or the old one) and two writers of one key leave one object: entries are written with
`If-None-Match: *` (the first writer wins, the second's identical entry is not sent again).

The remembered texts (what servers recognise in prompts) are shared through the bucket as well: each text
at `t/{sha256}`, and a log of digests, `l/{n:016d}`, each record created with `If-None-Match: *`, so two
replicas appending at once take different numbers and `texts_since(n)` reads the records after `n`.
Owners are not kept here: the local tier in front records them (`TieredStore`), as with Redis.

Client: obstore (Rust's `object_store`, the crate Apache Arrow and DataFusion read S3 with): requests run
outside the GIL, so the reads of one request go out at once from a few threads; timeouts and retries are
bounded by configuration; a small wheel with no Python dependencies. boto3 spends milliseconds of Python
per request and holds the GIL while parsing; s3fs/fsspec adds an event loop and caches we do not want.

Configuration comes from the usual AWS variables (`AWS_ENDPOINT_URL` for a non-AWS server,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`) or from keyword arguments.
Needs `pip install 'cacheclip-rag[s3]'`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..config import is_s3_url
from .entry import ChunkEntry, encode_entry
from .errors import StoreError, StoreUnavailableError
from .protocol import ReceivedEntries
from .texts import live, text_digest, tombstone

log = logging.getLogger(__name__)

_LOG_DIGITS = 16
_THREADS = 16  # concurrent requests of one batch (obstore releases the GIL while they run)


def _obstore():
    try:
        import obstore
        from obstore.store import S3Store as Client
    except ImportError as err:
        raise ModuleNotFoundError("S3Store needs obstore: pip install 'cacheclip-rag[s3]'") from err
    return obstore, Client


class S3Store(ReceivedEntries):
    """`KVStore` entries and texts on an S3-compatible bucket. Thread-safe (obstore's client)."""

    TIER = "s3"

    def __init__(self, url: str, *, endpoint: str | None = None, timeout_s: float = 5.0, connect_timeout_s: float = 1.0,
                 retries: int = 2, **config: str):
        obstore, client = _obstore()
        if not isinstance(url, str) or not is_s3_url(url) or len(url.split("/")) < 3 or not url.split("/")[2]:
            raise ValueError(f"an S3 location is s3://bucket[/prefix], got {url!r}")
        if not timeout_s > 0 or not connect_timeout_s > 0 or not 0 <= retries <= 10:
            raise ValueError("timeout_s and connect_timeout_s must be > 0 and retries in 0..10")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        if endpoint:
            config["endpoint"] = endpoint
        options = {"timeout": datetime.timedelta(seconds=timeout_s),
                   "connect_timeout": datetime.timedelta(seconds=connect_timeout_s),
                   "allow_http": bool(endpoint and endpoint.startswith("http://"))}
        retry = {"max_retries": retries, "retry_timeout": datetime.timedelta(seconds=timeout_s),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2.0}}
        try:
            self.client = client.from_url(url, client_options=options, retry_config=retry, **config)
        except Exception as err:  # obstore's configuration errors
            raise ValueError(f"bad S3 location {url!r}: {err}") from err
        self._obs = obstore
        self.url = self.path = url
        self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="cacheclip-s3")
        self._log_next = 0

    # ---- requests ------------------------------------------------------------------------------

    def _call(self, fn, *args, **kwargs):
        """`fn` on the client; a missing object is None; the server unreachable or failing is
        `StoreUnavailableError`, any other refusal `StoreError`."""
        try:
            return fn(self.client, *args, **kwargs)
        except FileNotFoundError:
            return None
        except self._obs.exceptions.AlreadyExistsError:
            raise
        except (self._obs.exceptions.PermissionDeniedError, self._obs.exceptions.UnauthenticatedError) as err:
            raise StoreError(f"S3 at {self.url} refused: {err}") from err
        except Exception as err:  # connection refused, timeouts, 5xx after the retries
            raise StoreUnavailableError(f"S3 at {self.url} is unreachable or failing: {_first_line(err)}") from err

    def _read(self, path: str) -> bytes | None:
        found = self._call(self._obs.get, path)
        return None if found is None else bytes(found.bytes())

    def _create(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` unless an object is there; False when one was."""
        try:
            self._call(self._obs.put, path, data, mode="create")
            return True
        except self._obs.exceptions.AlreadyExistsError:
            return False
        except self._obs.exceptions.PreconditionError:
            return False

    def _list(self, prefix: str, after: str | None = None) -> list[str]:
        def listed(client):
            return [m["path"] for batch in self._obs.list(client, prefix, offset=after) for m in batch]

        return sorted(self._call(listed) or [])

    @staticmethod
    def _entry(key: bytes) -> str:
        return f"e/{key.hex()}"

    # ---- the KVStore protocol ------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self._call(self._obs.head, self._entry(key)) is not None

    def _raw_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each entry's object, fetched concurrently; None for a miss."""
        return list(self._pool.map(self._read, [self._entry(k) for k in keys]))

    def put_many(self, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
        """Each entry one object, written concurrently; an object already there is kept (the first writer
        of a chunk wins; a damaged one is quarantined by its first reader and written again then)."""
        encoded = [(self._entry(key), encode_entry(fingerprint, entry, key)) for key, fingerprint, entry in items]
        for _ in self._pool.map(lambda pair: self._create(*pair), encoded):
            pass

    def keys(self) -> Iterator[bytes]:
        found = []
        for path in self._list("e"):
            try:
                found.append(bytes.fromhex(path.rsplit("/", 1)[-1]))
            except ValueError:
                continue  # not ours
        return iter(found)

    def delete(self, keys: Sequence[bytes]) -> int:
        present = [k for k in keys if self.contains(k)]
        if present:
            self._call(self._obs.delete, [self._entry(k) for k in present])
        return len(present)

    def quarantine(self, key: bytes, why: str) -> None:
        """The object moves to `q/` (kept for inspection, never read); its key reads as a miss."""
        log.error("S3 %s: entry %s is unusable (%s); quarantined, it will be recomputed", self.url, key.hex(), why)
        try:
            self._call(self._obs.rename, self._entry(key), f"q/{key.hex()}")
        except StoreError:
            pass  # gone meanwhile, or the server is down: the next reader finds it damaged again

    # ---- remembered texts: shared by every replica -----------------------------------------------

    def remember_texts(self, texts: Sequence[str]) -> None:
        for text in dict.fromkeys(texts):
            digest = text_digest(text).hex()
            if self._create(f"t/{digest}", text.encode("utf-8", "surrogatepass")):
                self._append(digest)

    def _append(self, digest: str) -> None:
        """A log record for `digest` at the first free number (create-only: a concurrent appender that
        took the number makes this one try the next)."""
        n = max(self._log_next, self._log_end())
        while not self._create(f"l/{n:0{_LOG_DIGITS}d}", digest.encode()):
            n += 1
        self._log_next = n + 1

    def _log_end(self) -> int:
        after = f"l/{self._log_next - 1:0{_LOG_DIGITS}d}" if self._log_next else None
        records = self._list("l", after)
        return int(records[-1].rsplit("/", 1)[-1]) + 1 if records else self._log_next

    def texts_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """The texts logged at `cursor` and after (tombstones included), and the cursor to ask from next."""
        after = f"l/{cursor - 1:0{_LOG_DIGITS}d}" if cursor > 0 else None
        records = []
        for path in self._list("l", after):
            n = int(path.rsplit("/", 1)[-1])
            if n != cursor + len(records):
                break  # a number being written: read from it next time
            records.append(path)
        digests = [d.decode() for d in self._pool.map(self._read, records) if d is not None]
        words = self._pool.map(self._read, [f"t/{d}" for d in digests])
        return [w.decode("utf-8", "surrogatepass") for w in words if w is not None], cursor + len(records)

    def texts(self) -> list[str]:
        return live(self.texts_since(0)[0])

    def forget_texts(self, digests: Sequence[bytes]) -> list[bytes]:
        """Each text's words deleted and a tombstone logged. Its entries are the local tier's to name
        (`TieredStore` forwards their deletes); none are recorded here."""
        for digest in digests:
            words = self._read(f"t/{digest.hex()}")
            if words is None:
                continue
            self._call(self._obs.delete, f"t/{digest.hex()}")
            mark = tombstone(words.decode("utf-8", "surrogatepass"))
            self._call(self._obs.put, f"t/{text_digest(mark).hex()}", mark.encode("utf-8", "surrogatepass"))
            self._append(text_digest(mark).hex())
        return []

    # ---- owners: the local tier's ----------------------------------------------------------------

    def retain(self, owner: str, keys: Sequence[bytes] = (), group: str | None = None, text: str | None = None) -> None:
        raise StoreError("an S3 tier keeps no owners: put a local store in front of it "
                         "(open_store(folder, shared='s3://bucket/prefix'))")

    def record_entries(self, items: Sequence[tuple[str, Sequence[bytes]]]) -> None:
        """Nothing: no text is owned here (`retain` refuses)."""

    def owners_of(self, group: str) -> list[str]:
        return []

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> list[bytes]:
        return []

    def stats(self) -> dict:
        keys = list(self.keys())
        return {"entries": len(keys), "bytes": 0, "path": self.url, "models": {}, "quarantined": len(self._list("q")),
                "file_bytes": 0}

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
