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
