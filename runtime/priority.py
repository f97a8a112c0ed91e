"""CPU scheduling class of a worker process (standard library only: imported before torch)."""

from __future__ import annotations


def set_idle_priority(idle: bool) -> None:
    """Put every thread of this process in ``SCHED_IDLE`` (pre-warming) or back in ``SCHED_OTHER``.

    A pre-warmed worker imports torch and warms its kernels while instances serve on the
    same cores; as ``SCHED_IDLE`` it only runs when they leave a core free. Once assigned
    it competes normally. Linux lets an unprivileged process switch both ways.
    """
    import contextlib
    import os

    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    for tid in os.listdir("/proc/self/task"):
        # ProcessLookupError: the thread just ended; PermissionError: a locked-down kernel.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
