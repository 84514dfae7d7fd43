"""glibc's malloc, told to keep the memory a CPU forward frees, so the next forward reuses it.

A forward on the CPU allocates its intermediates anew every layer: at a 2K prompt of Qwen2.5-0.5B, four
20 MB MLP tensors a layer. glibc serves a block that large with a fresh `mmap` (or grows its heap and trims
it again on free), and the kernel then zero-fills every page on first touch: the products and elementwise ops
run on page faults. Measured here (2 cores, Xeon with AMX, bf16, alternating processes): a 2K prefill took
1.88 s with glibc's defaults and 1.49 s with its mmap threshold at the maximum (32 MiB) and trimming held
off to 1 GiB; the silu of a layer's gate 6.2 ms against 3.0 ms. At 4K the MLP's 40 MB blocks pass that
maximum and were still mapped anew: 3.68 s a prefill, 2.75 s with no block mmapped at all (M_MMAP_MAX 0),
for 127 MB more resident after it. vLLM's CPU build gets the same by preloading tcmalloc into its workers.

`keep_freed_memory` sets all three through `mallopt` for this process, unless the environment already sets
one of glibc's own variables (ENVIRONMENT), which then rule: those are how an operator chooses otherwise.
Elsewhere than glibc it does nothing. The cost: up to TRIM_THRESHOLD of freed memory stays with the process
instead of going back to the system. A model load's large temporaries should go back: `large_blocks_mapped`
maps them again for its duration (`load_model` loads under it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_MAX = 0  # blocks mmapped at most at once: none, so larger blocks come from the heap too
GLIBC_MMAP_MAX = 65536  # glibc's default
TRIM_THRESHOLD = 1 << 30
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")

_applied: dict[str, int] = {}


@functools.cache
def _mallopt() -> ctypes._CFuncPtr | None:
    """libc's `mallopt`, None where there is none (looked up once: `find_library` runs ldconfig)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt to call
        return None


def keep_freed_memory() -> dict[str, int]:
    """Raise glibc's mmap and trim thresholds and stop its mmapping for this process (once); returns what was
    set, {} where nothing was (not glibc, or the environment sets one of ENVIRONMENT)."""
    if _applied or platform.system() != "Linux" or any(name in os.environ for name in ENVIRONMENT):
        return dict(_applied)
    mallopt = _mallopt()
    if mallopt is None:
        return {}
    settings = {"mmap_threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD), "trim_threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                "mmap_max": (M_MMAP_MAX, MMAP_MAX)}
    for key, (parameter, value) in settings.items():
        if mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) == 1:
            _applied[key] = value
        else:
            log.warning("mallopt refused %s=%d: CPU forwards keep allocating through page faults", key, value)
    return dict(_applied)


@contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Within: large blocks are mmapped as glibc does by default (a model load's temporaries then go back to the
    system when freed); after: none again, where `keep_freed_memory` stopped it."""
    mallopt = _mallopt() if "mmap_max" in _applied else None
    if mallopt is None:
        yield
        return
    mallopt(ctypes.c_int(M_MMAP_MAX), ctypes.c_int(GLIBC_MMAP_MAX))
    try:
        yield
    finally:
        mallopt(ctypes.c_int(M_MMAP_MAX), ctypes.c_int(MMAP_MAX))
