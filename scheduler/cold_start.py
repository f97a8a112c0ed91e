"""The cold-start path: place a new instance, launch it, record it ready or forget it.

:meth:`ColdStarter.place` picks a device with Tangram Alg. 2 / Eq. 3 over the devices' live
residency (a device that has not reported yet counts as empty, of unknown size).
:meth:`ColdStarter.start` launches an instance whose record the router created (state
``starting``) and marks it ``ready`` with what the launch measured. A failed launch forgets the
record and is remembered per function (:meth:`~ColdStarter.failure`): the requests waiting for
it fail with its reason, and minScale waits ``start_backoff_s`` before trying again. A launch
the device had no room for (:data:`scheduler.launcher.NO_ROOM`: the placement read a report
older than other starts' pins) is not the function's failure: the waiting requests place again
on a fresh report, at once the first time. Nor is a launch whose worker served the instance's
first requests and then died before the activation's reply
(:data:`scheduler.launcher.INSTANCE_LOST`): the waiting requests start another instance, until
:data:`LOST_BEFORE_FAILURE` in a row, which count as a failed start. The pool can refuse again
while the report says there is room (free space cut into pieces by pinned tensors and KV
blocks, which never move): each refusal in a row doubles the pause before the next try
(:meth:`~ColdStarter.room_pause_s`, up to ``start_backoff_s``), since every try costs a
pre-warmed worker process. An instance deleted while it started is stopped; one that cannot be
recorded ready (Redis away too long) is stopped too, so no worker runs that nobody can route
to. While a launch runs, the process it activates the instance in (``on_target`` of
:meth:`~scheduler.launcher.BaseLauncher.launch`) is an :class:`EarlyTarget` of the function
(:meth:`~ColdStarter.targets`), until the launch ends either way.

A started instance pins its model, which the device's report shows only once it is published
again. That report is not published on the start's path (reading the pool's stats took
1-12 ms on a 2-core host, on the pool's loop and cores the new instance's first request
needs): the device is marked unreported (:meth:`~ColdStarter.report`), and the next placement
on this gateway publishes its reports first if one of its devices is still marked (so a cold
start of another function within the report interval, ~1 s, pays that report instead).
Reports run one at a time, and a start that ends while one runs keeps its mark: that report
may have read the pool before the start's pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from scheduler.errors import SchedulerError, StartFailed, StateConflict
from scheduler.launcher import INSTANCE_LOST, NO_ROOM, BaseLauncher, StartedInstance
from scheduler.policies import DeviceState, ModelDemand, place
from scheduler.records import DeviceReport, FunctionRecord, RecordError
from scheduler.state import ClusterState, on_loop

log = logging.getLogger("ember.scheduler")

DEFAULT_DISK_BANDWIDTH = 2e9  # bytes/s assumed for a device whose pool measured no load yet
NO_ROOM_PAUSE_S = 0.25  # the pause after a second refusal for room in a row (doubling after)
# Starts in a row whose instance died while it served its first requests (INSTANCE_LOST) before
# one counts as the function's failure (a model that crashes every worker on its first step
# would otherwise start one more worker per request, with no backoff).
LOST_BEFORE_FAILURE = 3


class EarlyTarget(NamedTuple):
    """The process an instance is being activated in: requests may go there before it is ready
    (the worker holds them until its activation ends; see BaseLauncher.launch)."""

    instance_id: str
    url: str
    token: str


class Claimed(NamedTuple):
    """Where the request that holds a new instance's first slot goes (:meth:`ColdStarter.start`'s
    ``claim``): the process it is being activated in (``early``), or the instance, ready."""

    target: EarlyTarget
    early: bool


# Resolved once a start's claimed slot can take its request; None: the start failed (its record
# and the slot counted on it are gone).
Claim = asyncio.Future[Claimed | None]


class ColdStarter:
    """Starts this gateway's new instances (see the module docstring)."""

    def __init__(
        self,
        state: ClusterState,
        launcher: BaseLauncher,
        start_backoff_s: float,
        notify: Callable[[str], None],
        on_start: Callable[[str, StartedInstance], None] | None = None,
        instances_per_device: int = 0,
    ) -> None:
        """``notify(name)`` wakes the requests waiting for an instance of ``name``; ``on_start``
        sees every instance that became ready (metrics); ``instances_per_device``: at most that
        many instances on a device at once (0: no limit but its memory)."""
        self.instances_per_device = instances_per_device
        self.state = state
        self.launcher = launcher
        self.start_backoff_s = start_backoff_s
        self._notify = notify
        self.on_start = on_start
        self._failures: dict[str, tuple[float, str]] = {}  # name -> (epoch s, why) of its last failed start
        self._launching: set[str] = set()  # instance ids whose start this gateway is running
        self._no_room: dict[str, tuple[float, int]] = {}  # name -> (monotonic s, refusals in a row)
        self._lost_in_a_row: dict[str, int] = {}  # name -> starts in a row whose instance died serving
        self._targets: dict[str, dict[str, EarlyTarget]] = {}  # name -> instance id -> its process
        # device -> serial of its latest start since a report of it last began (see report())
        self._unreported: dict[str, int] = {}
        self._num_marked = 0  # starts marked so far: the serials
        # One report at a time: an older report's stats must not land in Redis after a newer one's.
        self._reporting = asyncio.Lock()
        # The reports this gateway's launcher published last, by device id: their only publisher
        # (see _reports). Empty while one is published, and after one failed.
        self._published: dict[str, DeviceReport] = {}

    def failure(self, name: str) -> tuple[float, str] | None:
        """When (epoch seconds) and why the last start of ``name`` failed (None once one succeeds)."""
        return self._failures.get(name)

    def backing_off(self, name: str) -> bool:
        """Whether ``name``'s last start failed less than ``start_backoff_s`` ago."""
        failed = self._failures.get(name)
        return failed is not None and time.time() - failed[0] < self.start_backoff_s

    def room_pause_s(self, name: str) -> float:
        """Seconds before the next start of ``name`` may try after its pool refused it for room
        (see the module docstring); 0.0 when it may try now."""
        refused = self._no_room.get(name)
        if refused is None or refused[1] < 2:
            return 0.0
        pause = min(self.start_backoff_s, NO_ROOM_PAUSE_S * 2.0 ** (refused[1] - 2))
        return max(0.0, refused[0] + pause - time.monotonic())

    def targets(self, name: str) -> list[EarlyTarget]:
        """The instances of ``name`` this gateway is activating that take requests already
        (:meth:`scheduler.router.Router.route` claims their slots with
        :meth:`ClusterState.claim_starting`)."""
        return list(self._targets.get(name, {}).values())

    def withdraw(self, name: str, instance_id: str, url: str | None = None) -> None:
        """``instance_id`` takes no more requests early (its activation ended, or it is full);
        with ``url``, only if that is still its process (not one the launch tried since)."""
        targets = self._targets.get(name, {})
        target = targets.get(instance_id)
        if target is None or (url is not None and target.url != url):
            return
        del targets[instance_id]
        if not targets:
            del self._targets[name]

    async def report(self) -> None:
        """Publish the devices' reports (:meth:`BaseLauncher.report`). A device is reported
        from then on unless a start ended there while it ran: that start's pins may postdate
        the stats it read, so its mark stays (a serial per mark tells the two apart)."""
        async with self._reporting:
            reporting = dict(self._unreported)
            self._published = {}
            published: dict[str, DeviceReport] = {}
            for device, report in (await self.launcher.report()).items():
                with contextlib.suppress(RecordError):  # (Redis's copy is skipped as malformed)
                    published[device] = DeviceReport.decode(device, DeviceReport.encode(report))
            self._published = published
            for device, serial in reporting.items():
                if self._unreported.get(device) == serial:
                    del self._unreported[device]

    async def _reports(self) -> dict[str, DeviceReport]:
        """The devices' reports, published again first when a start on one of them ended
        since its last report (the placement must see that instance's pins). This gateway's
        launcher is their only publisher (a node agent reports its own devices, and only
        through :meth:`report`), so the ones it published last are what Redis holds: read
        there only for a device missing from them (its pool was down, or publishing failed).
        (Two nodes of one name on one Redis would overwrite each other's reports either way.)
        Reading them from Redis was ~0.25 ms of a cold start's path (a round trip and a JSON
        decode)."""
        if self._unreported:
            try:
                await self.report()
            except SchedulerError as exc:  # Redis away: the last reports (a refusal places again)
                log.warning("placing on the last device reports: publishing them failed: %s", exc)
        devices = self.launcher.devices()  # the only ones placed on: no SCAN of every node's
        published = self._published
        if all(d in published for d in devices):
            return {d: published[d] for d in devices}
        return await on_loop(lambda retry: self.state.device_reports(retry, devices))

    def launching(self, instance_id: str) -> bool:
        """Whether this gateway is starting ``instance_id`` now."""
        return instance_id in self._launching

    async def place(
        self,
        record: FunctionRecord,
        unpinned: Mapping[str, set[str]] | None = None,
        vacating: Mapping[str, int] | None = None,
    ) -> tuple[str | None, float]:
        """The device to start an instance of ``record`` on (None: none can hold its model now)
        and the start time Eq. 3 expects there. ``unpinned`` (device -> model ids): place as if
        the instances pinning those models there were stopped: their resident bytes evictable,
        and the device's KV blocks free (an upper bound: the report does not say which
        sessions hold them). ``vacating`` (device -> instances): as many instances stopped
        there, for the limit of instances per device."""
        model = record.model
        if model is None:
            raise StartFailed("the function's model is not registered yet; deploy it again")
        reports = await self._reports()
        limit = self.instances_per_device
        live = await asyncio.to_thread(self.live_per_device) if limit else {}
        devices = []
        for device_id in self.launcher.devices():
            if limit and live.get(device_id, 0) - (vacating or {}).get(device_id, 0) >= limit:
                continue  # as many instances as it may run: none starts there now
            r = reports.get(device_id)
            if r is None:  # not reported yet: assume an empty device of unknown size
                devices.append(DeviceState(device_id, free_bytes=model.weight_bytes, evictable_bytes=0))
                continue
            models = (unpinned or {}).get(device_id)
            freed = 0 if models is None else r.kv_bytes + sum(r.resident_bytes.get(m, 0) for m in models)
            devices.append(
                DeviceState(
                    device_id,
                    free_bytes=r.free_bytes,
                    evictable_bytes=r.evictable_bytes + freed,
                    resident_bytes=dict(r.resident_bytes),
                    disk_bandwidth=r.load_bandwidth if r.load_bandwidth > 0 else DEFAULT_DISK_BANDWIDTH,
                )
            )
        placement = place([ModelDemand(model.model_id, model.weight_bytes)], devices)[0]
        return placement.device_id, placement.expected_start_s

    def live_per_device(self) -> dict[str, int]:
        """Starting, ready and draining instances of every function, per device (from Redis:
        the device reports are up to a second old and do not know the instances being
        started; a draining one still runs there)."""
        counts: dict[str, int] = {}
        for name in self.state.functions_with_instances():
            for inst in self.state.instances(name):
                if inst.state in ("starting", "ready", "draining"):
                    counts[inst.device] = counts.get(inst.device, 0) + 1
        return counts

    async def could_ever_fit(self, record: FunctionRecord) -> bool:
        """Whether some device's pool is large enough for the model at all, every byte of it
        free (a device that has not reported yet, or not its capacity, counts as large enough)."""
        model = record.model
        if model is None:
            return False
        reports = await on_loop(self.state.device_reports)
        return any(
            (r := reports.get(device_id)) is None
            or not r.capacity_bytes
            or r.capacity_bytes >= model.weight_bytes
            for device_id in self.launcher.devices()
        )

    async def start(
        self,
        instance_id: str,
        name: str,
        record: FunctionRecord,
        device: str,
        deadline: float,
        claim: Claim | None = None,
    ) -> None:
        """Launch ``instance_id`` of ``name`` on ``device`` and record the outcome (never raises
        for a failed start: it is remembered and the waiting requests are told). ``claim``: the
        request whose slot its record counted from the start is told where to go as soon as
        the process is named (no Redis round trip on that request's path)."""
        self._launching.add(instance_id)
        try:
            keep_alive = record.scaling.keep_alive_s
            t0 = time.perf_counter()

            def on_target(url: str, token: str) -> None:  # see BaseLauncher.launch
                target = EarlyTarget(instance_id, url, token)
                self._targets.setdefault(name, {})[instance_id] = target
                if claim is not None and not claim.done():
                    claim.set_result(Claimed(target, early=True))
                self._notify(name)

            try:
                if record.model is None:  # place() checked it before the instance was created
                    raise StartFailed("the function's model is not registered yet; deploy it again")
                # The launcher (runtime/) takes plain documents: it does not import the scheduler.
                try:
                    started = await self.launcher.launch(
                        instance_id, record.spec, record.model.encode(), device, deadline, on_target
                    )
                finally:  # activated or failed: requests route to it through Redis now, or not at all
                    self.withdraw(name, instance_id)
            except Exception as exc:  # any failure: forget the instance, tell the waiting requests why
                code = getattr(exc, "code", None)
                no_room = code == NO_ROOM
                lost = self._lost_in_a_row.pop(name, 0) + 1 if code == INSTANCE_LOST else 0
                if lost:
                    self._lost_in_a_row[name] = lost
                if 0 < lost < LOST_BEFORE_FAILURE:  # it served, then died: the waiting requests start another
                    log.warning(
                        "instance %s of %s died before it was recorded ready: %s", instance_id, name, exc
                    )
                elif lost:  # each of its last starts died serving: a failure (backs off)
                    log.warning("instance %s of %s died before it was recorded ready, %d in a row: %s",
                                instance_id, name, lost, exc)  # fmt: skip
                    self._failures[name] = (time.time(), f"{lost} instances in a row died serving: {exc}")
                elif no_room:  # the device's state, not the function's fault; but see room_pause_s
                    log.warning("instance %s of %s failed to start: %s", instance_id, name, exc)
                    self._no_room[name] = (time.monotonic(), self._no_room.get(name, (0.0, 0))[1] + 1)
                else:
                    log.warning("instance %s of %s failed to start: %s", instance_id, name, exc)
                    self._failures[name] = (time.time(), str(exc))
                await asyncio.to_thread(self.state.forget_from, name, instance_id, "starting")
                if no_room:  # the placement read an old report: the waiting requests place again
                    await self.report()
                self._notify(name)
                return
            # Less the time its reply waited for the first outputs of the requests held for it
            # (runtime.early_requests.Handover): it was serving them meanwhile.
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            waited_ms = min(max(float(started.timings_ms.get("handover_wait_ms", 0.0)), 0.0), elapsed_ms)
            start_ms = elapsed_ms - waited_ms
            try:
                fields: dict[str, str | int | float] = {
                    "url": started.url, "token": started.token, "deadline": time.time() + keep_alive,
                    "pid": started.pid, "bytes_loaded": started.bytes_loaded,
                    "bytes_reused": started.bytes_reused, "start_ms": round(start_ms, 3),
                    "log": started.log_path,
                }  # fmt: skip
                await on_loop(
                    lambda retry: self.state.transition_with(instance_id, "starting", "ready", fields, retry)
                )
            except StateConflict:  # deleted while starting
                await self.launcher.stop(instance_id)
                return
            except Exception as exc:  # Redis away too long: do not leave a worker nobody can route to
                log.warning("instance %s of %s could not be marked ready: %s", instance_id, name, exc)
                await self.launcher.stop(instance_id)
                self._failures[name] = (time.time(), f"could not record the instance as ready: {exc}")
                with contextlib.suppress(SchedulerError):
                    await asyncio.to_thread(self.state.forget_from, name, instance_id, "starting")
                self._notify(name)
                return
            self._failures.pop(name, None)
            self._no_room.pop(name, None)
            self._lost_in_a_row.pop(name, None)
            if claim is not None and not claim.done():  # (a launcher that names no process early)
                claim.set_result(Claimed(EarlyTarget(instance_id, started.url, started.token), early=False))
            # The next placement must see this instance's pins: it publishes the report first (see
            # the module docstring), off this start's first request.
            self._num_marked += 1
            self._unreported[device] = self._num_marked
            if self.on_start is not None:
                self.on_start(name, started)
            self._notify(name)
        finally:
            self._launching.discard(instance_id)
            if claim is not None and not claim.done():
                claim.set_result(None)
