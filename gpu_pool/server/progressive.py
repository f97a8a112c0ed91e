"""Progressive acquire (TIDAL §5.2): the daemon side of loading overlapped with compute.

The daemon places and pins a manifest's tensors as for any acquire, replies at once with the
placements and the read end of a pipe, then copies the missing bytes group by group in the
manifest's order (the model's traced access order, :mod:`runtime.access_order`), writing one
:data:`READY` byte per finished group. Everything already resident counts as ready: a group
with nothing to copy gets its byte at once. A failed or cancelled load writes
:data:`FAILED` (or just closes the pipe) and is aborted like any failed acquire: its tensors
are dropped (not resident), its pins released.

The last group's byte is written by the daemon only after the acquire is committed
(:meth:`~gpu_pool.server.reuse_store.ReuseStore.complete_acquire`), so a client that has seen
every byte sees the store as a plain acquire would have left it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence

from gpu_pool.arena.base import CopyJob
from gpu_pool.errors import InvalidArgument, LoadError
from gpu_pool.readiness import FAILED, MAX_READY_GROUPS, READY
from gpu_pool.server.reuse_store import PendingAcquire, ReuseStore

__all__ = ["FAILED", "READY", "LoadCancelled", "copy_groups", "group_ends", "plan_groups", "signal"]


class LoadCancelled(LoadError):
    """The session of a progressive acquire went away (or released) before its load ended."""


def group_ends(count: int, requested: Sequence[int]) -> tuple[int, ...]:
    """The groups' ends for a manifest of ``count`` tensors: ``requested`` once checked, or one
    group per tensor (bounded by :data:`MAX_READY_GROUPS`)."""
    if requested:
        if requested[-1] != count:
            raise InvalidArgument(
                f"acquire: the last group must end at the manifest's {count} tensors, not {requested[-1]}",
                "groups",
            )
        return tuple(requested)
    step = -(-count // MAX_READY_GROUPS)
    return (*tuple(range(step, count, step)), count)


def plan_groups(pending: PendingAcquire, ends: Sequence[int]) -> list[list[CopyJob]]:
    """``pending``'s copy jobs split by group: a tensor's job goes to the first group that
    names it (a key shared by two names loads once)."""
    job_of = dict(zip(pending.missing, pending.jobs, strict=True))
    tensors = pending.manifest.tensors
    groups: list[list[CopyJob]] = []
    start = 0
    for end in ends:
        jobs: list[CopyJob] = []
        for entry in tensors[start:end]:
            job = job_of.pop(pending.keys[entry.name], None)
            if job is not None:
                jobs.append(job)
        groups.append(jobs)
        start = end
    return groups


def copy_groups(
    store: ReuseStore,
    pending: PendingAcquire,
    groups: list[list[CopyJob]],
    ready_fd: int,
    cancel: threading.Event,
) -> float:
    """Copy the groups in order (in a worker thread), signalling every group but the last;
    returns the seconds spent copying. Raises :class:`LoadCancelled` when ``cancel`` is set."""
    seconds = 0.0
    for i, jobs in enumerate(groups):
        if cancel.is_set():
            raise LoadCancelled(f"loading {pending.manifest.model_id}: the session went away")
        t0 = time.perf_counter()
        store.load_jobs(pending, jobs)
        seconds += time.perf_counter() - t0
        if i < len(groups) - 1:
            signal(ready_fd, READY)
    return seconds


def signal(fd: int, byte: bytes) -> None:
    """Write one readiness byte. A client that closed its end no longer reads readiness, but
    its session may still use the tensors: the load goes on, so a write error is ignored."""
    with contextlib.suppress(OSError):
        os.write(fd, byte)
