"""Finding stored chunks inside ordinary prompts: a client (a RAG framework) pastes retrieved chunks into
its own template; the engine needs to know where each stored chunk lies to reuse its cache.

`ChunkIndex` holds, per stored chunk text, an anchor (its first `ANCHOR` characters; the first
`SHORT_ANCHOR` of a chunk shorter than `ANCHOR`), the chunk's length, a polynomial hash of the whole
chunk and a 16-byte sha256 digest; no texts are held. A prompt is scanned in time linear in its length,
whatever the stored chunks share (a crafted prompt cannot make it quadratic):
1. the prompt's prefix sums of a polynomial hash (mod the Mersenne prime 2^31 - 1, with a base drawn at
   random per process, so no one can aim collisions at it) give every window's hash in O(1), all
   positions at once with numpy;
2. the positions whose anchor-width window hashes to a stored anchor are the candidates;
3. each candidate is checked, vectorised, against the whole-chunk hashes of the lengths stored under its
   anchor: at most `MAX_LENGTHS` lengths an anchor (more chunks sharing one anchor in more lengths than
   that are still stored, and reused when asked by `documents`, but a prompt may not find the longest
   ones: a miss only costs the time to compute them, never a wrong answer);
4. matches are taken leftmost first, the longest at a position, never overlapping, each confirmed by its
   sha256 before it is taken (so at most the prompt's length is hashed).
`last_work` counts the element operations of the last scan (window hashes and checks), for tests.

`layout(prompt, matches, question)` cuts the prompt into the engine's layout: the text before the
first chunk (the shared prefix), each chunk and the text after it, and the rest (`Layout`).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..store.namespaced import SHARED, split_marked
from ..store.texts import forgotten

ANCHOR = 48  # characters: long enough to be rare in other text, short enough for small chunks
SHORT_ANCHOR = 16  # the anchor of a chunk shorter than ANCHOR
MIN_CHUNK = 16  # shorter texts are not recognised: they would match in too many prompts
MAX_LENGTHS = 16  # chunk lengths checked per anchor: bounds the work a crafted set of chunks can cause
_P = (1 << 31) - 1  # Mersenne prime: a product of two residues fits in int64


@dataclass(frozen=True)
class Layout:
    """A prompt as found: `head` (before the first chunk), `chunks[i]` and the text after it
    `between[i]` (up to the next chunk, or to `tail`), then `tail`; `question` is the user's question
    alone (for the aux's selection pass)."""

    head: str
    chunks: tuple[str, ...]
    between: tuple[str, ...]
    tail: str
    question: str

    @property
    def text(self) -> str:
        return self.head + "".join(c + b for c, b in zip(self.chunks, self.between)) + self.tail


@dataclass(frozen=True)
class Match:
    start: int
    stop: int


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:16]


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)


def _powers(base: int, n: int) -> np.ndarray:
    """base**k mod P for k < n, vectorised in blocks of 1024."""
    block = 1024
    small = np.empty(block, np.int64)
    small[0] = 1
    for i in range(1, block):
        small[i] = small[i - 1] * base % _P
    step, rows = int(small[-1]) * base % _P, max(1, -(-n // block))
    big = np.empty(rows, np.int64)
    big[0] = 1
    for i in range(1, rows):
        big[i] = int(big[i - 1]) * step % _P
    return (big[:, None] * small[None, :] % _P).ravel()[:n]


class _Hasher:
    """Polynomial hashes of windows, position-independent: h(text) = sum text[j] * B**j mod P."""

    def __init__(self) -> None:
        self.base = 2 + secrets.randbelow(_P - 4)
        self._pow = _powers(self.base, 1 << 12)
        self._inv = _powers(pow(self.base, _P - 2, _P), 1 << 12)
        self._grow = threading.Lock()

    def tables(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._pow) < n:
            with self._grow:
                if len(self._pow) < n:
                    size = max(n, 2 * len(self._pow))
                    self._pow, self._inv = _powers(self.base, size), _powers(pow(self.base, _P - 2, _P), size)
        return self._pow, self._inv

    def of(self, text: str) -> int:
        points = _code_points(text)
        power, _ = self.tables(len(points))
        return int((points * power[: len(points)] % _P).sum() % _P)

    def prefix_sums(self, points: np.ndarray) -> np.ndarray:
        """S[i] = sum_{k<i} points[k] * B**k mod P, as int64 [n + 1]."""
        power, _ = self.tables(len(points) + 1)
        sums = np.zeros(len(points) + 1, np.int64)
        np.cumsum(points * power[: len(points)] % _P, out=sums[1:])
        return sums % _P

    def windows(self, sums: np.ndarray, starts: np.ndarray, width: int | np.ndarray) -> np.ndarray:
        """The hash of text[a : a + width] for every a in `starts` (each window inside the text)."""
        _, inverse = self.tables(len(sums))
        return (sums[starts + width] - sums[starts]) % _P * inverse[starts] % _P


_HASHER: _Hasher | None = None  # one per process (its tables grow with the longest prompt seen)


def _hasher() -> _Hasher:
    global _HASHER
    if _HASHER is None:
        _HASHER = _Hasher()
    return _HASHER


def select_matches(prompt: str, candidates: list[tuple[int, int, bytes]]) -> list[Match]:
    """Leftmost first, the longest at a position, never overlapping; each confirmed by its sha256 before
    it is taken (so at most the prompt's length is hashed)."""
    matches, at = [], 0
    for start, length, digest in sorted(candidates, key=lambda c: (c[0], -c[1])):
        if start >= at and _digest(prompt[start : start + length]) == digest:
            matches.append(Match(start, start + length))
            at = start + length
    return matches


class _Bucket:
    """The chunks that share one anchor: by length, their whole-chunk hashes and digests; and the
    `MAX_LENGTHS` longest lengths, the ones a scan checks (kept as chunks arrive: O(MAX_LENGTHS) each)."""

    __slots__ = ("by_length", "checked")

    def __init__(self) -> None:
        self.by_length: dict[int, dict[int, bytes]] = {}
        self.checked: list[int] = []

    def add(self, length: int, whole: int, digest: bytes) -> bool:
        known = self.by_length.setdefault(length, {})
        if whole in known:
            return False
        known[whole] = digest
        if length not in self.checked:
            self.checked = sorted([*self.checked, length], reverse=True)[:MAX_LENGTHS]
        return True

    def drop(self, length: int, whole: int) -> bool:
        known = self.by_length.get(length, {})
        if known.pop(whole, None) is None:
            return False
        if not known:
            del self.by_length[length]
            self.checked = sorted(self.by_length, reverse=True)[:MAX_LENGTHS]
        return True


class ChunkIndex:
    """The stored chunks' anchors and hashes, for `find`. Thread-safe; `add` is idempotent."""

    def __init__(self, texts: Iterable[str] = ()):
        self._hasher = _hasher()
        self._buckets: dict[int, dict[int, _Bucket]] = {ANCHOR: {}, SHORT_ANCHOR: {}}  # width -> anchor -> bucket
        self._keys: dict[int, np.ndarray] = {}  # width -> the anchor hashes, sorted, for a vectorised lookup
        self._where: dict[bytes, tuple[int, int, int, int]] = {}  # digest -> width, anchor, length, whole
        self._count = 0
        self._lock = threading.Lock()
        self.last_work = 0
        self.add(texts)

    def __len__(self) -> int:
        return self._count

    def add(self, texts: Iterable[str]) -> int:
        """Index `texts`; returns how many were new."""
        added = 0
        for text in texts:
            if len(text) < MIN_CHUNK:
                continue
            width = ANCHOR if len(text) >= ANCHOR else SHORT_ANCHOR
            anchor, whole, digest = self._hasher.of(text[:width]), self._hasher.of(text), _digest(text)
            with self._lock:
                buckets = self._buckets[width]
                if anchor not in buckets:
                    buckets[anchor] = _Bucket()
                    self._keys.pop(width, None)  # rebuilt at the next scan
                if buckets[anchor].add(len(text), whole, digest):
                    added += 1
                    self._count += 1
                    self._where[digest] = (width, anchor, len(text), whole)
        return added

    def forget(self, digest: bytes) -> bool:
        """Stop finding the text whose sha256 is `digest` (a deleted document); False if not indexed."""
        with self._lock:
            where = self._where.pop(digest[:16], None)
            if where is None:
                return False
            width, anchor, length, whole = where
            bucket = self._buckets[width][anchor]
            if bucket.drop(length, whole):
                self._count -= 1
            if not bucket.by_length:
                del self._buckets[width][anchor]
                self._keys.pop(width, None)
            return True

    def _anchor_keys(self, width: int) -> np.ndarray:
        with self._lock:
            keys = self._keys.get(width)
            if keys is None:
                keys = self._keys[width] = np.sort(np.fromiter(self._buckets[width], np.int64, len(self._buckets[width])))
            return keys

    def _checks(self, width: int, anchor: int) -> list[tuple[int, dict[int, bytes]]]:
        with self._lock:
            bucket = self._buckets[width][anchor]
            return [(length, dict(bucket.by_length[length])) for length in bucket.checked]

    def candidates(self, prompt: str) -> list[tuple[int, int, bytes]]:
        """(start, length, digest) of every window whose anchor and whole-chunk hashes match."""
        if len(prompt) < MIN_CHUNK or not self._count:
            return []
        points = _code_points(prompt)
        sums, n, work, found = self._hasher.prefix_sums(points), len(points), len(points), []
        for width in (ANCHOR, SHORT_ANCHOR):
            keys = self._anchor_keys(width)
            if n < width or not len(keys):
                continue
            starts = np.arange(n - width + 1)
            hashes = self._hasher.windows(sums, starts, width)
            work += len(starts)
            hit = keys[np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)] == hashes  # keys: sorted
            starts, hashes = starts[hit], hashes[hit]
            for anchor in np.unique(hashes).tolist():
                at = starts[hashes == anchor]
                work += len(at)
                for length, wholes in self._checks(width, anchor):
                    fits = at[at + length <= n]
                    work += len(fits)
                    if not len(fits):
                        continue
                    values = self._hasher.windows(sums, fits, length)
                    same = np.isin(values, np.fromiter(wholes, np.int64, len(wholes)))
                    found += [(start, length, wholes[value]) for start, value in zip(fits[same].tolist(),
                                                                                    values[same].tolist())]
        self.last_work = work
        return found

    def find(self, prompt: str) -> list[Match]:
        """Every stored chunk found in `prompt`, leftmost first, the longest at a position, not overlapping."""
        if len(prompt) < MIN_CHUNK or not self._count:
            self.last_work = 0
            return []
        return select_matches(prompt, self.candidates(prompt))


def layout(prompt: str, matches: Sequence[Match], question: str) -> Layout:
    """`prompt` cut at `matches` (sorted, not overlapping) into the engine's layout."""
    if not matches:
        raise ValueError("no stored chunk in the prompt")
    chunks = tuple(prompt[m.start : m.stop] for m in matches)
    between = tuple(prompt[a.stop : b.start] for a, b in zip(matches, matches[1:])) + ("",)
    return Layout(head=prompt[: matches[0].start], chunks=chunks, between=between, tail=prompt[matches[-1].stop :],
                  question=question)


class StoreIndex:
    """The one recogniser of stored chunks in prompts, for the engine and the server: the store's remembered
    texts, one `ChunkIndex` per namespace (a tenant's, or the shared corpus), read incrementally
    (`texts_since`) at most every `refresh_s`, so texts another process ingested (a replica, `cacheclip
    ingest`) are found."""

    def __init__(self, store, refresh_s: float = 2.0):
        self._store, self.refresh_s = store, refresh_s
        self._indexes: dict[str, ChunkIndex] = {}
        self._cursor, self._checked = 0, 0.0
        self._lock, self._refreshing = threading.Lock(), threading.Lock()
        self.refresh(force=True)

    def __len__(self) -> int:
        return sum(len(i) for i in list(self._indexes.values()))

    def of(self, namespace: str) -> ChunkIndex:
        with self._lock:
            if namespace not in self._indexes:
                self._indexes[namespace] = ChunkIndex()
            return self._indexes[namespace]

    def add(self, namespace: str, texts: list[str]) -> int:
        return self.of(namespace).add(texts)

    def refresh(self, force: bool = False) -> None:
        """Read what the store remembered since the last read (another refresh under way: skipped, unless
        `force`, which waits for it)."""
        if not force and time.monotonic() - self._checked < self.refresh_s:
            return
        if not self._refreshing.acquire(blocking=force):
            return
        try:
            texts, self._cursor = self._store.texts_since(self._cursor)
            grouped: dict[str, list[str]] = {}
            for namespace, text in map(split_marked, texts):
                gone = forgotten(text)
                if gone is None:
                    grouped.setdefault(namespace, []).append(text)
                    continue
                self.add(namespace, grouped.pop(namespace, []))  # in the log's order: added, then forgotten
                self.of(namespace).forget(gone)
            for namespace, group in grouped.items():
                self.add(namespace, group)
            self._checked = time.monotonic()
        finally:
            self._refreshing.release()

    def find(self, prompt: str, namespaces: Sequence[str] = (SHARED,)) -> list[Match]:
        """The chunks of `namespaces` found in `prompt` (leftmost first, the longest at a position)."""
        self.refresh()
        candidates = []
        for namespace in dict.fromkeys(namespaces):
            index = self._indexes.get(namespace)
            if index is not None and len(index):
                candidates += index.candidates(prompt)
        return select_matches(prompt, candidates)
