"""Finding stored chunks inside ordinary prompts: a client (a RAG framework) pastes retrieved chunks into
its own template; the engine needs to know where each stored chunk lies to reuse its cache.

`ChunkIndex` holds, per stored chunk text, an anchor (its first `ANCHOR` characters, or all of a shorter
text) and the chunk's sha256 and length. A prompt is scanned once: every position whose next
characters are an anchor is a candidate, confirmed by hashing the prompt's text of the chunk's length.
Memory is a few dozen bytes a chunk (no texts are held), and the scan is one dict lookup a position.
Matches are taken leftmost first, the longest at a position, never overlapping.

`layout(prompt, matches, question)` cuts the prompt into the engine's layout: the text before the
first chunk (the shared prefix), each chunk and the text after it, and the rest (`Layout`).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ANCHOR = 48  # characters: long enough to be rare in other text, short enough for small chunks
MIN_CHUNK = 16  # shorter texts are not recognised: they would match in too many prompts


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


class ChunkIndex:
    """The stored chunks' anchors, for `find`. Thread-safe; `add` is idempotent."""

    def __init__(self, texts: Iterable[str] = ()):
        self._anchors: dict[str, set[tuple[int, bytes]]] = {}  # anchor -> {(length, digest)}
        self._short_lengths: set[int] = set()  # anchors shorter than ANCHOR (whole short chunks)
        self._count = 0
        self._lock = threading.Lock()
        self.add(texts)

    def __len__(self) -> int:
        return self._count

    def add(self, texts: Iterable[str]) -> int:
        """Index `texts`; returns how many were new."""
        added = 0
        with self._lock:
            for text in texts:
                if len(text) < MIN_CHUNK:
                    continue
                anchor = text[:ANCHOR]
                entry = (len(text), _digest(text))
                bucket = self._anchors.setdefault(anchor, set())
                if entry in bucket:
                    continue
                bucket.add(entry)
                added += 1
                if len(anchor) < ANCHOR:
                    self._short_lengths.add(len(anchor))
            self._count += added
        return added

    def find(self, prompt: str) -> list[Match]:
        """Every stored chunk found in `prompt`, leftmost first, the longest at a position, not overlapping."""
        with self._lock:
            anchors, short = self._anchors, sorted(self._short_lengths, reverse=True)
        matches, at, end = [], 0, len(prompt)
        while at <= end - MIN_CHUNK:
            best = 0
            for width in (ANCHOR, *short):
                bucket = anchors.get(prompt[at : at + width])
                if bucket:
                    for length, digest in bucket:
                        if length > best and at + length <= end and _digest(prompt[at : at + length]) == digest:
                            best = length
            if best:
                matches.append(Match(at, at + best))
                at += best
            else:
                at += 1
        return matches


def layout(prompt: str, matches: Sequence[Match], question: str) -> Layout:
    """`prompt` cut at `matches` (sorted, not overlapping) into the engine's layout."""
    if not matches:
        raise ValueError("no stored chunk in the prompt")
    chunks = tuple(prompt[m.start : m.stop] for m in matches)
    between = tuple(prompt[a.stop : b.start] for a, b in zip(matches, matches[1:])) + ("",)
    return Layout(head=prompt[: matches[0].start], chunks=chunks, between=between, tail=prompt[matches[-1].stop :],
                  question=question)


class StoreIndex(ChunkIndex):
    """A `ChunkIndex` kept in step with a store's ingested texts: read incrementally (`texts_since`), at
    most every `refresh_s`, so texts another process ingested (a replica, `cacheclip ingest`) are found."""

    def __init__(self, store, refresh_s: float = 2.0):
        texts, self._cursor = store.texts_since(0)
        super().__init__(texts)
        self._store, self.refresh_s = store, refresh_s
        self._checked = time.monotonic()
        self._refreshing = threading.Lock()

    def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._checked < self.refresh_s:
            return
        if not self._refreshing.acquire(blocking=force):
            return
        try:
            texts, self._cursor = self._store.texts_since(self._cursor)
            self.add(texts)
            self._checked = time.monotonic()
        finally:
            self._refreshing.release()

    def find(self, prompt: str) -> list[Match]:
        self.refresh()
        return super().find(prompt)
