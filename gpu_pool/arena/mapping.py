"""Client-side memory: mapping the pool's arena and KV memory as torch tensors, tensor views
at pool offsets, and the hang-up watch of a session's socket (see :mod:`gpu_pool.client`)."""

from __future__ import annotations

import math
import mmap
import os
import select
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpu_pool.arena.madvise import MADV_POPULATE_READ, MADV_POPULATE_WRITE, madvise
from gpu_pool.errors import ProtocolError
from gpu_pool.manifest import DTYPE_ITEMSIZE, TensorEntry

if TYPE_CHECKING:
    import torch


def attach(handle: dict[str, Any], fd: int | None) -> torch.Tensor:
    if handle["kind"] == "memfd":
        if fd is None:
            raise ProtocolError("the pool sent no arena descriptor with its hello reply")
        return map_memfd(fd, int(handle["size"]), writable=False)
    if handle["kind"] == "cuda_ipc":
        from gpu_pool.arena.cuda import attach_cuda

        return attach_cuda(handle)
    raise ProtocolError(f"unknown arena kind {handle['kind']!r}")


def map_memfd(fd: int, size: int, writable: bool) -> torch.Tensor:
    """A 1-D uint8 tensor over a shared mapping of the memfd ``fd`` (``size`` bytes)."""
    import torch

    actual = os.fstat(fd).st_size
    if actual != size:
        raise ProtocolError(f"pool memory has {actual} bytes, expected {size}")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    with warnings.catch_warnings():
        # The arena is read-only on purpose (weights); torch warns about exactly that.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


PAGE_BYTES = mmap.PAGESIZE


def page_ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (offset, length) ranges of whole pages covering the byte ``spans`` (offset, length),
    merged where they touch or overlap, in order."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(spans):
        if length <= 0:
            continue
        start = offset - offset % PAGE_BYTES
        end = -(-(offset + length) // PAGE_BYTES) * PAGE_BYTES
        if out and start <= out[-1][0] + out[-1][1]:
            last_start, last_length = out[-1]
            out[-1] = (last_start, max(last_length, end - last_start))
        else:
            out.append((start, end - start))
    return out


def populate_pages(base_address: int, ranges: Iterable[tuple[int, int]], write: bool = False) -> str | None:
    """Fill this process's page tables for ``ranges`` (offset, length; page-aligned) of the
    mapping at ``base_address``, read-only, copying nothing: the first pass over them then
    takes no page faults. ``write``: writable instead (the mapping must be), allocating
    (zeroed) the pages no one has written yet, so the first writes take no faults either.
    Returns None, or why the kernel refused (EINVAL before Linux 5.14: the pages then fault
    in on first use, as without this)."""
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    for offset, length in ranges:
        refused = madvise(base_address + offset, length, advice)
        if refused is not None:
            return refused
    return None


class Views:
    """Tensor views at byte offsets of one storage (the arena, or a session's KV memory).

    Each view is ``as_strided`` on one 1-D base tensor per dtype that spans the storage: a few
    microseconds, against ~5-30 for a fresh tensor ``set_`` on the storage, and an acquire makes
    one view per tensor (272 for SmolLM2). Every view shares the storage: no copy."""

    def __init__(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        self.storage = storage
        self.device = device
        self._bases: dict[str, torch.Tensor] = {}

    def view(self, offset: int, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` over the bytes from ``offset``."""
        shape = tuple(shape)
        size, itemsize = self.storage.nbytes(), DTYPE_ITEMSIZE[dtype]
        return _view(
            self._base(dtype), size, offset, itemsize, shape, contiguous_stride(shape), math.prod(shape)
        )

    def many(self, entries: Iterable[TensorEntry], offsets: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """:meth:`view` of every entry at ``offsets[entry.name]``, by name: an acquire's views.

        The storage's size, each dtype's base and each shape's stride are looked up once (a
        model repeats a few shapes: SmolLM2's 272 tensors have 9), which halves the ~1.8 ms
        that 272 calls of :meth:`view` took on a Zen 3 core."""
        size = self.storage.nbytes()
        bases: dict[str, tuple[torch.Tensor, int]] = {}  # dtype -> base, itemsize
        strides: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}  # shape -> stride, numel
        out: dict[str, torch.Tensor] = {}
        for e in entries:
            base = bases.get(e.dtype)
            if base is None:
                base = bases[e.dtype] = (self._base(e.dtype), DTYPE_ITEMSIZE[e.dtype])
            known = strides.get(e.shape)
            if known is None:
                known = strides[e.shape] = (contiguous_stride(e.shape), math.prod(e.shape))
            out[e.name] = _view(base[0], size, offsets[e.name], base[1], e.shape, *known)
        return out

    def _base(self, dtype: str) -> torch.Tensor:
        """The 1-D tensor of ``dtype`` spanning the storage (made on first use)."""
        import torch

        base = self._bases.get(dtype)
        if base is None:
            empty = torch.empty(0, dtype=getattr(torch, dtype), device=self.device)
            base = self._bases[dtype] = empty.set_(
                self.storage, 0, (self.storage.nbytes() // DTYPE_ITEMSIZE[dtype],), (1,)
            )
        return base


def _view(
    base: torch.Tensor,
    size: int,
    offset: int,
    itemsize: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    numel: int,
) -> torch.Tensor:
    """``base`` (a 1-D tensor over ``size`` bytes) at byte ``offset`` as ``shape``, checked."""
    assert offset % itemsize == 0, "the pool aligns every region"
    if offset < 0 or offset + numel * itemsize > size:
        raise ProtocolError(f"a view of {numel * itemsize} bytes at {offset} overruns the pool's memory")
    return base.as_strided(shape, stride, offset // itemsize)


def watch_hangup(sock_fd: int, stop_fd: int, callback: Callable[[], None]) -> None:
    """Block until the peer hangs up (then call ``callback``) or ``stop_fd`` is readable."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLRDHUP | select.POLLHUP)  # not POLLIN: replies are not ours
    poller.register(stop_fd, select.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if stop_fd in events:
                return
            if events.get(sock_fd, 0) & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                callback()
                return
    finally:
        os.close(stop_fd)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
