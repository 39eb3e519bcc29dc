"""``ckpt convert`` pins glibc's malloc (converters/engine/allocator.py): a freed buffer goes back to the OS.

Run in a child process (mallopt is process-wide): the child frees a 16 MiB buffer (which, with glibc's adaptive
defaults, raises the mmap threshold to 16 MiB), then allocates an 8 MiB buffer, small long-lived tensors after it,
and frees the 8 MiB one.  With the thresholds pinned, ``RssAnon`` is back within 2 MiB of where it started (with
glibc's defaults it stays ~8.6 MiB up: the freed buffer is a hole in the heap below live objects).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

CHILD = r"""
import re, sys
import torch
from ckpt.converters.engine.allocator import pin_malloc

def anon():
    return int(re.search(r"RssAnon:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

assert pin_malloc() is True
before = anon()
big = torch.empty(4 << 20).fill_(1)  # 16 MiB
del big
buf = torch.empty(2 << 20).fill_(1)  # 8 MiB
keep = [torch.ones(50_000) for _ in range(4)]  # long-lived 200 KB tensors after it
del buf
print(anon() - before)
"""


def test_pinned_malloc_returns_freed_buffers() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.strip().splitlines()[-1])
    assert grown < 2 << 20, f"RssAnon grew {grown / 2**20:.1f} MiB after every big buffer was freed"
