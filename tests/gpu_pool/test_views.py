"""Tensor views at pool offsets (gpu_pool.arena.mapping.Views): the bytes they read and write
are exactly the storage's at that offset, in that dtype and shape."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.arena.mapping import Views
from gpu_pool.errors import ProtocolError
from gpu_pool.manifest import DTYPE_ITEMSIZE

SIZE = 1 << 16
DTYPES = sorted(d for d in DTYPE_ITEMSIZE if hasattr(torch, d))


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    slot=st.integers(0, SIZE),
)
def test_a_view_is_the_storage_bytes_at_its_offset(dtype: str, shape: list[int], slot: int) -> None:
    raw = torch.arange(SIZE, dtype=torch.int32).to(torch.uint8)  # a byte pattern, not zeros
    views = Views(raw.untyped_storage(), raw.device)
    itemsize = DTYPE_ITEMSIZE[dtype]
    nbytes = math.prod(shape) * itemsize
    offset = min(slot, SIZE - nbytes) // itemsize * itemsize
    v = views.view(offset, dtype, shape)
    expected = raw[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
    assert v.shape == tuple(shape) and v.dtype == getattr(torch, dtype) and v.is_contiguous()
    assert torch.equal(v.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
    assert v.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()  # shared, no copy
    if nbytes:
        v.reshape(-1).view(torch.uint8)[0] = 7  # writes land in the storage
        assert int(raw[offset]) == 7


def test_a_view_past_the_end_is_refused() -> None:
    raw = torch.zeros(1024, dtype=torch.uint8)
    views = Views(raw.untyped_storage(), raw.device)
    with pytest.raises(ProtocolError):
        views.view(1024 - 4, "float32", (2,))
    assert views.view(1024 - 8, "float32", (2,)).shape == (2,)


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populated_ranges_are_read_without_page_faults() -> None:
    """populate_read enters a fresh mapping's pages into the page tables: reading the
    populated range afterwards faults no more, while an unpopulated range of the same size
    faults once per fault-around window (a standby's first prefill depends on this)."""
    import os

    from gpu_pool.arena.mapping import map_memfd, populate_read

    size = 32 << 20
    fd = os.memfd_create("populate-test")
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, b"\1" * size, 0)  # the pages exist, as in a pre-faulted arena
        arena = map_memfd(fd, size, writable=False)
        half = size // 2
        assert populate_read(arena.data_ptr(), size, [(0, half - 4096), (half - 4096, 4096)]) is None
        torch.ones(half // 8, dtype=torch.int64).sum()  # the reduction's threads and buffers, once
        before = _minor_faults()
        total = int(arena[:half].view(torch.int64).sum())  # no temporary: only the mapping is read
        expected = (half // 8 * 0x0101010101010101) % (1 << 64)  # int64 wraps
        assert total % (1 << 64) == expected  # every byte is 1: the populated pages are the file's
        populated = _minor_faults() - before
        before = _minor_faults()
        arena[half:].view(torch.int64).sum()
        unpopulated = _minor_faults() - before
    finally:
        os.close(fd)
    assert populated <= 4  # the sum's own small allocations at most
    assert unpopulated >= 64  # 16 MiB / 64 KiB fault-around: the control shows faults are counted


def test_populate_refuses_ranges_outside_the_mapping() -> None:
    from gpu_pool.arena.mapping import populate_read

    raw = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        populate_read(raw.data_ptr(), 8192, [(4096, 8192)])
