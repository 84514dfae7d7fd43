"""Pinned host buffers for host-to-GPU copies, reused across copies.

Pinning is a slow driver call (pinning a fresh buffer per entry cost more than the copy), so a small
ring of pinned buffers is kept and refilled. A slot is handed out only once the asynchronous copy
that last read it has finished; buffers grow to the largest payload seen.
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class PinnedStaging:
    """`stage` bytes into a pinned slot, start the copy that reads it, then `release` the slot: an event
    on the current CUDA stream marks when it may be refilled."""

    def __init__(self, slots: int = 4):
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._done: list[torch.cuda.Event | None] = [None] * slots
        self._busy = [False] * slots
        self._slot_of: dict[int, int] = {}
        self._cond = threading.Condition()  # the aux thread and the request thread both load through here

    def stage(self, raw: memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A pinned tensor of `dtype` and `shape` holding `raw`'s bytes (copied by numpy: fork-safe)."""
        nbytes = len(raw)
        with self._cond:
            self._cond.wait_for(lambda: not all(self._busy))
            slot = self._busy.index(False)
            self._busy[slot] = True
        if self._done[slot] is not None:
            self._done[slot].synchronize()  # the copy that last read this slot
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        np.copyto(buffer[:nbytes].numpy(), np.frombuffer(raw, dtype=np.uint8))
        staged = buffer[:nbytes].view(dtype).view(shape)
        with self._cond:
            self._slot_of[staged.data_ptr()] = slot
        return staged

    def release(self, staged: torch.Tensor) -> None:
        """The copies reading `staged` are queued on the current stream: free its slot behind them."""
        with self._cond:
            slot = self._slot_of.pop(staged.data_ptr())
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(staged.device if staged.is_cuda else None))
            self._done[slot] = event
            self._busy[slot] = False
            self._cond.notify_all()
