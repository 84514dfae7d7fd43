"""The server's scheduler: first tokens first. A request that arrives while another decodes has its
prefill run before the other's next step, then both decode a piece in turn; a cancelled or failing job
leaves the others running; the queue bound still holds."""

import asyncio
import threading
import time

import pytest

from cacheclip_rag.stages.request import Stream
from cacheclip_rag.engine.scheduler import DONE, Job, QueueFull, Worker


def job_of(name: str, pieces: int, log: list, loop, fail_at: int | None = None, timeout_s: float = 60) -> Job:
    lock = threading.Lock()

    def start() -> Stream:
        with lock:
            log.append(f"{name}:prefill")

        def decode():
            for i in range(pieces):
                if i == fail_at:
                    raise RuntimeError(f"{name} broke")
                time.sleep(0.02)
                log.append(f"{name}:{i}")
                yield f"{name}{i} "
        return Stream(decode())

    return Job(start, loop, timeout_s)


async def collect(job: Job) -> list:
    out = []
    while (item := await job.out.get()) is not DONE:
        out.append(item)
    return out


def test_a_new_request_is_prefilled_before_the_running_one_decodes_on():
    log: list[str] = []

    async def main():
        loop = asyncio.get_running_loop()
        worker = Worker(max_queue=4)
        a = job_of("A", 20, log, loop)
        worker.submit(a)
        while "A:2" not in log:
            await asyncio.sleep(0.005)
        b = job_of("B", 3, log, loop)
        worker.submit(b)
        got = await asyncio.gather(collect(a), collect(b))
        worker.close()
        return got

    a_out, b_out = asyncio.run(main())
    assert a_out == [f"A{i} " for i in range(20)] and b_out == ["B0 ", "B1 ", "B2 "]  # nothing lost or mixed
    assert log.index("B:prefill") < log.index("A:6")  # B's first token did not wait for A's whole decode
    assert log.index("B:2") < log.index("A:19")  # and both decoded in turn
    pairs = [e for e in log if e.startswith(("A:", "B:")) and not e.endswith("prefill")]
    between = pairs[pairs.index("B:0"): pairs.index("B:2") + 1]
    assert between == ["B:0", between[1], "B:1", between[3], "B:2"] and between[1].startswith("A:")


def test_a_cancelled_or_failing_job_leaves_the_others_running():
    log: list[str] = []

    async def main():
        loop = asyncio.get_running_loop()
        worker = Worker(max_queue=3)
        a, b, c = job_of("A", 10, log, loop), job_of("B", 10, log, loop, fail_at=2), job_of("C", 30, log, loop)
        for j in (a, b, c):
            worker.submit(j)
        with pytest.raises(QueueFull):
            worker.submit(job_of("D", 1, log, loop))
        while "C:3" not in log:
            await asyncio.sleep(0.005)
        c.cancel()
        got = await asyncio.gather(collect(a), collect(b), collect(c))
        depth = worker.depth
        worker.close()
        return got, depth, b.error

    (a_out, b_out, c_out), depth, error = asyncio.run(main())
    assert len(a_out) == 10 and b_out == ["B0 ", "B1 "] and isinstance(error, RuntimeError)
    assert 4 <= len(c_out) < 30 and depth == 0  # C stopped at its next step; every slot is free again
    assert "D:prefill" not in log


def test_a_job_past_its_time_limit_is_stopped_with_a_timeout():
    log: list[str] = []

    async def main():
        loop = asyncio.get_running_loop()
        worker = Worker(max_queue=2)
        slow = job_of("S", 1000, log, loop, timeout_s=0.2)
        worker.submit(slow)
        out = await collect(slow)
        worker.close()
        return out, slow.error

    out, error = asyncio.run(main())
    assert isinstance(error, TimeoutError) and 0 < len(out) < 1000


def test_running_jobs_decode_in_batches_and_each_gets_its_own_greedy_answer(make_engine):
    """Four requests over the real engine at once: their decode steps run as batched forwards, and each
    answer is token for token the one the engine gives it alone (and the one a worker with max_batch=1
    gives)."""
    from cacheclip_rag.config import RequestOptions
    from cacheclip_rag.testing import tiny_model
    from tests.conftest import CHUNKS

    engine = make_engine(tiny_model("gemma3"))
    engine.ingest(CHUNKS, progress=False)
    cases = [("what is the magic number?", CHUNKS[:2], "cacheclip"), ("who wrote it?", CHUNKS[1:3], "full"),
             ("where is the key?", CHUNKS[::-1], "cacheblend"), ("why?", CHUNKS[:1], "shared_prefix")]
    alone = [engine.generate(q, texts, RequestOptions(method=m, max_new_tokens=14)).token_ids for q, texts, m in cases]

    def served(max_batch: int) -> tuple[list[list[int]], int]:
        async def main():
            loop = asyncio.get_running_loop()
            worker = Worker(max_queue=8, max_batch=max_batch)
            jobs = []
            for q, texts, m in cases:
                job = Job(lambda q=q, texts=texts, m=m: engine.stream(q, texts, RequestOptions(method=m, max_new_tokens=14)),
                          loop, timeout_s=120)
                worker.submit(job)
                jobs.append(job)
            for job in jobs:
                await collect(job)
            worker.close()
            return [job.answer.token_ids for job in jobs], worker.batched_steps, [job.error for job in jobs]

        ids, steps, errors = asyncio.run(main())
        assert errors == [None] * len(cases)
        return ids, steps

    batched, steps = served(max_batch=8)
    one_by_one, none = served(max_batch=1)
    assert batched == alone == one_by_one
    assert steps > 0 and none == 0
    assert min(len(ids) for ids in alone) > 1  # every request decoded past its first token
