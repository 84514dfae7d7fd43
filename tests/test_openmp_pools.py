"""A thread's OpenMP pool is given back: by `release_thread_pool`, after `off_worker`'s work, and by the
thread that builds the server's worker (so decode steps keep libgomp's spin-waits: `openmp_pools`)."""

import asyncio
import ctypes
import os
import shutil
import threading
import time

import pytest
import torch

from cacheclip_rag.models.openmp_pools import _libgomps, release_thread_pool
from cacheclip_rag.engine.scheduler import Worker, off_worker

pytestmark = pytest.mark.skipif(not _libgomps() or not os.path.isdir("/proc/self/task"),
                                reason="needs GNU libgomp (torch's Linux wheels) and /proc")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled(expected: int) -> int:
    """The thread count once exiting helpers are gone (they leave just after the pool is freed)."""
    for _ in range(200):
        if threads() == expected:
            break
        time.sleep(0.01)
    return threads()


def parallel_work() -> None:
    torch.ones(1 << 22).add_(1)  # large enough for a parallel region: the calling thread gets a pool


@pytest.fixture(autouse=True)
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # one helper a pool, even on a one-CPU runner
    yield
    torch.set_num_threads(previous)


def in_new_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(fn()))
    thread.start()
    thread.join()
    return out


def test_release_frees_the_calling_threads_helpers():
    def work():
        before = threads()
        parallel_work()
        with_pool = threads()
        released = release_thread_pool()
        after = settled(before)
        parallel_work()  # the thread's next region builds a pool again
        return {"helpers": with_pool - before, "released": released, "left": after - before,
                "again": threads() - before}

    out = in_new_thread(work)
    assert out == {"helpers": 1, "released": True, "left": 0, "again": 1}


def test_every_loaded_libgomp_is_asked():
    """faiss and scikit-learn bundle libgomps of their own; torch's is among them (a release that asked
    only the first one found freed nothing of torch's once faiss had been imported)."""
    pytest.importorskip("faiss")
    pytest.importorskip("sklearn")
    libraries = _libgomps()
    torch_lib = os.path.dirname(torch.__file__)
    maps = open("/proc/self/maps").read()
    mapped = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    # a libgomp older than GCC 9 has no omp_pause_resource_all and cannot be asked (faiss-cpu 1.8.0 bundles one)
    pausable = {path for path in mapped if hasattr(ctypes.CDLL(path), "omp_pause_resource_all")}
    assert sorted(library._name for library in libraries) == sorted(pausable)
    assert any(torch_lib in line and "libgomp" in line for line in maps.splitlines()) or "torch.libs" in maps
    test_release_frees_the_calling_threads_helpers()


def test_a_libgomp_loaded_without_an_import_is_found(tmp_path):
    """A copy loaded by ctypes (as an extension's bundled library can be, after sys.modules was last
    looked at) is found at the next release: CI once had faiss's copy missed by a cache keyed on imports."""
    before = _libgomps()
    torch_gomp = next(library._name for library in before if "torch" in library._name)
    copy = os.path.realpath(tmp_path / "libgomp-copy.so.1")
    shutil.copy(torch_gomp, copy)
    loaded = ctypes.CDLL(copy)
    assert [library._name for library in _libgomps()] == sorted([library._name for library in before] + [copy])
    assert release_thread_pool()
    del loaded


def test_work_off_the_worker_leaves_no_pool_behind():
    async def run() -> tuple[int, int]:
        def work() -> int:
            parallel_work()
            return threads()  # with this executor thread's pool

        inside = await off_worker(work)
        return inside, settled(inside - 1)

    inside, after = asyncio.run(run())
    assert after == inside - 1


def test_the_thread_that_builds_the_worker_gives_its_pool_back():
    def work():
        parallel_work()
        with_pool = threads()
        worker = Worker()  # starts its own thread (+1) and frees this one's helper (-1)
        after = settled(with_pool)
        worker.close()
        return {"change": after - with_pool}

    assert in_new_thread(work) == {"change": 0}


def test_async_iteration_in_the_frameworks_leaves_no_pool_behind():
    """LangChain's and LlamaIndex's async streams step our decoder in asyncio's executor threads."""
    from cacheclip_rag.integrations.common import aiter_in_thread

    def steps():
        for _ in range(3):
            parallel_work()
            yield threads()  # with the stepping thread's pool

    async def run() -> list[tuple[int, int]]:
        return [(inside, settled(inside - 1)) async for inside in aiter_in_thread(steps())]

    assert all(after == inside - 1 for inside, after in asyncio.run(run()))
