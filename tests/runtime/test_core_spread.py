"""runtime.core_spread: an activation's worker pinned off the caller's core, its pool on it,
and every thread of both put back; real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from runtime.core_spread import Spread, current_cpu, own_cores, spread, unpin

MASK = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
needs_two_cores = pytest.mark.skipif(len(MASK) < 2, reason="needs 2 cores the test may run on")
# A child that starts one more thread (which inherits its main thread's mask) on a line of stdin.
CHILD = (
    "import sys, threading, time\n"
    "sys.stdin.readline()\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('started', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], **pipes) for _ in range(3)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # (waits, and closes its pipes)


def masks(pid: int) -> list[set[int]]:
    """The mask of every thread of ``pid``."""
    return [os.sched_getaffinity(int(tid)) for tid in sorted(os.listdir(f"/proc/{pid}/task"))]


def start_thread(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline() == "started\n"


def test_current_cpu_is_a_core_this_thread_may_run_on() -> None:
    cpu = current_cpu()
    assert cpu is not None and cpu in MASK


@needs_two_cores
def test_spread_pins_the_worker_off_the_callers_core_and_the_pool_on_it(
    children: list[subprocess.Popen[str]],
) -> None:
    worker, pool, _ = children
    pins = spread(worker.pid, pool.pid)
    worker_mask, pool_mask = os.sched_getaffinity(worker.pid), os.sched_getaffinity(pool.pid)
    # (The caller may have moved since: the two masks split the caller's cores at one core.)
    assert len(pool_mask) == 1 and pool_mask.isdisjoint(worker_mask)
    assert worker_mask | pool_mask == MASK
    # A thread started while pinned inherits the pin; the restore undoes it too.
    start_thread(worker)
    start_thread(pool)
    assert masks(worker.pid) == [worker_mask, worker_mask] and masks(pool.pid) == [pool_mask, pool_mask]
    pins.restore()
    assert masks(worker.pid) == [MASK, MASK] and masks(pool.pid) == [MASK, MASK]
    pins.restore()  # a second call changes nothing
    assert masks(worker.pid) == [MASK, MASK]


@needs_two_cores
def test_a_worker_that_exited_is_not_touched_by_the_restore(children: list[subprocess.Popen[str]]) -> None:
    worker, pool, _ = children
    pins = spread(worker.pid, pool.pid)
    pinned = os.sched_getaffinity(worker.pid)
    pins.restore(worker_gone=True)  # (its pid could be another process's by now)
    assert os.sched_getaffinity(worker.pid) == pinned != MASK
    assert os.sched_getaffinity(pool.pid) == MASK


@needs_two_cores
def test_overlapping_spreads_leave_the_shared_pool_unpinned_in_either_order(
    children: list[subprocess.Popen[str]],
) -> None:
    first_worker, pool, second_worker = children
    for order in ("first ends first", "second ends first"):
        first = spread(first_worker.pid, pool.pid)
        second = spread(second_worker.pid, pool.pid)  # the pool is pinned already: left as it is
        assert len(os.sched_getaffinity(pool.pid)) == 1
        for pins in (first, second) if order == "first ends first" else (second, first):
            pins.restore()
        for p in children:
            assert os.sched_getaffinity(p.pid) == MASK, order


@needs_two_cores
def test_nothing_is_pinned_for_a_worker_already_gone(children: list[subprocess.Popen[str]]) -> None:
    gone, pool, _ = children
    gone.kill()
    gone.wait()
    pins = spread(gone.pid, pool.pid)  # no error: its activation fails anyway
    assert os.sched_getaffinity(pool.pid) == MASK
    pins.restore()
    Spread().restore()  # nothing pinned: nothing to do


@needs_two_cores
def test_a_pinned_thread_unpins_itself_to_the_cores_it_started_with() -> None:
    seen: list[set[int]] = []

    def thread() -> None:  # (its own thread: the test's mask stays as it is)
        cores = own_cores()
        assert cores == MASK
        os.sched_setaffinity(0, {min(MASK)})  # as spread() pins a standby's main thread
        unpin(cores)
        seen.append(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {min(MASK)})
        unpin(None)  # nothing known: left as it is
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen == [MASK, {min(MASK)}]
