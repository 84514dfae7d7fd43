"""The engine's scheduler: the model's one worker thread and the bounded queue in front of it (the server
runs every request through it, as vLLM v1 keeps scheduling in its engine core).

The engine runs one forward at a time (a forward already keeps every core busy); the HTTP front is
async and never blocks on the model. Scheduling puts the first token first: a
waiting request's prefill runs before the running requests' next decode step, and between two
prefills one running request decodes one piece (round robin), so decodes go on under a stream of
arrivals without making the new requests wait for them. With no prefill waiting, the running requests
decode one piece each, their next-token forwards run as one batch (`batching.forward_rows`, up to
`max_batch` requests: a decode step is bound by reading the weights, so B requests' steps cost little
more than one request's; bench/results/batching.json). A batched step between two prefills would delay
the second one's first token by the whole batch (measured: p50 TTFT +29% and +42% at 4 clients,
bench/RESULTS.md), hence the round robin while prefills wait. A request's time to first token is its own prefill plus the prefills and
single steps ahead of it, not the whole decodes of the requests before it (bench/RESULTS.md compares
this with all-prefills-first and with first-come-first-served). A job is admitted only
while fewer than `max_queue` are waiting or running (else `QueueFull`: the server answers 429 with
Retry-After). Text pieces flow back through an asyncio queue as they decode. A job whose client went
away, or that passed its time limit, is cancelled: its decode stops at its next step and the worker
moves on.

The worker is the one thread whose OpenMP pool stays: the thread that builds the worker (the one that
loaded the model) gives its pool back, and so does each thread that runs model work off the worker
(`off_worker`: ingest, planning). With more OpenMP threads alive than CPUs, libgomp stops spin-waiting
and each served decode step ran 1.17x as long (`openmp_pools`, bench/results/served_decode.json).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..models.openmp_pools import release_thread_pool, to_thread_releasing
from ..stages.decode.batching import forward_rows
from ..stages.request import Answer, Stream

DONE = object()  # the end of a job's pieces
_NOTHING = object()  # no job waiting


off_worker = to_thread_releasing  # model work off the worker thread (ingest, planning): its pool given back


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
    on_end: Callable[[], None] | None = None  # called on the worker's thread once the job has ended, whatever ended it

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Running:
    job: Job
    stream: Stream | None
    started: float
    pieces: Iterator[str] | None = None


class Worker:
    """One thread running jobs, first tokens first (see the module); `submit` refuses when `max_queue` are
    waiting or running; up to `max_batch` running jobs decode a step in one forward."""

    def __init__(self, max_queue: int = 8, max_batch: int = 8):
        if max_queue < 1 or max_batch < 1:
            raise ValueError(f"max_queue and max_batch must be >= 1, got {max_queue} and {max_batch}")
        self.max_queue, self.max_batch = max_queue, max_batch
        self.batched_steps = 0  # decode forwards that ran for two requests or more together
        self.batched_requests = 0  # the request steps inside them
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active = 0
        self._lock = threading.Lock()
        self._recent_s = 1.0  # a running mean of how long a job takes, for Retry-After
        release_thread_pool()  # this thread's (it loaded the model): the worker's pool is the one steps need
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
        running: deque[_Running] = deque()
        while True:
            try:  # wait for work only when nothing is decoding
                job = self._jobs.get(block=not running)
            except queue.Empty:
                job = _NOTHING
            if job is None:
                for r in running:
                    self._finish(r, stop=True)
                return
            if job is not _NOTHING:  # a waiting job's prefill and first piece before anyone's next step
                r = self._start(job)
                if r is not None:
                    running.append(r)
            if running and not self._jobs.empty():  # more prefills wait: one piece of one running job, in turn
                r = running.popleft()
                if self._step(r):
                    running.append(r)
            elif running:  # none waits: one piece of each of the next max_batch running jobs, forwards batched
                group = [running.popleft() for _ in range(min(self.max_batch, len(running)))]
                self._batch_forwards(group)
                running.extend(r for r in group if self._step(r))

    def _batch_forwards(self, group: list[_Running]) -> None:
        """Run the next-token forwards the group's decoders are waiting for as one batch and hand each its
        logits. Jobs without a batchable decoder step on their own; if the batch fails, each job runs its
        own forward in its step and meets its own error there."""
        steps = [(d, step) for r in group if not r.job.cancelled.is_set()
                 and (d := r.stream.decoder) is not None and d.batchable
                 and (step := d.pending()) is not None]
        models = {id(d.lm.model) for d, _ in steps}
        if len(steps) < 2 or len(models) != 1:
            return
        try:
            logits = forward_rows(steps[0][0].lm.model, [step for _, step in steps])
        except Exception:  # noqa: BLE001 - each request's own step reports its own error
            return
        for (d, _), row in zip(steps, logits):
            d.provide(row)
        self.batched_steps += 1
        self.batched_requests += len(steps)

    def _start(self, job: Job) -> _Running | None:
        r = _Running(job, None, time.monotonic())
        if job.cancelled.is_set():  # the client left while it waited
            self._finish(r)
            return None
        try:
            r.stream = job.start()
            r.pieces = iter(r.stream)
        except BaseException as err:  # noqa: BLE001 - handed to the request that owns it
            job.error = err
            self._finish(r)
            return None
        return r if self._step(r) else None

    def _step(self, r: _Running) -> bool:
        """One piece of a running job; False once it has finished (and was finished here)."""
        job = r.job
        try:
            piece = next(r.pieces, DONE)
        except BaseException as err:  # noqa: BLE001
            job.error = err
            self._finish(r)
            return False
        if piece is DONE:
            job.answer = r.stream.answer
            self._finish(r)
            return False
        job.emit(piece)
        late = time.monotonic() > job.submitted + job.timeout_s
        if job.cancelled.is_set() or late:
            if late:
                job.error = TimeoutError(f"the request ran past its {job.timeout_s:g} s limit")
            self._finish(r, stop=True)
            return False
        return True

    def _finish(self, r: _Running, stop: bool = False) -> None:
        if stop and r.stream is not None:
            r.stream.pieces.close()  # stops the decode: no more forwards for a client that is gone
        with self._lock:  # the slot is free before the client hears the end (a depth read then sees it)
            self._active -= 1
            self._recent_s = 0.8 * self._recent_s + 0.2 * (time.monotonic() - r.started)
        if r.job.on_end is not None:
            r.job.on_end()
        r.job.emit(DONE)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
