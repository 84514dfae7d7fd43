"""Per-request counts of store reads by tier: hits, misses and seconds."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class ReadTally:
    """One request's store reads by tier ("device", "host", "lmdb", "redis"): hits, misses and seconds.
    Stores record into the tally set for the current context (`tally_reads`); none is set outside a
    request."""

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, tier: str, hits: int, misses: int, seconds: float) -> None:
        with self._lock:
            for name, value in (("hits", hits), ("misses", misses), ("s", seconds)):
                key = f"{tier}_{name}"
                self._counts[key] = self._counts.get(key, 0) + value

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


_TALLY: contextvars.ContextVar[ReadTally | None] = contextvars.ContextVar("cacheclip_read_tally", default=None)


@contextmanager
def tally_reads() -> Iterator[ReadTally]:
    """Count the store reads made in this context (threads started with a copy of it included)."""
    tally = ReadTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def record_read(tier: str, found: Sequence[object | None], seconds: float) -> None:
    tally = _TALLY.get()
    if tally is not None:
        hits = sum(e is not None for e in found)
        tally.add(tier, hits, len(found) - hits, seconds)
