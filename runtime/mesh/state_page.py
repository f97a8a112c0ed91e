"""An instance's unfinished requests, shared with its agent through one page of memory.

The agent's shadow validation (:mod:`runtime.mesh.shadow`) needs every co-located instance's
requests as they are now (arrival, prompt length, tokens out), and an instance on a lease
sends no messages. So each worker writes its request table into a page the agent made for it
(a memfd passed at spawn) after every engine step, and the agent reads the pages when a
request asks to be admitted. A sequence counter makes the copy consistent (odd while the
writer is in the middle: the reader retries). The agent trusts nothing it reads: counts and
values are bounded, and a page that does not read back consistently counts as empty.

Layout (little-endian): header ``<IIIIdd`` (version, sequence, count, reserved, average output
tokens, slowdown: the engine's measured iteration time over its time table's, lately), then
``count`` entries ``<dII`` (arrival in monotonic seconds, prompt tokens, tokens out), at most
:data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import fcntl
import math
import os
import struct
from collections.abc import Iterable
from typing import NamedTuple

VERSION = 2
MAX_ENTRIES = 128
_HEADER = struct.Struct("<IIIIdd")
_ENTRY = struct.Struct("<dII")
PAGE_BYTES = 4096
assert _HEADER.size + MAX_ENTRIES * _ENTRY.size <= PAGE_BYTES
_READ_TRIES = 64
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.25, 20.0  # what a page may claim (a worker runs tenant code)


def new_page_fd() -> int:
    """A memfd of :data:`PAGE_BYTES` for one worker's page, sealed at that size: the worker
    (tenant code runs there) can reach its copy of the fd, and a page truncated under the
    agent's mapping would kill the agent with SIGBUS on its next read."""
    fd = os.memfd_create("ember-mesh-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Entry(NamedTuple):
    arrival_s: float
    input_len: int
    tokens_out: int


class PageState(NamedTuple):
    avg_out: float  # the instance's average output length so far (tokens; 0: none finished)
    entries: list[Entry]
    slowdown: float = 1.0  # its iterations' measured time over its time table's (bounded)


class StatePage:
    """One instance's page (``buf``: a writable mapping of :data:`PAGE_BYTES`)."""

    def __init__(self, buf: memoryview) -> None:
        if len(buf) < PAGE_BYTES:
            raise ValueError(f"a state page is {PAGE_BYTES} bytes, got {len(buf)}")
        self._buf = buf
        self._seq = 0

    def write(self, avg_out: float, entries: Iterable[Entry], slowdown: float = 1.0) -> None:
        """Publish the instance's unfinished requests (the first :data:`MAX_ENTRIES`)."""
        rows = list(entries)[:MAX_ENTRIES]
        self._seq += 1  # odd: being written
        _HEADER.pack_into(self._buf, 0, VERSION, self._seq, 0, 0, 0.0, 1.0)
        for i, e in enumerate(rows):
            offset = _HEADER.size + i * _ENTRY.size
            _ENTRY.pack_into(self._buf, offset, e.arrival_s, e.input_len, e.tokens_out)
        self._seq += 1
        _HEADER.pack_into(self._buf, 0, VERSION, self._seq, len(rows), 0, avg_out, slowdown)

    def read(self, max_tokens: int) -> PageState:
        """The published table (empty when unreadable); values past ``max_tokens`` (the
        model's context) are clamped, entries with a non-finite arrival dropped."""
        for _ in range(_READ_TRIES):
            version, seq, count, _, avg_out, slowdown = _HEADER.unpack_from(self._buf, 0)
            if version != VERSION or seq % 2:
                continue
            raw = bytes(self._buf[_HEADER.size : _HEADER.size + min(count, MAX_ENTRIES) * _ENTRY.size])
            if _HEADER.unpack_from(self._buf, 0)[1] != seq:
                continue
            entries = [
                Entry(a, min(i, max_tokens), min(o, max_tokens))
                for a, i, o in _ENTRY.iter_unpack(raw)
                if math.isfinite(a)
            ]
            avg = min(avg_out, float(max_tokens)) if math.isfinite(avg_out) and avg_out > 0 else 0.0
            slow = min(max(slowdown, MIN_SLOWDOWN), MAX_SLOWDOWN) if math.isfinite(slowdown) else 1.0
            return PageState(avg, entries, slow)
        return PageState(0.0, [])
