"""engine.cpu_malloc: once tuned, a big activation freed and allocated again costs no page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, torch
from engine.cpu_malloc import keep_freed_memory
tuned = keep_freed_memory()
for _ in range(5):
    torch.ones((48 << 20) // 4)  # a 48 MB activation, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones((48 << 20) // 4)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuning: str) -> tuple[str, int]:
    env = dict(os.environ, SPLITSERVE_CPU_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_big_blocks_stay_in_the_heap_once_tuned():
    tuned, faults = _faults("1")
    untuned, faults_before = _faults("0")
    assert (tuned, untuned) == ("True", "False")
    # 48 MB is 12,288 pages: untuned, every allocation faults them in again; tuned, the heap
    # keeps the block (a small allocation landing above it can make it grow once more).
    assert faults_before > 10 * 12_000 and faults * 4 < faults_before, (faults, faults_before)
