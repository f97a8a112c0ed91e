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
from gpu_pool.manifest import DTYPE_ITEMSIZE, TensorEntry

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


def _entry(name: str, dtype: str, shape: tuple[int, ...]) -> TensorEntry:
    nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    return TensorEntry(name, dtype, shape, nbytes, "0" * 32, "/store/model.safetensors", 0)


@settings(max_examples=100, deadline=None)
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple),
            st.integers(0, SIZE),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_many_views_are_each_the_same_as_one_view(tensors: list[tuple[str, tuple[int, ...], int]]) -> None:
    """An acquire's views in one call (PoolClient.views) read exactly what one view() each reads."""
    raw = torch.arange(SIZE, dtype=torch.int32).to(torch.uint8)
    views = Views(raw.untyped_storage(), raw.device)
    entries, offsets = [], {}
    for i, (dtype, shape, slot) in enumerate(tensors):
        itemsize = DTYPE_ITEMSIZE[dtype]
        entries.append(_entry(f"t{i}", dtype, shape))
        offsets[f"t{i}"] = min(slot, SIZE - math.prod(shape) * itemsize) // itemsize * itemsize
    got = views.many(entries, offsets)
    assert list(got) == [e.name for e in entries]
    for e in entries:
        one = views.view(offsets[e.name], e.dtype, e.shape)
        v = got[e.name]
        assert v.shape == one.shape and v.dtype == one.dtype and v.stride() == one.stride()
        assert v.storage_offset() == one.storage_offset()
        assert torch.equal(v.reshape(-1).view(torch.uint8), one.reshape(-1).view(torch.uint8))


def test_many_views_refuse_one_past_the_end() -> None:
    raw = torch.zeros(1024, dtype=torch.uint8)
    views = Views(raw.untyped_storage(), raw.device)
    entries = [_entry("fits", "float32", (2,)), _entry("overruns", "float32", (2,))]
    assert views.many(entries[:1], {"fits": 1024 - 8})["fits"].shape == (2,)
    with pytest.raises(ProtocolError):
        views.many(entries, {"fits": 0, "overruns": 1024 - 4})
