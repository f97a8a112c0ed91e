"""Process attributes of workers and daemons: CPU scheduling class, parent-death signal,
garbage collection paused on a critical path.

Standard library only: a worker imports this before torch."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def collection_paused(pause: bool = True) -> Iterator[None]:
    """No cyclic garbage collection inside (this process's, whatever runs meanwhile): a start's
    critical path allocates past the young generation's threshold, and its collection took
    ~0.1 ms there on a 2-core host, an older generation's far more. What it skipped is
    collected at the next threshold after. A no-op unless ``pause``, or where collection is
    off already."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def thread_ids(pid: int | None = None) -> list[int]:
    """The ids of process ``pid``'s threads (None: this process's), from ``/proc``; none when
    it is gone (or there is no ``/proc``)."""
    import os

    try:
        return [int(tid) for tid in os.listdir(f"/proc/{'self' if pid is None else pid}/task")]
    except OSError:
        return []


def set_idle_priority(idle: bool) -> None:
    """Put every thread of this process in ``SCHED_IDLE`` (pre-warming) or back in ``SCHED_OTHER``.

    A pre-warmed worker imports torch and warms its kernels while instances serve on the
    same cores; as ``SCHED_IDLE`` it only runs when they leave a core free. Once assigned
    it competes normally. Entering ``SCHED_IDLE`` needs no privilege; leaving it needs
    ``CAP_SYS_NICE`` (or ``RLIMIT_NICE`` >= 20), which a worker has dropped, so the agent
    also moves it back (:func:`boost`) and a refusal here is ignored. It does so before it
    assigns, every thread at once: a calling thread already out of ``SCHED_IDLE`` means that
    happened, and the refused calls (~0.08 ms on a start's path) are skipped.
    """
    import os

    if not idle and os.sched_getscheduler(0) != os.SCHED_IDLE:
        return
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    for tid in thread_ids():
        # ProcessLookupError: the thread just ended; PermissionError: a locked-down kernel.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(tid, policy, os.sched_param(0))


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for children of ``ember serve``: SIGTERM them when the parent dies.

    Without it a SIGKILLed ``ember serve`` would leave its pool, workers and Redis running.
    ``prctl`` is looked up here, in the parent, so the child only makes one libc call between
    fork and exec (safe in a threaded parent). Linux only; elsewhere a no-op. Spawn from a
    long-lived thread: the signal fires when the spawning *thread* exits.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


def boost(pid: int) -> None:
    """Move every thread of process ``pid`` (a pre-warming worker) to ``SCHED_OTHER``.

    Used when a request waits for a pre-warmed worker that is still starting (at
    ``SCHED_IDLE`` on a busy machine it could starve), when a worker is assigned, and when a
    standby is ready (:mod:`runtime.standby_pool`: its activation then skips it). Leaving
    ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` (or ``RLIMIT_NICE`` >= 20): the agent of a root
    ``ember serve`` has it, its workers have not; refused, the worker stays idle-class.
    """
    import os

    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def exit_with_parent(parent_pid: int) -> None:
    """In a child: get SIGTERM when ``parent_pid`` dies (or exit now if it already has).

    What :func:`die_with_parent` does, but set by the child itself after it started: the
    parent then spawns with ``posix_spawn`` instead of forking its whole address space to run
    a ``preexec_fn`` (~20 ms for a 500 MB gateway, on every instance start).
    """
    import ctypes
    import os
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        sys.exit(0)
