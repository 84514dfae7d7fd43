"""How many requests one client may have waiting or running: by API key and by address, both counted, so
one client (or one key used from many places) cannot fill the worker's queue while others wait. The
connection limit per address lives in the protocol (`protocol.TimedH11Protocol`)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter


class ClientSlots:
    """Requests in the queue per client name (`names`); taken on admission, given back when the request
    ends for any reason (the worker's end of a job). Thread-safe: given back on the worker's thread."""

    def __init__(self, per_client: int):
        self.per_client = per_client
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @staticmethod
    def names(key: str | None, address: str | None) -> tuple[str, ...]:
        """A request's client names: its key (hashed: no key is kept in memory twice) and its address."""
        out = ()
        if key:
            out += ("key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32],)
        if address:
            out += ("address:" + address,)
        return out

    def take(self, names: tuple[str, ...]) -> bool:
        """A slot under every name, or none (False: one of them is at its limit)."""
        if not self.per_client:
            return True
        with self._lock:
            if any(self._held[n] >= self.per_client for n in names):
                return False
            self._held.update(names)
            return True

    def give(self, names: tuple[str, ...]) -> None:
        if not self.per_client:
            return
        with self._lock:
            self._held.subtract(names)
            for n in names:
                if self._held[n] <= 0:
                    del self._held[n]

    def held(self, name: str) -> int:
        with self._lock:
            return self._held[name]
