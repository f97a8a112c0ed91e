"""The page a worker publishes its requests in, as the agent reads it (untrusted)."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from runtime.mesh.state_page import MAX_ENTRIES, MAX_SLOWDOWN, PAGE_BYTES, Entry, StatePage


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
