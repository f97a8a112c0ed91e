"""``madvise(2)`` over a mapping's address range, for the arena's page-table work.

Python's ``mmap.madvise`` needs the ``mmap`` object, and the arena's mappings are reached as
addresses (a numpy or torch buffer over them), so this calls libc through ctypes, which
releases the GIL for the call. ``MADV_POPULATE_READ``/``WRITE`` (Linux 5.14+) are not
exported by Python 3.11: their values are here.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

MADV_POPULATE_READ = 22  # fill page tables read-only (a reader's mapping of the weights)
MADV_POPULATE_WRITE = 23  # fault the pages in writable (the pool's own arena, at start)


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int]:
    call = ctypes.CDLL(None, use_errno=True).madvise
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return call


def madvise(address: int, length: int, advice: int) -> str | None:
    """``madvise(address, length, advice)``: None, or why the kernel refused (EINVAL before
    Linux 5.14 for the populate advice)."""
    if _libc_madvise()(address, length, advice) != 0:
        return os.strerror(ctypes.get_errno())
    return None
