"""What can go wrong with a store, as exceptions every store and its callers share."""


class StoreError(RuntimeError):
    """A stored entry cannot be used: wrong model, wrong format version, or corrupted."""


class CorruptEntryError(StoreError):
    """An entry's bytes are damaged (header unreadable, checksum mismatch, impossible content)."""


class StoreUnavailableError(StoreError):
    """A shared store cannot be reached (server down, network, timeout)."""


class StoreFullError(StoreError):
    """The store reached its size cap or the disk is full; the failed write left everything as it was."""


__all__ = ["CorruptEntryError", "StoreError", "StoreFullError", "StoreUnavailableError"]
