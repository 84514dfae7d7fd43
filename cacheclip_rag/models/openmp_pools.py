"""Keep one OpenMP pool in a process whose model work runs on one thread (the server's worker).

torch's CPU ops run their parallel regions on an OpenMP team. With GNU libgomp (the runtime torch's
Linux wheels bundle), every thread that has run a parallel region keeps a pool of helper threads until
it exits. Once the process holds more OpenMP threads than there are CPUs, libgomp stops spin-waiting
between regions (its "throttled" spin count): each of a decode step's hundreds of small regions then
waits for its helpers to wake. Measured on 2 cores (Qwen2.5 0.5B, float32, 2K context, median of 20
steps): a decode step took ~130 ms on the thread that had loaded the model and 149-175 ms on a second
thread, as a server's worker is; with the first thread's pool released, 136-141 ms.

`release_thread_pool` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`, which
libgomp implements for the calling thread) in every libgomp the process has loaded: wheels bundle their
own copies (torch's, and faiss's and scikit-learn's, each with its own pools), and the one torch uses is
not told apart by name. The thread's next parallel region builds a new pool, at the cost of starting its
helper threads again. A libgomp older than GCC 9 has no `omp_pause_resource_all` (faiss-cpu 1.8.0 bundles
one) and is skipped. Elsewhere (another OpenMP runtime, no OpenMP) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the pool's threads and memory


class _LoadedObject(ctypes.Structure):
    """The head of glibc's (and musl's) `struct dl_phdr_info`, up to its load and unload counters."""

    _fields_ = [("addr", ctypes.c_size_t), ("name", ctypes.c_char_p), ("phdr", ctypes.c_void_p),
                ("phnum", ctypes.c_uint16), ("adds", ctypes.c_ulonglong), ("subs", ctypes.c_ulonglong)]


_VISIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_LoadedObject), ctypes.c_size_t, ctypes.c_void_p)


def _iterate_loaded() -> Callable[..., int] | None:
    """libc's `dl_iterate_phdr`; None where there is none (not a glibc/musl process)."""
    try:
        return getattr(ctypes.CDLL(None), "dl_iterate_phdr", None)
    except (OSError, TypeError):  # no C library of the process to open (TypeError: Windows' CDLL(None))
        return None


# looked up once: `_loads` runs at every release (once a decode step in the frameworks' async streams)
_ITERATE_LOADED = _iterate_loaded()


def _loads() -> tuple[int, int] | None:
    """How many shared objects the process has loaded and unloaded so far (the dynamic linker's own
    counters, read from the first object `dl_iterate_phdr` visits); None where they cannot be read."""
    counters: list[tuple[int, int]] = []

    def first(info: Any, size: int, _: Any) -> int:
        if size >= ctypes.sizeof(_LoadedObject):
            counters.append((info.contents.adds, info.contents.subs))
        return 1  # stop after the first

    if _ITERATE_LOADED is None:  # no dynamic linker API of that name
        return None
    _ITERATE_LOADED(_VISIT(first), None)
    return counters[0] if counters else None


_found: tuple[tuple[int, int] | None, list[ctypes.CDLL]] = (None, [])  # (_loads() when scanned, the libgomps)


def _libgomps() -> list[ctypes.CDLL]:
    """Every libgomp this process has loaded. The scan of /proc/self/maps (~0.7 ms) runs again only after
    the dynamic linker has loaded or unloaded an object (the frameworks' async streams release once a
    step); where its counters cannot be read, every time."""
    global _found
    loads = _loads()
    if loads is None or _found[0] != loads:
        _found = (loads, _scan())
    return _found[1]


def _scan() -> list[ctypes.CDLL]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return []
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and line.split()[-1].startswith("/")}
    return [library for library in map(_open, sorted(paths)) if library is not None]


@functools.cache
def _open(path: str) -> ctypes.CDLL | None:
    library = ctypes.CDLL(path)  # already loaded: the same instance
    if not hasattr(library, "omp_pause_resource_all"):
        return None
    library.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return library


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP helper threads, in every libgomp loaded; whether there was one to
    ask. Call it outside torch ops, on a thread that will not run the model's steps."""
    libraries = _libgomps()
    return bool(libraries) and all([library.omp_pause_resource_all(OMP_PAUSE_HARD) == 0 for library in libraries])


def releasing(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, then the calling thread's OpenMP pool released (also when it raised)."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_thread_pool()


async def to_thread_releasing(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a thread of asyncio's executor, whose OpenMP pool is then given back."""
    return await asyncio.to_thread(releasing, fn, *args, **kwargs)
