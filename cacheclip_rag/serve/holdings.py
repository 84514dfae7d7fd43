"""What a replica holds, summarised for a router, and the chunk-affinity ranking over those summaries.

A replica's fast tiers hold the caches of the chunks it has ingested or served. It names them by the sha256
of their (namespace-marked) text, the name a prompt's recognition gives them (`engine.recognize`), so a router
that only recognises texts can ask "who holds this chunk" without a model or a tokenizer. `HeldChunks` keeps
the most recent `capacity` names (LRU: a replica's fast tiers evict in the same order) and reports them as a
Bloom filter of fixed size (`BITS` bits, 32 KiB), whatever the corpus: a false positive (well under 1% at
20,000 chunks) only sends a request where its chunk must be read from the shared tier or computed.

`rank` orders replicas for one request: by the chunk characters each holds (position- and order-independent,
unlike a prefix tree: RAG prompts put the same chunks in any order), skipping replicas whose queue is more
than `imbalance` requests longer than the shortest (as Ray Serve's prefix router's `imbalanced_threshold`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

BITS = 1 << 18
HASHES = 4


def positions(digest: bytes) -> list[int]:
    """The filter bits of a sha256 digest (its first HASHES 4-byte words: already uniform)."""
    return [int.from_bytes(digest[4 * i: 4 * i + 4], "little") % BITS for i in range(HASHES)]


def bloom(digests: Iterable[bytes]) -> bytes:
    bits = np.zeros(BITS, dtype=bool)
    for digest in digests:
        bits[positions(digest)] = True
    return np.packbits(bits, bitorder="little").tobytes()


def holds(summary: bytes, digest: bytes) -> bool:
    return all(summary[p >> 3] >> (p & 7) & 1 for p in positions(digest))


class HeldChunks:
    """A replica's recently used chunk names (bounded LRU) and their Bloom summary."""

    def __init__(self, capacity: int = 20_000):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._names: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: set[bytes] = set()  # names held whatever the fast tier evicts (a tenant's owners' replica)
        self._lock = threading.Lock()
        self._summary: bytes | None = None

    def __len__(self) -> int:
        return len(self._names)

    def add(self, digests: Iterable[bytes]) -> None:
        with self._lock:
            for digest in digests:
                self._names[digest] = None
                self._names.move_to_end(digest)
            while len(self._names) > self.capacity:
                self._names.popitem(last=False)
            self._summary = None

    def trim(self, count: int) -> None:
        """Keep the `count` most recent names (as many as the fast tier holds entries now, measured)."""
        with self._lock:
            while len(self._names) > max(0, count):
                self._names.popitem(last=False)
            self._summary = None

    def pin(self, digests: Iterable[bytes]) -> None:
        with self._lock:
            self._pinned.update(digests)
            self._summary = None

    def forget(self, digests: Iterable[bytes]) -> None:
        with self._lock:
            for digest in digests:
                self._names.pop(digest, None)
            self._summary = None

    def summary(self) -> bytes:
        with self._lock:
            if self._summary is None:
                self._summary = bloom([*self._names, *self._pinned])
            return self._summary


def score(chunks: Sequence[tuple[bytes, int]], summary: bytes | None, extra: set[bytes] = frozenset()) -> int:
    """The characters of `chunks` ((digest, characters) pairs) a replica with `summary` (or `extra`) holds."""
    return sum(size for digest, size in chunks
               if digest in extra or (summary is not None and len(summary) == BITS // 8 and holds(summary, digest)))


def within_queue(replicas: Sequence[Hashable], queues: Mapping[Hashable, int | None], imbalance: int) -> list[Hashable]:
    """The replicas at most `imbalance` queued requests behind the shortest known queue (an unknown one counts)."""
    known = [q for q in (queues.get(r) for r in replicas) if q is not None]
    shortest = min(known) if known else 0
    return [r for r in replicas if queues.get(r) is None or queues[r] - shortest <= imbalance]


def rank(chunks: Sequence[tuple[bytes, int]], summaries: Mapping[Hashable, bytes | None],
         queues: Mapping[Hashable, int | None], imbalance: int = 4,
         recent: Mapping[Hashable, set[bytes]] | None = None,
         shares: Mapping[Hashable, int] | None = None, bound: float = 1.5, window: int = 0) -> list[list[Hashable]]:
    """Replicas in ranks, best first: those holding the most of the request's chunk characters (ties together),
    then the rest of the balanced ones by what they hold, then those more than `imbalance` queued requests behind
    the shortest queue or past their bounded load. An unknown queue length counts as balanced. `recent`: names a
    router sent to each replica since its last summary (they will be held there once served). `shares`: requests
    sent to each replica lately; one sent more than `bound` times the mean (plus one) waits its turn, as in
    consistent hashing with bounded loads (Mirrokni et al., 2018): queues stay short when requests are fast, so
    the queue guard alone let one replica take every request whose chunks it held. One sent less than the mean
    over `bound` (minus one) joins the first rank: the cap alone left a replica holding nothing popular with only
    the overflow (a fifth of its peers' requests). Until `window` requests were counted, the mean is taken over
    `window` and nobody is below it: a quiet server sends a few requests in a row where their chunks are."""
    replicas = list(summaries)
    if not replicas:
        return []
    shares, recent = shares or {}, recent or {}
    total = sum(shares.values())
    mean = max(total, window) / len(replicas)
    cap = bound * mean + 1
    balanced = [r for r in within_queue(replicas, queues, imbalance) if shares.get(r, 0) <= cap] or replicas
    overloaded = [r for r in replicas if r not in balanced]
    scores = {r: score(chunks, summaries[r], recent.get(r, set())) for r in balanced}
    best = max(scores.values(), default=0)
    if best == 0:
        return [balanced] + ([overloaded] if overloaded else [])
    floor = mean / bound - 1 if total >= window else -1
    top = [r for r in balanced if scores[r] == best or shares.get(r, 0) < floor]  # shuffle ties before
    rest = sorted((r for r in balanced if r not in top), key=lambda r: -scores[r])
    return [top] + ([rest] if rest else []) + ([overloaded] if overloaded else [])
