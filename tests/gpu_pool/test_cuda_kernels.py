"""CUDA backend: host cache bookkeeping, move planning, and the arena itself.

:class:`HostCacheIndex` and :func:`kernels.plan_move` are pure Python and tested on CPU,
as is importing the backend without CuPy. Tests marked ``gpu`` use real CuPy on a real
device (move, load through the pinned host cache, IPC attach from another process) and
skip cleanly where there is none.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.arena import kernels
from gpu_pool.arena.base import CopyJob
from gpu_pool.arena.cuda import CudaArena, attach_cuda
from gpu_pool.arena.host_cache import CacheKey, HostCacheIndex, PinnedBuffer, PinnedHostCache
from gpu_pool.arena.loader import group_copies
from gpu_pool.errors import BackendUnavailable, LoadError

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
        import gpu_pool.arena.cuda, gpu_pool.arena.kernels, gpu_pool.arena.host_cache
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


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """Keep a kernel built by one cupy (fake or real) from leaking into other tests."""
    kernels.move_kernel.cache_clear()
    yield
    kernels.move_kernel.cache_clear()


def _random_file(path: Path, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    path.write_bytes(data)
    return data


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
            # Many small moves at every alignment: the kernel's byte head, vector body and tail.
            rng = random.Random(scratch_bytes)
            window = 64 * 1024
            for _ in range(200):
                n = rng.randrange(0, 3000)
                src, dst = rng.randrange(0, window - n), rng.randrange(0, window - n)
                arena.move(dst, src, n)
                _memmove(expected, dst, src, n)
                assert arena.read(0, window) == expected[:window], (scratch_bytes, dst, src, n)
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


_CUPY_CLIENT = """
import hashlib, sys
import cupy
from gpu_pool.arena.cuda import _ipc_registry

size, raw, offset, nbytes = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with cupy.cuda.Device(0):
    mapping = _ipc_registry().acquire(cupy, raw, 0)
    assert _ipc_registry().acquire(cupy, raw, 0) is mapping  # opened once per process
    memory = cupy.cuda.UnownedMemory(mapping.ptr, size, mapping, 0)
    arena = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    print(hashlib.sha256(arena[offset : offset + nbytes].get().tobytes()).hexdigest())
    arena[0:4] = cupy.arange(1, 5, dtype=cupy.uint8)
    cupy.cuda.runtime.deviceSynchronize()
"""

_TORCH_CLIENT = """
import hashlib, sys
import torch
from gpu_pool.arena.cuda import attach_cuda

size, raw, offset, nbytes = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
handle = {"kind": "cuda_ipc", "device": 0, "size": size, "ipc_handle": raw}
arena = attach_cuda(handle)
assert arena.dtype == torch.uint8 and arena.shape == (size,) and arena.is_cuda
again = attach_cuda(handle)  # a second attach reuses the open mapping
print(hashlib.sha256(arena[offset : offset + nbytes].cpu().numpy().tobytes()).hexdigest())
assert torch.equal(again[offset : offset + 64], arena[offset : offset + 64])
arena[0:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=arena.device)
torch.cuda.synchronize()
"""


def _ipc_round_trip(client: str, tmp_path: Path) -> None:
    """Load bytes in this process, check them (and write 4 bytes) from a client process."""
    path = tmp_path / "tensors.bin"
    data = _random_file(path, 5 * MiB + 3, seed=6)
    capacity = 16 * MiB
    arena = CudaArena(0, capacity, host_cache_bytes=0)
    try:
        offset = 2 * MiB + 16
        arena.load([[CopyJob(str(path), 0, offset, len(data))]])
        handle = arena.handle()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        args = [str(capacity), handle["ipc_handle"].hex(), str(offset), str(len(data))]
        out = subprocess.run(
            [sys.executable, "-c", client, *args],
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


@pytest.mark.gpu
def test_gpu_ipc_mapping_from_another_process(cupy_device: Any, tmp_path: Path) -> None:
    _ipc_round_trip(_CUPY_CLIENT, tmp_path)


@pytest.mark.gpu
def test_gpu_attach_cuda_from_another_process(cupy_device: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        pytest.skip("this torch build has no CUDA support")
    _ipc_round_trip(_TORCH_CLIENT, tmp_path)
