"""A standby fills its page tables for the weights and its first KV blocks while it waits
(gpu_pool.arena.mapping.populate_pages, PoolClient.populate / populate_kv), so the first forward
pass after its activation takes no page faults: the ranges cover exactly the tensors' pages,
reading the weights and writing the KV blocks afterwards fault (almost) nothing, and what the
pages held stays."""

from __future__ import annotations

import itertools
import mmap
import os
import resource

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_pool.arena.mapping import PAGE_BYTES, map_memfd, page_ranges, populate_pages
from gpu_pool.client import PoolClient
from tests.conftest import PoolProcess, mapped_pages

SPANS = st.lists(st.tuples(st.integers(0, 64 * PAGE_BYTES), st.integers(0, 8 * PAGE_BYTES)), max_size=20)


@settings(max_examples=300, deadline=None)
@given(spans=SPANS)
def test_page_ranges_cover_exactly_the_spans_pages(spans: list[tuple[int, int]]) -> None:
    ranges = page_ranges(spans)
    wanted = {p for o, n in spans if n > 0 for p in range(o // PAGE_BYTES, (o + n - 1) // PAGE_BYTES + 1)}
    covered = [p for o, n in ranges for p in range(o // PAGE_BYTES, (o + n) // PAGE_BYTES)]
    assert set(covered) == wanted and len(covered) == len(wanted)  # every page once, no other
    assert all(o % PAGE_BYTES == 0 and n % PAGE_BYTES == 0 and n > 0 for o, n in ranges)
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(ranges))  # sorted, merged


def _minor_faults_reading(view: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert int(view[::PAGE_BYTES].sum()) >= 0  # one byte of every page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populated_weights_read_without_page_faults() -> None:
    size = 4096 * PAGE_BYTES  # 16 MiB of "weights" in a memfd, as the pool's arena
    fd = os.memfd_create("ember-test-arena")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as writer:
            writer.write(os.urandom(PAGE_BYTES) * 4096)  # resident, as a registered model is
        cold = map_memfd(fd, size, writable=False).numpy()
        warm = map_memfd(fd, size, writable=False).numpy()
        refused = populate_pages(warm.ctypes.data, page_ranges([(0, size)]))
        if refused is not None:
            pytest.skip(f"this kernel has no MADV_POPULATE_READ: {refused}")
        faults_cold, faults_warm = _minor_faults_reading(cold), _minor_faults_reading(warm)
        assert faults_cold >= 4096 // 64  # lazily mapped: faults (the kernel maps up to 16 pages a fault)
        assert faults_warm <= 4, (faults_warm, faults_cold)
    finally:
        os.close(fd)


def _minor_faults_writing(view: np.ndarray, offsets: list[int], nbytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for offset in offsets:
        view[offset : offset + nbytes : PAGE_BYTES] = 1  # one byte of every page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_pages_populated_for_writing_take_no_faults_and_keep_their_bytes() -> None:
    size = 1024 * PAGE_BYTES  # a session's KV memory: sparse, one written page among them
    fd = os.memfd_create("ember-test-kv")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as writer:
            writer[:PAGE_BYTES] = b"k" * PAGE_BYTES  # prefix KV the pool copied in
        cold = map_memfd(fd, size, writable=True).numpy()
        warm = map_memfd(fd, size, writable=True).numpy()
        half = size // 2
        refused = populate_pages(warm.ctypes.data, page_ranges([(0, half)]), write=True)
        if refused is not None:
            pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {refused}")
        assert bytes(warm[:PAGE_BYTES]) == b"k" * PAGE_BYTES and not warm[PAGE_BYTES:].any()
        faults_warm = _minor_faults_writing(warm, [PAGE_BYTES], half - PAGE_BYTES)
        faults_cold = _minor_faults_writing(cold, [half], half)  # pages no one touched yet
        assert faults_warm <= 4, (faults_warm, faults_cold)
        assert faults_cold >= 512 // 2  # a write fault maps one page of a shared file
    finally:
        os.close(fd)


def test_a_client_populates_its_kv_blocks(pool_process: PoolProcess) -> None:
    block_bytes = 16 * PAGE_BYTES
    with PoolClient(pool_process.socket_path) as c:
        base = c.kv_arena().data_ptr()
        held, later = c.kv_alloc(4, block_bytes, aligned=True), c.kv_alloc(4, block_bytes, aligned=True)
        refused = c.populate_kv(held)
        if refused is not None:
            pytest.skip(f"this kernel has no MADV_POPULATE_WRITE: {refused}")
        assert all(m for o in held.offsets for m in mapped_pages(base + o, 16))
        assert not any(m for o in later.offsets for m in mapped_pages(base + o, 16))
        assert not any(c.kv_arena()[o : o + block_bytes].any() for o in held.offsets)  # zeroed
