"""CUDA backend: host cache bookkeeping, move planning, and the arena itself.

Most tests run on CPU: :class:`HostCacheIndex` and :func:`kernels.plan_move` are pure
Python, and :class:`CudaArena` is also driven through a stand-in ``cupy`` module whose
"device memory" is host memory and whose kernel launch refuses overlapping ranges, so the
arena's move/load/cache logic is exercised without a GPU. Tests marked ``gpu`` use real
CuPy on a real device and skip cleanly where there is none.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import subprocess
import sys
import textwrap
import types
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool import kernels
from gpu_pool.arena import CopyJob
from gpu_pool.arena_cuda import CudaArena, attach_cuda
from gpu_pool.errors import BackendUnavailable, LoadError
from gpu_pool.host_cache import CacheKey, HostCacheIndex, PinnedBuffer, PinnedHostCache
from gpu_pool.loader import group_copies

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _key(name: str, nbytes: int, src: int = 0) -> CacheKey:
    return (name, src, nbytes)


def _memmove(model: bytearray, dst: int, src: int, nbytes: int) -> None:
    # The right-hand slice is a copy, so this is memmove semantics.
    model[dst : dst + nbytes] = bytes(model[src : src + nbytes])


# -- HostCacheIndex ----------------------------------------------------------------------------


def test_index_lru_order_and_counters() -> None:
    index: HostCacheIndex[str] = HostCacheIndex(100)
    assert index.put(_key("a", 40), "A")
    assert index.put(_key("b", 40), "B")
    assert index.get(_key("a", 40)) == "A"  # a becomes most recently used
    assert index.get(_key("zz", 1)) is None
    assert (index.hits, index.misses) == (1, 1)
    assert index.put(_key("c", 40), "C")  # evicts b, the least recently used
    assert index.keys() == [_key("a", 40), _key("c", 40)]
    assert _key("b", 40) not in index
    assert index.used_bytes == 80
    assert (index.evictions, index.evicted_bytes) == (1, 40)


def test_index_budget_edges() -> None:
    index: HostCacheIndex[int] = HostCacheIndex(100)
    assert not index.put(_key("big", 101), 1)  # larger than the whole budget: not stored
    assert index.used_bytes == 0
    assert not index.put(_key("empty", 0), 1)
    assert index.put(_key("exact", 100), 2)
    assert index.put(_key("x", 1), 3)  # evicts "exact"
    assert index.keys() == [_key("x", 1)]
    assert index.put(_key("x", 1), 4)  # replace keeps the size
    assert index.used_bytes == 1 and index.peek(_key("x", 1)) == 4
    assert index.evict_lru() == (_key("x", 1), 4)
    assert index.evict_lru() is None
    with pytest.raises(ValueError):
        HostCacheIndex(-1)
    zero: HostCacheIndex[int] = HostCacheIndex(0)
    assert not zero.put(_key("a", 1), 1)


def test_index_validation_rejects_stale_entries() -> None:
    index: HostCacheIndex[tuple[int, str]] = HostCacheIndex(10)
    index.put(_key("f", 5), (1, "old"))
    assert index.get(_key("f", 5), lambda v: v[0] == 2) is None
    assert _key("f", 5) not in index and index.used_bytes == 0
    assert (index.hits, index.misses) == (0, 1)
    assert index.discard(_key("f", 5)) is None


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 64),
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "evict"]), st.integers(0, 7), st.integers(0, 80)),
        max_size=60,
    ),
)
def test_index_never_exceeds_budget_and_matches_reference_lru(
    budget: int, ops: list[tuple[str, int, int]]
) -> None:
    index: HostCacheIndex[int] = HostCacheIndex(budget)
    reference: OrderedDict[CacheKey, int] = OrderedDict()
    hits = misses = 0
    for op, name, size in ops:
        key = _key(f"f{name}", size % 9 + (size % 3) * 10)
        if op == "put":
            stored = index.put(key, size)
            nbytes = key[2]
            assert stored == (0 < nbytes <= budget)
            if stored:
                if key in reference:
                    reference[key] = size
                    reference.move_to_end(key)
                else:
                    while sum(k[2] for k in reference) + nbytes > budget:
                        reference.popitem(last=False)
                    reference[key] = size
        elif op == "get":
            got = index.get(key)
            if key in reference:
                hits += 1
                reference.move_to_end(key)
                assert got == reference[key]
            else:
                misses += 1
                assert got is None
        else:
            evicted = index.evict_lru()
            expected = reference.popitem(last=False) if reference else None
            assert evicted == expected
        assert index.used_bytes <= budget
        assert index.used_bytes == sum(k[2] for k in reference)
        assert index.keys() == list(reference)
    assert (index.hits, index.misses) == (hits, misses)


def test_pinned_host_cache_checks_file_signature() -> None:
    cache = PinnedHostCache(1000)
    data = bytearray(b"x" * 10)
    buffer = PinnedBuffer(data, 0, 10)
    key = _key("/store/f", 10)
    assert cache.put(key, (1, 2, 3, 4), buffer)
    assert cache.get(key, (1, 2, 3, 4)) is buffer
    assert cache.get(key, (1, 2, 3, 5)) is None  # the file changed since: stale
    assert cache.get(key, (1, 2, 3, 4)) is None
    assert (cache.hits, cache.misses) == (1, 2)
    with pytest.raises(ValueError):
        cache.put(_key("/store/f", 11), (1, 2, 3, 4), buffer)
    view = buffer.view()
    view[:3] = b"abc"
    view.release()
    assert bytes(data[:4]) == b"abcx"


# -- move planning -----------------------------------------------------------------------------


def _run_plan(memory: bytearray, steps: list[kernels.CopyStep]) -> None:
    for step in steps:
        # Every launch must be a plain copy between disjoint ranges.
        assert step.nbytes > 0
        assert step.dst + step.nbytes <= step.src or step.src + step.nbytes <= step.dst
        memory[step.dst : step.dst + step.nbytes] = bytes(memory[step.src : step.src + step.nbytes])


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 300),
    data=st.data(),
    scratch_bytes=st.integers(1, 40),
    direct_min=st.integers(1, 64),
)
def test_plan_move_is_memmove(size: int, data: st.DataObject, scratch_bytes: int, direct_min: int) -> None:
    nbytes = data.draw(st.integers(0, size))
    src = data.draw(st.integers(0, size - nbytes))
    dst = data.draw(st.integers(0, size - nbytes))
    rng = random.Random(size * 7919 + src * 31 + dst)
    arena = bytearray(rng.randbytes(size))
    scratch = size + 8  # a separate region after the arena
    memory = arena + bytearray(8 + scratch_bytes)
    steps = kernels.plan_move(
        dst, src, nbytes, scratch=scratch, scratch_bytes=scratch_bytes, direct_min_distance=direct_min
    )
    _run_plan(memory, steps)
    expected = bytearray(arena)
    _memmove(expected, dst, src, nbytes)
    assert memory[:size] == expected
    distance = abs(dst - src)
    if 0 < distance < nbytes and distance >= direct_min:
        assert len(steps) == -(-nbytes // distance)
    if kernels.needs_scratch(dst, src, nbytes, direct_min):
        assert len(steps) == 2 * -(-nbytes // scratch_bytes)


def test_plan_move_launch_counts_at_real_sizes() -> None:
    gib = 1 << 30
    scratch = 8 * gib  # an address outside [0, 2 GiB)
    # A 1 GiB slide down by 4 KiB stages through 64 MiB pieces: 32 launches, not 262,144.
    steps = kernels.plan_move(0, 4096, gib, scratch=scratch)
    assert len(steps) == 2 * (gib // kernels.STAGE_BYTES)
    # A slide by 16 MiB runs in place in 16 MiB chunks, descending when moving up.
    steps = kernels.plan_move(16 * MiB, 0, 64 * MiB)
    assert [s.src for s in steps] == [48 * MiB, 32 * MiB, 16 * MiB, 0]
    assert kernels.plan_move(0, 100, 100) == [kernels.CopyStep(0, 100, 100)]
    assert kernels.plan_move(5, 5, 100) == []
    with pytest.raises(ValueError, match="scratch"):
        kernels.plan_move(0, 1, 100)
    with pytest.raises(ValueError, match="overlaps"):
        kernels.plan_move(0, 1, 100, scratch=50)


def test_launch_blocks() -> None:
    assert kernels.launch_blocks(0, 16, 0) == 1
    assert kernels.launch_blocks(0, 16, 16 * 256 * 10) == 11
    assert kernels.launch_blocks(0, 1, 256 * 10) == 10  # byte path: one thread per byte
    assert kernels.launch_blocks(0, 16, 1 << 40) == kernels.MAX_BLOCKS


def test_kernel_source_names_the_kernel() -> None:
    assert f'extern "C" __global__ void {kernels.MOVE_KERNEL_NAME}(' in kernels.MOVE_KERNEL_SOURCE


# -- import and availability without CUDA ------------------------------------------------------


def test_modules_import_without_touching_cupy() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # any "import cupy" now fails
        import gpu_pool.arena_cuda, gpu_pool.kernels, gpu_pool.host_cache
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_without_cupy_the_backend_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailable, match="CuPy"):
        CudaArena(0, MiB)
    handle = {"kind": "cuda_ipc", "device": 0, "size": MiB, "ipc_handle": bytes(64)}
    with pytest.raises(BackendUnavailable, match="CuPy"):
        attach_cuda(handle)


def test_constructing_without_cuda_raises_backend_unavailable() -> None:
    try:
        import cupy

        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_device = False
    if has_device:
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendUnavailable):
        CudaArena(0, MiB)


def test_attach_rejects_malformed_handles() -> None:
    with pytest.raises(ValueError, match="kind"):
        attach_cuda({"kind": "shm", "path": "/dev/shm/x", "size": 1})
    with pytest.raises(ValueError, match="64 bytes"):
        attach_cuda({"kind": "cuda_ipc", "device": 0, "size": 1, "ipc_handle": b"short"})
    with pytest.raises(ValueError, match="malformed"):
        attach_cuda({"kind": "cuda_ipc", "device": 0, "size": 1})


# -- CudaArena against a stand-in cupy ---------------------------------------------------------


class _FakePinned(np.ndarray):
    """Host memory with the ``ptr`` attribute of a PinnedMemoryPointer."""

    @property
    def ptr(self) -> int:
        return int(self.ctypes.data)


class _FakeCupy:
    """Just the CuPy surface the backend uses, over host memory, executing work immediately."""

    def __init__(self, device_count: int = 1) -> None:
        self.launches: list[int] = []
        self.allocations: list[np.ndarray] = []
        self.trims = 0
        fake = self

        class Memory:
            def __init__(self, size: int) -> None:
                # cudaMalloc'ed memory is not zeroed: start from garbage.
                self.buf = np.full(size, 0xAB, dtype=np.uint8)
                self.ptr = int(self.buf.ctypes.data)

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                self.ptr = id(self)

            def synchronize(self) -> None:
                pass

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> Device:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        class RawKernel:
            def __init__(self, code: str, name: str) -> None:
                assert name in code

            def __call__(
                self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...], stream: Any
            ) -> None:
                assert all(isinstance(a, np.uint64) for a in args)
                dst, src, n = (int(a) for a in args)
                assert dst + n <= src or src + n <= dst or n == 0, "overlapping ranges in one launch"
                if n:
                    ctypes.memmove(dst, src, n)
                    fake.launches.append(n)

        def get_device_count() -> int:
            return device_count

        def alloc_pinned_memory(n: int) -> _FakePinned:
            buf = np.empty(n, dtype=np.uint8).view(_FakePinned)
            fake.allocations.append(buf)
            return buf

        def trim() -> None:
            fake.trims += 1

        runtime = types.SimpleNamespace(
            getDeviceCount=get_device_count,
            memsetAsync=lambda ptr, value, size, stream: ctypes.memset(ptr, value, size),
            memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size),
            ipcGetMemHandle=lambda ptr: int(ptr).to_bytes(8, "little") + bytes(56),
            memGetInfo=lambda: (0, 0),
        )
        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            Memory=Memory,
            Stream=Stream,
            Device=Device,
            alloc_pinned_memory=alloc_pinned_memory,
        )
        self.RawKernel = RawKernel
        self.get_default_pinned_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=trim)


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """Keep a kernel built by one cupy (fake or real) from leaking into other tests."""
    kernels.move_kernel.cache_clear()
    yield
    kernels.move_kernel.cache_clear()


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch, fresh_kernels: None) -> _FakeCupy:
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


def _random_file(path: Path, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    path.write_bytes(data)
    return data


def test_fake_no_device(monkeypatch: pytest.MonkeyPatch, fresh_kernels: None) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(device_count=0))
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        CudaArena(0, MiB)
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(device_count=1))
    with pytest.raises(BackendUnavailable, match="device 3 does not exist"):
        CudaArena(3, MiB)


def test_fake_arena_moves_like_memmove(fake_cupy: _FakeCupy, tmp_path: Path) -> None:
    capacity = 48 * MiB
    arena = CudaArena(0, capacity, host_cache_bytes=0, num_threads=2, scratch_bytes=MiB)
    try:
        assert arena.device == "cuda:0"
        assert arena.read(0, 64) == bytes(64)  # zeroed, although the allocation was garbage
        handle = arena.handle()
        assert handle["kind"] == "cuda_ipc" and handle["size"] == capacity and handle["device"] == 0
        assert isinstance(handle["ipc_handle"], bytes) and len(handle["ipc_handle"]) == 64
        model = bytearray(_random_file(tmp_path / "fill", capacity, seed=1))
        arena.load([[CopyJob(str(tmp_path / "fill"), 0, 0, capacity)]])
        cases = [
            (0, 4096, 10 * MiB + 3),  # small distance, down
            (4096 + 7, 0, 10 * MiB),  # small distance, up, unaligned
            (1, 2, 5),
            (0, 16 * MiB, 30 * MiB),  # large distance, down, in place
            (17 * MiB + 16, MiB, 30 * MiB - 1),  # large distance, up, in place
            (40 * MiB, 0, 8 * MiB),  # no overlap
            (3, 3, 100),  # no-op
        ]
        for dst, src, n in cases:
            fake_cupy.launches.clear()
            arena.move(dst, src, n)
            _memmove(model, dst, src, n)
            assert arena.read(0, capacity) == model, (dst, src, n)
            assert sum(fake_cupy.launches) in (0, n, 2 * n)
        with pytest.raises(ValueError):
            arena.move(capacity - 10, 0, 11)
    finally:
        arena.close()
    arena.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        arena.read(0, 1)


def test_fake_arena_load_uses_host_cache(fake_cupy: _FakeCupy, tmp_path: Path) -> None:
    path = tmp_path / "tensors.bin"
    data = _random_file(path, 3 * MiB + 5, seed=2)
    arena = CudaArena(0, 8 * MiB, host_cache_bytes=4 * MiB, num_threads=3)
    try:
        jobs = [
            CopyJob(str(path), off, off + 1, min(256 * 1024 + 1, len(data) - off))
            for off in range(0, len(data), 256 * 1024 + 1)
        ]
        groups = group_copies(jobs, min_group=512 * 1024, max_chunk=MiB)
        arena.load(groups)
        assert arena.read(1, len(data)) == data
        misses = arena.host_cache_misses
        assert arena.host_cache_hits == 0 and misses == sum(len(g) for g in groups)
        arena.load([[CopyJob(str(path), 0, 0, 0)]])  # empty job: nothing happens
        # Same ranges to other offsets: all served from pinned memory, nothing re-read.
        allocated = len(fake_cupy.allocations)
        shifted = [[CopyJob(j.file, j.src, j.dst + 4 * MiB, j.nbytes) for j in g] for g in groups]
        arena.load(shifted)
        assert arena.host_cache_hits == misses
        assert len(fake_cupy.allocations) == allocated
        assert arena.read(4 * MiB + 1, len(data)) == data
        # A replaced file (new inode) is not served from the cache.
        os.replace(_write(tmp_path / "new", data[::-1]), path)
        arena.load([[CopyJob(str(path), 0, 0, 100)]])
        assert arena.read(0, 100) == data[::-1][:100]
    finally:
        arena.close()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_fake_arena_load_errors_name_the_file(fake_cupy: _FakeCupy, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    data = _random_file(path, 1000, seed=3)
    arena = CudaArena(0, MiB, num_threads=2)
    try:
        with pytest.raises(LoadError, match=r"short\.bin ends before byte 1100"):
            arena.load([[CopyJob(str(path), 0, 0, 10)], [CopyJob(str(path), 100, 100, 1000)]])
        assert arena.read(0, 10) == data[:10]  # the good group still completed
        with pytest.raises(LoadError, match=r"missing\.bin"):
            arena.load([[CopyJob(str(tmp_path / "missing.bin"), 0, 0, 10)]])
        with pytest.raises(ValueError):
            arena.load([[CopyJob(str(path), 0, MiB - 5, 10)]])
    finally:
        arena.close()


def test_fake_pinned_pool_is_trimmed(fake_cupy: _FakeCupy) -> None:
    cache = PinnedHostCache(0)  # nothing fits: every buffer is released after its copy
    buffer = cache.allocate(300 * MiB)
    assert not cache.put(_key("f", 300 * MiB), (0, 0, 0, 0), buffer)
    assert fake_cupy.trims == 1


# -- real GPU ----------------------------------------------------------------------------------


@pytest.fixture
def cupy_device(fresh_kernels: None) -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count <= 0:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
def test_gpu_move_matches_memmove(cupy_device: Any, tmp_path: Path) -> None:
    capacity = 96 * MiB
    model = bytearray(_random_file(tmp_path / "fill", capacity, seed=4))
    cases = [
        (0, 1, 3 * MiB),  # distance 1, down
        (1, 0, 3 * MiB),  # distance 1, up
        (0, 4096, 10 * MiB + 5),  # small distance, down, several scratch pieces
        (4096 + 3, 0, 10 * MiB),  # small distance, up, unaligned
        (0, 16 * MiB, 50 * MiB),  # distance = 16 MiB: in place, ascending
        (20 * MiB + 16, 0, 60 * MiB),  # large distance, up: in place, descending
        (MiB + 8, 40 * MiB + 1, 20 * MiB + 7),  # no overlap, different alignment
        (0, 90 * MiB, 6 * MiB),
    ]
    for scratch_bytes in (MiB, 0):  # a small fixed scratch buffer; a temporary one per move
        arena = CudaArena(0, capacity, host_cache_bytes=0, scratch_bytes=scratch_bytes)
        try:
            assert arena.read(0, 4096) == bytes(4096)
            arena.load([[CopyJob(str(tmp_path / "fill"), 0, 0, capacity)]])
            expected = bytearray(model)
            assert arena.read(0, capacity) == expected
            for dst, src, n in cases:
                arena.move(dst, src, n)
                _memmove(expected, dst, src, n)
                assert arena.read(0, capacity) == expected, (scratch_bytes, dst, src, n)
        finally:
            arena.close()


@pytest.mark.gpu
def test_gpu_load_and_host_cache(cupy_device: Any, tmp_path: Path) -> None:
    path = tmp_path / "tensors.bin"
    data = _random_file(path, 20 * MiB + 13, seed=5)
    arena = CudaArena(0, 64 * MiB, host_cache_bytes=32 * MiB, num_threads=4)
    try:
        jobs = [
            CopyJob(str(path), off, off, min(3 * MiB, len(data) - off))
            for off in range(0, len(data), 3 * MiB)
        ]
        groups = group_copies(jobs, min_group=2 * MiB, max_chunk=4 * MiB)
        arena.load(groups)
        assert arena.read(0, len(data)) == data
        njobs = sum(len(g) for g in groups)
        assert (arena.host_cache_hits, arena.host_cache_misses) == (0, njobs)
        moved = [[CopyJob(j.file, j.src, j.dst + 32 * MiB, j.nbytes) for j in g] for g in groups]
        arena.load(moved)
        assert (arena.host_cache_hits, arena.host_cache_misses) == (njobs, njobs)
        assert arena.read(32 * MiB, len(data)) == data
        path.write_bytes(data[:100])
        with pytest.raises(LoadError, match=r"tensors\.bin"):
            arena.load([[CopyJob(str(path), 0, 0, 200)]])
    finally:
        arena.close()


_CLIENT = """
import hashlib, sys
import torch
from gpu_pool.arena_cuda import attach_cuda

handle = {"kind": "cuda_ipc", "device": 0, "size": int(sys.argv[1]), "ipc_handle": bytes.fromhex(sys.argv[2])}
offset, nbytes = int(sys.argv[3]), int(sys.argv[4])
arena = attach_cuda(handle)
assert arena.dtype == torch.uint8 and arena.shape == (int(sys.argv[1]),) and arena.is_cuda
again = attach_cuda(handle)  # a second attach reuses the open mapping
print(hashlib.sha256(arena[offset : offset + nbytes].cpu().numpy().tobytes()).hexdigest())
assert torch.equal(again[offset : offset + 64], arena[offset : offset + 64])
arena[0:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=arena.device)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_gpu_ipc_attach_from_another_process(cupy_device: Any, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = tmp_path / "tensors.bin"
    data = _random_file(path, 5 * MiB + 3, seed=6)
    capacity = 16 * MiB
    arena = CudaArena(0, capacity, host_cache_bytes=0)
    try:
        offset = 2 * MiB + 16
        arena.load([[CopyJob(str(path), 0, offset, len(data))]])
        handle = arena.handle()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _CLIENT,
                str(capacity),
                handle["ipc_handle"].hex(),
                str(offset),
                str(len(data)),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO_ROOT,
            env=env,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == hashlib.sha256(data).hexdigest()
        # The client's write went to the same memory.
        assert arena.read(0, 4) == bytes([1, 2, 3, 4])
    finally:
        arena.close()
