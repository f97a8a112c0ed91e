"""The page a worker publishes its requests in, as the agent reads it (untrusted)."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import time

from hypothesis import given
from hypothesis import strategies as st

from runtime.mesh.state_page import MAX_ENTRIES, MAX_SLOWDOWN, PAGE_BYTES, Entry, StatePage, new_page_fd

# What tenant code in the worker can do: find the page's fd and shrink the file.
TRUNCATE = """
import os, sys
fd = int(sys.argv[1])
try:
    os.ftruncate(fd, 0)
except OSError as exc:
    print(type(exc).__name__)
else:
    print("truncated")
"""


def test_a_worker_cannot_shrink_the_page_under_the_agents_mapping() -> None:
    fd = new_page_fd()
    try:
        agent = mmap.mmap(fd, PAGE_BYTES, prot=mmap.PROT_READ)
        worker = mmap.mmap(fd, PAGE_BYTES)  # the worker's writable mapping still works
        StatePage(memoryview(worker)).write(3.0, [Entry(time.monotonic(), 12, 1)])
        result = subprocess.run(
            [sys.executable, "-c", TRUNCATE, str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout.strip() == "PermissionError"
        # Truncated, the agent's next read would be SIGBUS: its process gone.
        assert os.fstat(fd).st_size == PAGE_BYTES
        state = StatePage(memoryview(agent)).read(4096)
        assert state.avg_out == 3.0 and [(e.input_len, e.tokens_out) for e in state.entries] == [(12, 1)]
        worker.close()
        agent.close()
    finally:
        os.close(fd)


def test_garbage_in_the_page_reads_as_bounded_values() -> None:
    buf = bytearray(PAGE_BYTES)
    buf[:] = b"\xff" * PAGE_BYTES  # version and counts all wrong: nothing
    assert StatePage(memoryview(buf)).read(4096).entries == []
    page = StatePage(memoryview(buf))
    page.write(float("inf"), [Entry(float("nan"), 2**31, 2**31), Entry(1.0, 10**6, 5)])
    state = page.read(4096)
    assert state.avg_out == 0.0 and state.entries == [Entry(1.0, 4096, 5)]


def test_round_trip_and_bounds() -> None:
    buf = memoryview(bytearray(PAGE_BYTES))
    page = StatePage(buf)
    page.write(12.5, [Entry(1.0, 10, 2), Entry(2.0, 5000, 0)], slowdown=2.0)
    state = StatePage(buf).read(max_tokens=2048)
    assert state.avg_out == 12.5 and state.slowdown == 2.0
    assert state.entries == [Entry(1.0, 10, 2), Entry(2.0, 2048, 0)]  # clamped to the context
    page.write(0.0, [Entry(0.0, 1, 0)] * (MAX_ENTRIES + 50), slowdown=1e9)
    state = page.read(2048)
    assert len(state.entries) == MAX_ENTRIES and state.slowdown == MAX_SLOWDOWN


def test_a_page_being_written_or_never_written_reads_empty() -> None:
    buf = memoryview(bytearray(PAGE_BYTES))
    assert StatePage(buf).read(100).entries == []
    page = StatePage(buf)
    page.write(1.0, [Entry(1.0, 1, 1)])
    struct.pack_into("<I", buf, 4, 7)  # an odd sequence: a writer in the middle (or a liar)
    assert page.read(100).entries == []


@given(st.binary(min_size=PAGE_BYTES, max_size=PAGE_BYTES))
def test_garbage_never_breaks_the_reader(raw: bytes) -> None:
    state = StatePage(memoryview(bytearray(raw))).read(4096)
    assert len(state.entries) <= MAX_ENTRIES
    assert all(0 <= e.input_len <= 4096 and 0 <= e.tokens_out <= 4096 for e in state.entries)
    assert 0 <= state.avg_out <= 4096 and 0.25 <= state.slowdown <= MAX_SLOWDOWN
