"""`paths train` on a CPU serves large tensors from glibc's heap instead of a fresh mmap() each
(paths/allocator.py): checked in fresh interpreters through glibc's own accounting of mmapped
blocks, with the setting and without it (PATHS_MALLOC=system)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, torch
from paths.allocator import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
kept = keep_freed_memory()
x = torch.empty(64 << 20, dtype=torch.uint8)  # one 64 MiB block, as a step's logits or activations
x.fill_(1)
held = libc.mallinfo2()
print(json.dumps({"kept": kept, "mmapped": held.hblkhd, "heap": held.arena}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(None)
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc_with_mallinfo2(), reason="glibc >= 2.33 only")
def test_large_tensors_come_from_the_heap_unless_told_otherwise():
    kept = probe({})
    assert kept["kept"] is True and kept["mmapped"] < (64 << 20) <= kept["heap"], kept
    system = probe({"PATHS_MALLOC": "system"})
    assert system["kept"] is False and system["mmapped"] >= (64 << 20), system
