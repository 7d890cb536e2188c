"""``model.host_memory``: with ``keep`` a large freed block stays in the process for reuse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posttrain.models.host_memory import _glibc, apply_setting

PROBE = """
import ctypes, json, sys
import torch
from posttrain.models.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
x = torch.ones(64 * 2**20 // 4)  # a 64 MiB block, over glibc's largest mmap threshold
held = libc.mallinfo2()
del x
freed = libc.mallinfo2()
print(json.dumps({"applied": applied, "mapped_while_held": held.hblkhd, "heap_free_after": freed.fordblks}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="mallopt is glibc's")
def test_keep_serves_large_blocks_from_the_heap_and_keeps_them_after_free():
    default, keep = _probe("return"), _probe("keep")
    # the C library's default: the 64 MiB block is its own mapping, unmapped again on free
    assert not default["applied"]
    assert default["mapped_while_held"] >= 64 * 2**20
    assert default["heap_free_after"] < 64 * 2**20
    # keep: no mapping; once freed the block sits in the heap's free memory, ready for the next step
    assert keep["applied"]
    assert keep["mapped_while_held"] < 64 * 2**20
    assert keep["heap_free_after"] >= 64 * 2**20


def test_the_setting_applies_only_to_keep_on_the_cpu():
    assert apply_setting("return", "cpu") is False
    assert apply_setting("keep", "cuda:0") is False
    assert apply_setting("keep", "cpu") is (_glibc() is not None)
