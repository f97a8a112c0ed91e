"""The extender's view of every pool's residency: device reports read from Redis, briefly cached.

kube-scheduler calls filter then prioritize for every pod it places, and a burst of pods
calls them back to back: reading every device's report from Redis each time would cost a
round trip per call for nothing, since pools report every few seconds. :class:`ResidencyCache`
keeps the last read for ``ttl_s`` (default 1 s) and lets one caller refresh it while the
others wait for that read (a burst does not multiply the reads). The read itself runs in a
thread: the Redis client is synchronous and the service's event loop must keep answering.

Reports are the node reporter's :class:`scheduler.records.DeviceReport` documents; besides the
parsed placement inputs this reads ``updated`` (when it was published, wall clock) and the
optional ``queue_seconds`` (the pool's expected wait before a new load can start) and
``bytes_loaded`` (how much the pool's ``load_bandwidth`` was measured over).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.extender.policies import PoolView, Residency
from scheduler.records import DeviceReport, RecordError


def pool_view(report: DeviceReport) -> PoolView:
    """The placement inputs of ``report``; ValueError when they make no sense."""
    document = report.document
    return PoolView(
        report.device_id,
        report.free_bytes,
        report.evictable_bytes,
        report.resident_bytes,
        report.load_bandwidth,
        _number(document.get("queue_seconds", 0.0), "queue_seconds"),
        _number(document.get("updated"), "updated"),
        _count(document.get("bytes_loaded", 0), "bytes_loaded"),
    )


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number")
    return float(value)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer")
    return value


def residency_of(reports: Mapping[str, DeviceReport | RecordError]) -> Residency:
    """Every report as a :class:`PoolView`; the malformed ones (already when decoded, a
    :class:`RecordError`, or in their placement inputs) set aside with the reason."""
    pools: dict[str, PoolView] = {}
    malformed: dict[str, str] = {}
    for device_id, report in reports.items():
        if isinstance(report, RecordError):
            malformed[device_id] = str(report)[:200]
            continue
        try:
            pools[device_id] = pool_view(report)
        except ValueError as exc:
            malformed[device_id] = str(exc)
    return Residency(pools, malformed)


_MIN_FAILED_S = 0.5  # how long a failed read answers for the calls after it, at least


class ResidencyCache:
    """:func:`residency_of` over ``read()`` (e.g. ``ClusterState.device_reports_or_errors``), cached."""

    def __init__(
        self,
        read: Callable[[], Mapping[str, DeviceReport | RecordError]],
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= ttl_s <= 60:
            raise ValueError("the residency cache's ttl_s must be in [0, 60] seconds")
        self._read = read
        self.ttl_s = ttl_s
        self._clock = clock
        self._cached: tuple[float, Residency] | None = None  # (read at, residency)
        self._failed: tuple[float, Exception] | None = None  # (read at, why): the last read failed
        self._lock = asyncio.Lock()
        self.reads = 0  # reads from the source (tests and the bench check the cache with it)

    def _fresh(self) -> Residency | None:
        if self._cached is not None and self._clock() - self._cached[0] < self.ttl_s:
            return self._cached[1]
        return None

    def _failing(self) -> Exception | None:
        if self._failed is not None and self._clock() - self._failed[0] < max(self.ttl_s, _MIN_FAILED_S):
            return self._failed[1]
        return None

    async def get(self) -> Residency:
        """The residency, read again when the cached read is ``ttl_s`` old. A failed read
        fails the calls of the next ``ttl_s`` (at least 0.5 s) alike, without reading again:
        while Redis is away, calls queued behind the lock would otherwise each wait for a
        read of their own, one after another, long after kube-scheduler stopped waiting."""
        cached = self._fresh()
        if cached is not None:
            return cached
        async with self._lock:  # one refresh at a time; the others get its result
            cached = self._fresh()
            if cached is not None:
                return cached
            failing = self._failing()
            if failing is not None:
                raise failing
            started = self._clock()
            try:
                reports = await asyncio.to_thread(self._read)
            except Exception as exc:
                self._failed = (started, exc)
                raise
            self.reads += 1
            self._failed = None
            residency = residency_of(reports)
            self._cached = (started, residency)  # its age counts from before the read
            return residency
