"""The state page a worker publishes its requests in, as the agent makes and reads it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

from runtime.mesh.state_page import PAGE_BYTES, Entry, StatePage, new_page_fd

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
