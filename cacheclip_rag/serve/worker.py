"""The model's one worker thread and the bounded queue in front of it.

The engine runs one request at a time (a request already keeps every core busy); the HTTP front is
async and never blocks on the model. A job is admitted only while fewer than `max_queue` are waiting
or running (else `QueueFull`: the server answers 429 with Retry-After). Text pieces flow back through
an asyncio queue as they decode. A job whose client went away, or that passed its time limit, is
cancelled: its decode stops at the next token and the worker moves on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..request import Answer, Stream

DONE = object()  # the end of a job's pieces


class QueueFull(Exception):
    """No room for another request; `retry_after_s` estimates when there will be."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy (queue full); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    start: Callable[[], Stream]  # runs the prefill; its pieces are then decoded one by one
    loop: asyncio.AbstractEventLoop
    timeout_s: float
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None
    error: BaseException | None = None
    submitted: float = field(default_factory=time.monotonic)

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """One thread taking jobs in order; `submit` refuses when `max_queue` are waiting or running."""

    def __init__(self, max_queue: int = 8):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active = 0
        self._lock = threading.Lock()
        self._recent_s = 1.0  # a running mean of how long a job takes, for Retry-After
        self._thread = threading.Thread(target=self._run, name="cacheclip-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        with self._lock:
            return self._active

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._active >= self.max_queue:
                raise QueueFull(max(1, round(self._recent_s * (self._active - self.max_queue + 1))))
            self._active += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.monotonic()
            try:
                self._serve(job)
            except BaseException as err:  # noqa: BLE001 - handed to the request that owns it
                job.error = err
            finally:
                job.emit(DONE)
                with self._lock:
                    self._active -= 1
                    self._recent_s = 0.8 * self._recent_s + 0.2 * (time.monotonic() - started)

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            return  # the client left while it waited
        deadline = job.submitted + job.timeout_s
        stream = job.start()
        for piece in stream:
            job.emit(piece)
            if job.cancelled.is_set() or time.monotonic() > deadline:
                if time.monotonic() > deadline:
                    job.error = TimeoutError(f"the request ran past its {job.timeout_s:g} s limit")
                stream.pieces.close()  # stops the decode: no more forwards for a client that is gone
                return
        job.answer = stream.answer

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
