"""CPU workers keep freed heap memory: the same allocations, repeated, stop faulting pages in."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Rounds of 64 blocks of 1 MiB (above glibc's initial mmap threshold), touched, then all freed: the
# pattern of a step's activations. Prints the minor page faults of the last round.
_ROUNDS = """
import ctypes, resource, sys
from scalestudy.train.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc((1 << 20) + 64 * i) for i in range(64)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""


def _last_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


def test_retained_memory_is_reused_without_page_faults():
    default, retained = _last_round_faults("default"), _last_round_faults("retain")
    assert default > 1000, f"glibc's defaults faulted only {default} pages: the test shows nothing"
    assert retained < default / 20, (default, retained)
