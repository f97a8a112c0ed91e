"""A standby's activation spread over the cores: its worker off the agent's core, its pool daemon on it.

On the 2-core KVM hosts Ember is measured on, a woken process is placed on its waker's core
even while the other core idles, and waits there until its waker sleeps (``perf`` sched
events on resident cold starts: the second core stayed idle while the woken process waited).
An activation is a chain of such wake-ups. The agent (in the gateway's process in embedded
mode) writes the assign and goes on forwarding the request held for it, ~0.4 ms, before the
standby ran; the standby then sent its acquire to the pool daemon and went on reading and
tokenizing that request, ~1 ms, while the daemon's acquire waited on the same core.

:func:`spread` pins the standby's main thread (the one the assign and the held request wake)
to the cores other than the agent's, and the pool daemon's main thread to the agent's core,
which the agent leaves for the event loop's next wait soon after the assign. The standby then
runs at once on an idle core, and the daemon's acquire runs beside its request's parsing
instead of after it. The pins last as long as that acquire needs: the agent undoes them
:data:`SPREAD_S` after the assign went out (:meth:`Spread.restore`), or when the assign ended
if sooner, and the standby lets its main thread run on every core of its own again as its assign
begins (:func:`unpin`), before the engine may start its intra-op team. A thread started while
its process was pinned inherits the pinned mask (an executor's thread), so the agent's undo
covers every thread of the process still on that mask, not only the main one. Measured
(``bench.coldstart``, 16 resident cold starts traced per run): the first prefill step started
4.6 ms after the gateway had the request, against 5.0-5.5 ms in three runs without.

Linux only (``sched_getcpu``, ``sched_setaffinity``, ``/proc/<pid>/task``); elsewhere, or where
the calling thread's core cannot be told, a no-op. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from typing import NamedTuple

from runtime.process import thread_ids


@functools.cache
def _getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (loaded once), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.argtypes = []
    fn.restype = ctypes.c_int
    return fn


def current_cpu() -> int | None:
    """The core the calling thread runs on now; None where it cannot be told."""
    getcpu = _getcpu()
    if getcpu is None:
        return None
    cpu = getcpu()
    return cpu if cpu >= 0 else None


# How long an activation's pins last at most (s): the standby's acquire starts ~0.5 ms after
# the assign went out and takes ~0.5-1 ms; this leaves room for a slow host, while the pool
# daemon, which serves every instance of the node, stays on one core for little longer.
SPREAD_S = 0.02


def own_cores() -> frozenset[int] | None:
    """The cores the calling thread may run on now (a worker's, taken when it starts: the agent
    pins it only while it activates); None where that cannot be told."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return None


def _widen(pid: int, pinned: set[int], cores: set[int] | frozenset[int]) -> None:
    """Move every thread of ``pid`` whose mask is ``pinned`` to ``cores`` (a thread gone, or
    one this process may not move, is left as it is)."""
    for tid in thread_ids(pid) or [pid]:  # (none listed: gone, or no /proc: the main thread)
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(tid) == pinned:
                os.sched_setaffinity(tid, cores)


def unpin(cores: frozenset[int] | None) -> None:
    """Let the calling thread (a standby's main thread, as its assign begins) run on ``cores``
    again, before it starts any thread: one call on the start's path. Threads of its process
    started while it was pinned are the agent's to undo (:meth:`Spread.restore`). Refused (a
    sandbox, a core gone offline): left as it is."""
    if cores and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


class _Pin(NamedTuple):
    pid: int
    pinned: set[int]  # the mask it got
    restore_to: set[int]
    of_worker: bool


class Spread:
    """The pins of one activation (see :func:`spread`), until :meth:`restore`."""

    def __init__(self) -> None:
        self._pinned: list[_Pin] = []

    def pin(self, pid: int, cores: set[int], restore_to: set[int] | None, worker: bool) -> None:
        """Pin ``pid``'s main thread to ``cores`` (within the ones it may use now)."""
        try:
            before = os.sched_getaffinity(pid)
            target = before & cores
            if not target or target == before:
                return
            os.sched_setaffinity(pid, target)
        except OSError:  # gone, or not permitted
            return
        self._pinned.append(_Pin(pid, target, before if restore_to is None else restore_to, worker))

    def restore(self, worker_gone: bool = False) -> None:
        """Undo the pins, once (later calls do nothing); ``worker_gone``: the worker exited
        (its pid may be another process's by now: left alone)."""
        pinned, self._pinned = self._pinned, []
        for pin in pinned:
            if not (pin.of_worker and worker_gone):
                _widen(pin.pid, pin.pinned, pin.restore_to)


def spread(worker_pid: int, pool_pid: int | None) -> Spread:
    """Pin ``worker_pid``'s main thread to the cores other than the calling thread's, and
    ``pool_pid``'s to the calling thread's core (each within the cores it may use). The
    worker's mask is restored as it was, the pool's to the caller's (the agent spawned it:
    another activation's spread may hold it pinned meanwhile, and then this one leaves it)."""
    pins = Spread()
    cpu = current_cpu()
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return pins
    try:
        mine = os.sched_getaffinity(0)
        worker_cores = os.sched_getaffinity(worker_pid) - {cpu}
    except OSError:
        return pins
    pins.pin(worker_pid, worker_cores, None, worker=True)
    if pool_pid is not None:
        pins.pin(pool_pid, {cpu}, mine, worker=False)
    return pins
