"""The CPU engine's malloc setting: a freed large buffer is reused without page faults."""
import subprocess
import sys

import pytest

# Faults on re-allocating and touching a freed 64 MiB buffer, before and after keep_freed_memory().
_PROBE = """
import resource, sys, torch
from replica.executor.cpu_allocator import keep_freed_memory

def refault_pages():
    torch.empty(2**24).fill_(1.0)  # 64 MiB, freed at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(2**24).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = refault_pages()
enabled = keep_freed_memory()
for _ in range(4):  # the first few after the switch grow the heap; how many depends on what lies above it
    refault_pages()
print(default, enabled, refault_pages(), keep_freed_memory())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_refaulting_large_buffers():
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    default, enabled, after, again = result.stdout.split()
    pages = 2**26 // 4096
    assert int(default) >= pages // 2  # glibc mmaps it afresh: every page faults again
    assert (enabled, again) == ("True", "True")
    assert int(after) < pages // 100
