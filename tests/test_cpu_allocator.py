"""The CPU forward's allocator setting: blocks come from glibc's heap, freed ones stay with the process for the
next forward, and the environment rules. Read from glibc's own bookkeeping (`mallinfo2`), not from page-fault
counts, which transparent huge pages make vary run to run. (glibc's defaults are not pinned here: they adapt
to what was freed before, and a small block left above freed ones keeps them, so their outcome varies.)"""

import os
import platform
import subprocess
import sys

import pytest

# the bytes glibc mmaps for one 16 MB block; then what a forward's layer does: many intermediates alive at once
# (128 of 1 MB), then freed, a few times over; and how much more heap glibc still holds than before them
PROBE = """
import ctypes, sys, torch
from cacheclip_rag.models.cpu_allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else {}
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
mapped = mallinfo2().hblkhd
block = torch.ones(16 << 20, dtype=torch.uint8)
mapped = mallinfo2().hblkhd - mapped
del block
before = mallinfo2().arena
for _ in range(4):
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(128)]
    del blocks
print(len(applied), mapped, mallinfo2().arena - before)
"""
MB = 1 << 20


def probe(mode: str, **env: str) -> tuple[int, int, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env=environment, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    applied, mapped, kept = out.stdout.split()
    return int(applied), int(mapped), int(kept)


glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                           or tuple(map(int, platform.libc_ver()[1].split("."))) < (2, 33),
                           reason="glibc's mallopt and mallinfo2")


@glibc
def test_blocks_come_from_the_heap_and_stay_with_the_process_once_tuned():
    applied, mapped, kept = probe("tuned")
    assert applied == 2
    assert mapped == 0  # a 16 MB block from the heap, not a fresh mapping
    assert kept >= 96 * MB  # (less the 16 MB block reused) the freed layer's blocks kept for the next: no new pages to fault in


@glibc
def test_the_environment_rules_over_the_setting():
    # glibc's own default threshold set in the environment: the setting steps aside, and the block is mapped
    applied, mapped, _ = probe("tuned", MALLOC_MMAP_THRESHOLD_="131072")
    assert applied == 0 and mapped >= 16 * MB
