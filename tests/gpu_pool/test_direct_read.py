"""Direct reads of store bytes the page cache does not hold (gpu_pool.arena.direct_read): the
bytes are the file's whatever the alignment, only uncached aligned bytes go direct, and a
file system without O_DIRECT reads buffered. Real files, real page cache."""

from __future__ import annotations

import mmap
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.arena.base import CopyJob
from gpu_pool.arena.cpu import CpuArena
from gpu_pool.arena.direct_read import DIRECT_ALIGN, StoreFile
from gpu_pool.errors import LoadError

FILE_BYTES = (3 << 20) + 1234  # not a whole number of blocks: the last one is short


def write_file(path: Path, nbytes: int = FILE_BYTES, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED drops them
    return data


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_into(file: StoreFile, job: CopyJob, size: int) -> bytes:
    """Run ``job`` into a page-aligned buffer of ``size`` bytes; the job's destination bytes."""
    buf = mmap.mmap(-1, size)
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    with memoryview(buf) as view:
        file.read(job, view[job.dst : job.dst + job.nbytes], base + job.dst)
    out = buf[job.dst : job.dst + job.nbytes]
    buf.close()
    return out


def supports_direct(path: Path) -> bool:
    file = StoreFile(str(path))
    file.close()
    return file.direct_fd is not None


def direct_file(path: Path) -> StoreFile:
    file = StoreFile(str(path))
    if file.direct_fd is None:
        file.close()
        pytest.skip(f"the file system of {path} has no O_DIRECT")
    return file


def test_uncached_aligned_bytes_are_read_directly_and_exactly(tmp_path: Path) -> None:
    path = tmp_path / "store.bin"
    data = write_file(path)
    drop_cache(path)
    file = direct_file(path)
    try:
        job = CopyJob(str(path), 0, 0, FILE_BYTES)  # to the end: the short last block buffered
        assert read_into(file, job, FILE_BYTES + 4096) == data
        assert FILE_BYTES - DIRECT_ALIGN < file.bytes_direct <= FILE_BYTES
        assert file.bytes_direct % DIRECT_ALIGN == 0
    finally:
        file.close()


def test_cached_bytes_are_copied_from_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "store.bin"
    data = write_file(path)
    path.read_bytes()  # every page cached
    file = direct_file(path)
    try:
        assert read_into(file, CopyJob(str(path), 0, 0, FILE_BYTES), FILE_BYTES) == data
        assert file.bytes_direct == 0
    finally:
        file.close()


@settings(max_examples=40, deadline=None)
@given(
    src=st.integers(0, FILE_BYTES - 1),
    nbytes=st.integers(1, 1 << 20),
    dst=st.integers(0, 8192),
    congruent=st.booleans(),
)
def test_any_job_gets_the_files_bytes(
    tmp_path_factory: pytest.TempPathFactory, src: int, nbytes: int, dst: int, congruent: bool
) -> None:
    """Heads, tails, jobs whose file and arena offsets disagree modulo the block: always the
    file's bytes (direct or not)."""
    path = tmp_path_factory.mktemp("direct") / "store.bin"
    data = write_file(path, seed=src)
    drop_cache(path)
    nbytes = min(nbytes, FILE_BYTES - src)
    if congruent:
        dst = dst // DIRECT_ALIGN * DIRECT_ALIGN + src % DIRECT_ALIGN
    file = StoreFile(str(path))
    try:
        got = read_into(file, CopyJob(str(path), src, dst, nbytes), dst + nbytes + 4096)
        assert got == data[src : src + nbytes]
        if not congruent and (dst - src) % DIRECT_ALIGN:
            assert file.bytes_direct == 0
    finally:
        file.close()


def test_a_truncated_store_file_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "store.bin"
    write_file(path)
    drop_cache(path)
    file = StoreFile(str(path))
    try:
        with pytest.raises(LoadError, match="ends before byte"):
            read_into(file, CopyJob(str(path), 1 << 20, 0, FILE_BYTES), FILE_BYTES + 4096)
    finally:
        file.close()


def test_a_file_in_memory_is_read_buffered() -> None:
    """tmpfs: no O_DIRECT before Linux 6.6, and its pages are always cached since."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    path = shm / f"ember-direct-test-{os.getpid()}"
    try:
        data = write_file(path)
        file = StoreFile(str(path))
        try:
            job = CopyJob(str(path), 4096, 0, 1 << 20)
            assert read_into(file, job, 2 << 20) == data[4096 : 4096 + (1 << 20)]
            assert file.bytes_direct == 0
        finally:
            file.close()
    finally:
        path.unlink()


@pytest.mark.parametrize("direct", [True, False])
def test_the_cpu_arena_loads_a_dropped_file_exactly(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "store.bin"
    data = write_file(path)
    drop_cache(path)
    arena = CpuArena(8 << 20, prefault=False, direct_reads=direct)
    try:
        half = FILE_BYTES // 2 // DIRECT_ALIGN * DIRECT_ALIGN
        jobs = [CopyJob(str(path), 0, 4096, half), CopyJob(str(path), half, 4 << 20, FILE_BYTES - half)]
        arena.load([[jobs[0]], [jobs[1]]])
        assert arena.read(4096, half) == data[:half]
        assert arena.read(4 << 20, FILE_BYTES - half) == data[half:]
        if direct and supports_direct(path):
            assert arena.bytes_read_direct > FILE_BYTES // 2
        elif not direct:
            assert arena.bytes_read_direct == 0
    finally:
        arena.close()


def test_a_cached_file_on_overlayfs_is_read_from_the_page_cache(tmp_path: Path) -> None:
    """overlayfs (a container's root file system) keeps the page cache on the file underneath,
    which cachestat on the overlay's descriptor does not see: without a guard, every cached
    byte was read again from the disk."""
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "merged")}
    for layer in layers.values():
        layer.mkdir()
    options = f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}"
    mounted = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(layers["merged"])],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an overlayfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        path = layers["merged"] / "store.bin"
        data = write_file(path)
        path.read_bytes()  # every page cached
        file = StoreFile(str(path))
        try:
            assert read_into(file, CopyJob(str(path), 0, 0, FILE_BYTES), FILE_BYTES) == data
            assert file.bytes_direct == 0
        finally:
            file.close()
    finally:
        subprocess.run(["umount", str(layers["merged"])], check=True)
