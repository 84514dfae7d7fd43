"""The CPU forward's allocator setting: blocks of every size come from glibc's heap, freed ones stay with the
process for the next forward, a model load's are mapped as glibc's default maps them, and the environment rules.
Read from glibc's own bookkeeping (`mallinfo2`), not from page-fault counts, which transparent huge pages make
vary run to run. (glibc's defaults are not pinned here: they adapt to what was freed before, and a small block
left above freed ones keeps them, so their outcome varies.)"""

import os
import platform
import subprocess
import sys

import pytest

# the bytes glibc maps for one 16 MB block, for a 48 MB block under `large_blocks_mapped` and for one after it
# (below and above glibc's largest mmap threshold); then what a forward's layer does: many intermediates alive at once
# (128 of 1 MB), then freed, a few times over; and how much free memory glibc's heap then holds
PROBE = """
import ctypes, sys, torch
from cacheclip_rag.models.cpu_allocator import keep_freed_memory, large_blocks_mapped
applied = keep_freed_memory() if sys.argv[1] == "tuned" else {}
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
def mapped_for(size):
    before = mallinfo2().hblkhd
    block = torch.ones(size, dtype=torch.uint8)
    mapped = mallinfo2().hblkhd - before
    del block
    return mapped
small = mapped_for(16 << 20)
with large_blocks_mapped():  # first: no freed 48 MB block in the heap yet, which glibc would reuse unmapped
    loading = mapped_for(48 << 20)
large = mapped_for(48 << 20)  # after it: from the heap again
for _ in range(4):
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(128)]
    del blocks
print(len(applied), small, large, loading, mallinfo2().fordblks)
"""
MB = 1 << 20


def probe(mode: str, **env: str) -> list[int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=300,
                         env=environment, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [int(x) for x in out.stdout.split()]


glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                           or tuple(map(int, platform.libc_ver()[1].split("."))) < (2, 33),
                           reason="glibc's mallopt and mallinfo2")


@glibc
def test_blocks_come_from_the_heap_and_stay_with_the_process_once_tuned():
    applied, small, large, loading, kept = probe("tuned")
    assert applied == 3
    assert small == 0 and large == 0  # from the heap, not fresh mappings, above glibc's largest threshold too
    assert loading >= 48 * MB  # a model load's are mapped, and only while it loads
    assert kept >= 128 * MB  # the freed layer's blocks kept for the next: no pages to fault in


@glibc
def test_the_environment_rules_over_the_setting():
    # glibc's own default threshold set in the environment: the setting steps aside, and the blocks are mapped
    applied, small, large, loading, _ = probe("tuned", MALLOC_MMAP_THRESHOLD_="131072")
    assert applied == 0 and small >= 16 * MB and large >= 48 * MB and loading >= 48 * MB
