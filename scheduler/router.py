"""Routing, scale-up, keep-alive expiry and instance health: the scheduler's control loop.

:meth:`Router.route` gives a request a ready instance with spare concurrency. When there is
none it scales up by concurrency (``ceil((in-flight + waiting) / concurrency)`` within
minScale..maxScale), placing the new instance with Tangram Alg. 2 / Eq. 3 over the devices'
live residency, and waits for an instance to free up or become ready. When the model fits on
no device beside what other functions' instances pin, idle ones of those are stopped, longest
idle first (:meth:`Router._reclaim`: their weights stay resident, only what the new model
needs is evicted); busy ones are waited for. A request that cannot start before its deadline
is rejected early (TIDAL), as is a model larger than every pool: :class:`Rejected` becomes
HTTP 503 with ``Retry-After``. :meth:`Router.reconcile` runs every tick: instances idle past their
keep-alive drain and stop (their tensors stay resident), dead workers are forgotten,
minScale is kept, and the devices' pool stats are re-reported. Every state change goes
through :class:`ClusterState`'s atomic scripts, so several gateways never double-start or
double-stop.

Slot leases (:mod:`scheduler.leases`): when a request finishes, its slot stays held in
Redis for ``lease_s`` (0.25 s) and the next request of the same function on this gateway
takes it without a Redis round trip (two fewer per request in a burst: most of the
gateway's 2 ms budget). A lease is freed when it times out (then the keep-alive clock
starts, so keep-alive is at most ``lease_s`` longer), at once when its request failed, and
when its instance dies, its function is redeployed or deleted, or the gateway stops. While
held it counts as in flight for other gateways, which therefore route around it or scale up
as if it were busy.

Starting an instance (placement, launch, recording it ready, remembering a failed start) is
:mod:`scheduler.cold_start`. Once the launcher has named the process an instance is being
activated in, a waiting request takes one of its slots while it is still ``starting``
(:meth:`ClusterState.claim_starting`; counted in Redis, so it carries over to ``ready``) and is
sent there at once: an *early* route, which the worker holds until the activation ends
(:mod:`runtime.early_requests`). Recording the instance ready and waking the waiters are then
off the request's path. The request that starts an instance from zero holds its first slot
from the record's creation (:meth:`ClusterState.scale_up` with ``claim``) and goes to the
process as soon as it is named, with no Redis call; a slot it gives up goes to the next
request of the function (or is freed). A lost instance (a request's connection to it broke, or reconcile
found its process dead) goes through one place, :meth:`Router.instance_lost`. Reconcile's
steps are named methods: :meth:`~Router.release_pending`, :meth:`~Router.expire_idle`,
:meth:`~Router.forget_dead`, :meth:`~Router.keep_min_scale`, :meth:`~Router.report_devices`.
Function records arrive typed (:class:`scheduler.records.FunctionRecord`): keep-alive and
scaling are parsed once. Reconcile reads every record each tick anyway; :meth:`Router.on_records`
hands them on (the gateway's invoker caches them: a request after idle then finds its
function's record without a Redis round trip on its path).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from scheduler.cold_start import Claim, ColdStarter
from scheduler.errors import Rejected, SchedulerError, StartFailed, StateConflict, StateUnavailable
from scheduler.launcher import MAX_EARLY, BaseLauncher, StartedInstance
from scheduler.leases import Leases
from scheduler.policies import desired_instances, should_reject
from scheduler.records import FunctionRecord, Instance
from scheduler.state import ClusterState, LiveCount, Slot, on_loop

__all__ = ["OnRecords", "Rejected", "Route", "Router", "RouterConfig", "StartFailed"]

log = logging.getLogger("ember.scheduler")
# Every function's record as one reconcile read it, and when that read began (monotonic s).
OnRecords = Callable[[Mapping[str, FunctionRecord], float], None]
_FAR_FUTURE_S = 1e9  # added to the clock: every idle instance is past its keep-alive then


@dataclass(frozen=True, slots=True)
class RouterConfig:
    tick_s: float = 0.25  # reconcile period
    poll_s: float = 0.05  # how often a waiting request re-checks Redis (other gateways' changes)
    handover_s: float = 0.05  # expected start of a resident instance beyond Eq. 3 (worker handover)
    report_every_s: float = 1.0
    stale_start_s: float = 300.0  # a "starting" record no launch is running for is forgotten after this
    start_backoff_s: float = 5.0  # minScale waits this long after a failed start before trying again
    # A finished request's slot stays with this gateway this long (s) before it goes back to
    # Redis: the next request of the function takes it without a Redis round trip (0: off).
    lease_s: float = 0.25
    max_leases: int = 8  # per function
    # Requests go to the busiest instance with a free slot (LLM-Mesh's bin-packing, §7.2)
    # instead of the least busy one.
    pack: bool = False
    # Instances a device runs at once, of any function (0: as many as its memory holds, co-located;
    # 1: one at a time, as ServerlessLLM does with a GPU: the baseline co-location is measured against).
    instances_per_device: int = 0

    def __post_init__(self) -> None:
        if min(self.tick_s, self.poll_s, self.report_every_s) <= 0 or self.handover_s < 0:
            raise ValueError("tick_s, poll_s and report_every_s must be > 0; handover_s >= 0")
        if not 0 <= self.lease_s <= 5 or self.max_leases < 0:
            raise ValueError("lease_s must be in [0, 5] and max_leases >= 0")
        if not 0 <= self.instances_per_device <= 1024:
            raise ValueError("instances_per_device must be in [0, 1024]")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RouterConfig:
        """``EMBER_SLOT_POLICY`` (spread | pack) and ``EMBER_INSTANCES_PER_DEVICE`` (0: no limit)."""
        env = os.environ if environ is None else environ
        policy = env.get("EMBER_SLOT_POLICY", "spread")
        if policy not in ("spread", "pack"):
            raise ValueError(f"EMBER_SLOT_POLICY must be spread or pack, not {policy!r}")
        raw = env.get("EMBER_INSTANCES_PER_DEVICE", "0")
        try:
            per_device = int(raw)
        except ValueError:
            raise ValueError(f"EMBER_INSTANCES_PER_DEVICE must be an integer, not {raw!r}") from None
        return cls(pack=policy == "pack", instances_per_device=per_device)


class Route(NamedTuple):
    instance_id: str
    url: str
    cold: bool  # the request waited for an instance to start
    waited_s: float
    token: str = ""  # the instance's credential: every request to ``url`` carries it
    # The instance is still being activated: the request names it (INSTANCE_HEADER) and the
    # worker holds it until the activation ends.
    early: bool = False


def _unresolved(claim: Claim, _task: asyncio.Task[Any]) -> None:
    """Resolve ``claim`` to None if its start's task ended without (cancelled before it ran,
    as when the router closes: its ``finally`` never ran)."""
    if not claim.done():
        claim.set_result(None)


class Router:
    """See the module docstring."""

    def __init__(
        self,
        state: ClusterState,
        launcher: BaseLauncher,
        config: RouterConfig | None = None,
        on_start: Callable[[str, StartedInstance], None] | None = None,
    ) -> None:
        self.state = state
        self.launcher = launcher
        self.config = config or RouterConfig()
        self.starter = ColdStarter(
            state,
            launcher,
            self.config.start_backoff_s,
            self._notify,
            on_start,
            self.config.instances_per_device,
        )
        self._waiting: dict[str, int] = {}
        self._claims: dict[str, int] = {}  # waiting requests that hold a new instance's first slot
        self._abandoned: dict[str, list[Claim]] = {}  # such slots whose request gave up, not yet freed
        self._changed: dict[str, asyncio.Event] = {}
        self._service_s: dict[str, float] = {}  # EWMA of request service time per function
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unreleased: list[tuple[str, float]] = []  # slots to release once Redis answers
        self.leases = Leases(self.config.lease_s, self.config.max_leases, self.release, self._spawn)
        self._last_report = 0.0
        self._reclaiming = asyncio.Lock()
        self._placing = asyncio.Lock()  # with a limit of instances per device
        self._on_records: OnRecords | None = None

    def on_records(self, callback: OnRecords) -> None:
        """Tell ``callback(records, read_at)`` every function's record each time reconcile has
        read them all (``read_at``: monotonic seconds before the read began)."""
        self._on_records = callback

    # ----- routing --------------------------------------------------------------------------

    async def route(
        self, name: str, record: FunctionRecord, deadline: float, since: float | None = None
    ) -> Route:
        """An instance for one request of ``name`` (see module docstring). ``since`` (epoch s):
        when the request arrived, for a request routed again; a start that failed since then
        fails it (with the start's reason) instead of starting another."""
        leased = self.leases.take(name)
        if leased is not None:
            return leased
        concurrency = record.scaling.concurrency
        try:  # fast path: one Lua call on the event loop (~0.1 ms; a thread hop costs more)
            hit = self.state.acquire_or_count(name, concurrency, retry=False, pack=self.config.pack)
        except StateUnavailable:  # Redis restarting: retry in a thread, off the event loop
            pack = self.config.pack
            hit = await asyncio.to_thread(self.state.acquire_or_count, name, concurrency, True, pack)
        if isinstance(hit, Slot):
            return Route(hit.instance_id, hit.url, False, 0.0, hit.token)
        counted = hit  # what the miss saw: this turn's scale-up decides on it (each turn counts)
        t0 = time.monotonic()
        asked = time.time() if since is None else since
        self._waiting[name] = self._waiting.get(name, 0) + 1
        missed = True  # the slot lookup above just missed: the first turn goes on to scale up
        claim: Claim | None = None  # the first slot of the instance this request started
        try:
            while True:
                if claim is not None:
                    if not claim.done():  # woken for another start's news: wait on
                        await self._wait_changed(name, deadline)
                        continue
                    claimed, claim = claim.result(), None
                    self._unclaimed(name)
                    if claimed is not None:  # counted in Redis with the instance
                        to, waited = claimed.target, time.monotonic() - t0
                        return Route(to.instance_id, to.url, True, waited, to.token, claimed.early)
                leased = self.leases.take(name)  # a request on this gateway just finished
                if leased is not None:
                    return leased._replace(cold=True, waited_s=time.monotonic() - t0)
                if not missed:
                    hit = await on_loop(
                        lambda retry: self.state.acquire_or_count(name, concurrency, retry, self.config.pack)
                    )
                    if isinstance(hit, Slot):
                        return Route(hit.instance_id, hit.url, True, time.monotonic() - t0, hit.token)
                    counted = hit
                missed = False
                early = await self._claim_early(name, concurrency)  # a ready slot goes first
                if early is not None:
                    return early._replace(waited_s=time.monotonic() - t0)
                failed = self.starter.failure(name)
                if failed is not None and failed[0] >= asked:
                    raise StartFailed(f"function {name!r} failed to start: {failed[1]}")
                claim = self._adopt(name) or await self._scale_up(name, record, deadline, counted)
                await self._wait_changed(name, deadline)
        finally:
            self._waiting[name] -= 1
            if claim is not None:  # cancelled or rejected with a slot counted: another may take it
                self._unclaimed(name)
                self._abandoned.setdefault(name, []).append(claim)
                self._spawn(self._free_claimed(name, claim, record.scaling.keep_alive_s))

    async def _wait_changed(self, name: str, deadline: float) -> None:
        """Wait until something changes for ``name``'s waiting requests (or ``poll_s``);
        :class:`Rejected` when ``deadline`` passed."""
        left = deadline - time.time()
        if left <= 0:
            raise Rejected(f"no instance of {name!r} could take the request before its deadline", 1.0)
        event = self._changed.setdefault(name, asyncio.Event())
        # (Not wait_for: on Python 3.11 its task costs the woken request two more loop turns.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(self.config.poll_s, left)):
                await event.wait()

    def _unclaimed(self, name: str) -> None:
        """A claim of ``name`` no longer waits for its request (it got it, or gave it up): the
        request counts among the waiting ones again when the next scale-up is decided."""
        self._claims[name] -= 1

    def _adopt(self, name: str) -> Claim | None:
        """A first slot of a new instance of ``name`` whose request gave up, for a request of it
        that waits now: counted in Redis, it would otherwise start one more instance."""
        abandoned = self._abandoned.get(name)
        while abandoned:
            claim = abandoned.pop()
            if not claim.done() or claim.result() is not None:  # (None: the slot went with its start)
                self._claims[name] = self._claims.get(name, 0) + 1
                return claim
        return None

    async def _free_claimed(self, name: str, claim: Claim, keep_alive_s: float) -> None:
        """Free the slot a request that gave up held on a new instance of ``name``, unless
        another request took it (:meth:`_adopt`), once the process it goes to is named or the
        instance is ready (a failed start's record took the slot along)."""
        claimed = await claim
        abandoned = self._abandoned.get(name, [])
        if claim not in abandoned:
            return
        abandoned.remove(claim)
        if claimed is not None:
            await self.release(Route(claimed.target.instance_id, claimed.target.url, True, 0.0), keep_alive_s)
            self._notify(name)

    async def _claim_early(self, name: str, concurrency: int) -> Route | None:
        """A slot of an instance this gateway is activating, or None (see the module docstring)."""
        slots = min(concurrency, MAX_EARLY)  # the others wait for ready
        for target in self.starter.targets(name):
            claim = functools.partial(self.state.claim_starting, target.instance_id, slots)
            claimed = await on_loop(claim)
            if claimed:
                return Route(target.instance_id, target.url, True, 0.0, target.token, early=True)
            self.starter.withdraw(name, target.instance_id)  # full, or no longer starting
        return None

    async def done(
        self, name: str, route: Route, keep_alive_s: float, service_s: float, reusable: bool = True
    ) -> None:
        """A request finished on ``route``: its slot is leased for the next request of ``name``
        (``lease_s``), or freed at once when not ``reusable`` (the request failed) or leases
        are off or full; either way the keep-alive clock restarts when the slot is freed. An
        early route's slot is never leased (its instance may still be activating, and only a
        request naming it is held there)."""
        old = self._service_s.get(name)
        self._service_s[name] = service_s if old is None else 0.8 * old + 0.2 * service_s
        if not (reusable and not route.early and self.leases.lease(name, route, keep_alive_s)):
            await self.release(route, keep_alive_s)
        self._notify(name)

    async def release(self, route: Route, keep_alive_s: float) -> None:
        """Free ``route``'s slot in Redis now and restart its instance's keep-alive clock."""
        try:  # fast path on the event loop, as in route()
            self.state.release(route.instance_id, keep_alive_s, retry=False)
        except StateUnavailable:
            try:
                await asyncio.to_thread(self.state.release, route.instance_id, keep_alive_s)
            except StateUnavailable:  # Redis away for long: release it once Redis is back
                self._unreleased.append((route.instance_id, keep_alive_s))

    async def drop_leases(self, name: str, instance_id: str | None = None) -> None:
        """Free the leased slots of ``name`` (of one instance only, when given) at once: the
        instance is going away, or the function changed."""
        await self.leases.drop(name, instance_id)

    async def instance_lost(
        self, name: str, lost: Route | Instance, keep_alive_s: float | None = None
    ) -> bool:
        """An instance of ``name`` failed: a request's connection to it broke (``lost`` is the
        request's route) or reconcile found it not alive (``lost`` is its record). If it is this
        router's to judge (its launcher runs it, or its record is on this router's devices) and
        its process is gone, it is forgotten: leases dropped, record removed, process reaped,
        waiting requests woken; returns True. Otherwise a route's slot is freed when
        ``keep_alive_s`` is given (the request is over) and False is returned. An early route's
        process (its activation failed, or the connection to it did) takes no more early routes."""
        if isinstance(lost, Route) and lost.early:  # that process failed: no more early routes to it
            self.starter.withdraw(name, lost.instance_id, lost.url)
        mine = self.launcher.owns(lost.instance_id) or (
            isinstance(lost, Instance) and lost.device in self.launcher.devices()
        )
        if mine and not self.launcher.alive(lost.instance_id):
            log.warning("instance %s of %s died; forgetting it", lost.instance_id, name)
            await self.drop_leases(name, lost.instance_id)
            await asyncio.to_thread(self.state.forget_from, name, lost.instance_id, "ready")
            await self.launcher.stop(lost.instance_id)  # reap it, drop it from the agent's books
            self._notify(name)
            return True
        if isinstance(lost, Route) and keep_alive_s is not None:
            await self.release(lost, keep_alive_s)
        return False

    async def _scale_up(
        self, name: str, record: FunctionRecord, deadline: float, counted: LiveCount
    ) -> Claim | None:
        """Start an instance of ``name`` if its load wants one more. A start from zero (no
        instance live: none could free a slot sooner) counts the calling request's slot with
        the new record and returns where that request will go (see :meth:`ColdStarter.start`).
        ``counted``: its live instances as this turn's routing miss counted them."""
        scaling = record.scaling
        num_live = counted.num_ready + counted.num_starting
        want = desired_instances(  # (a claimed slot is in flight already: its request not waiting)
            counted.in_flight + self._waiting.get(name, 0) - self._claims.get(name, 0),
            scaling.concurrency,
            scaling.min_scale,
            scaling.max_scale,
        )
        left = deadline - time.time()
        if num_live >= want:
            # Queue behind busy instances, unless the wait cannot end before the deadline.
            if counted.num_ready and not counted.num_starting:
                slots = counted.num_ready * scaling.concurrency
                turns = math.ceil(self._waiting.get(name, 1) / slots)
                wait = turns * self._service_s.get(name, 0.0)
                if should_reject(wait, left):
                    raise Rejected(f"{name!r} is at maxScale and busy; expected wait {wait:.1f} s", wait)
            return None
        if self.starter.room_pause_s(name) > 0:
            return None  # its pool refused it for room again and again: wait (see ColdStarter)
        if self.config.instances_per_device:
            async with self._placing:  # placement and the new record together, or two fill one slot
                return await self._place_and_start(name, record, deadline, want, left, not num_live)
        return await self._place_and_start(name, record, deadline, want, left, not num_live)

    async def _place_and_start(
        self, name: str, record: FunctionRecord, deadline: float, want: int, left: float, claim: bool
    ) -> Claim | None:
        device, expected = await self.starter.place(record)
        if device is None:
            # Before stopping anything: no instance of any function frees room for it.
            if not await self.starter.could_ever_fit(record):
                raise Rejected(f"no device can hold {name!r}'s model (it is larger than every pool)", 5.0)
            device, expected = await self._reclaim(name, record)
        if device is None:
            return None  # other functions' instances are busy: wait for one to go idle (or the deadline)
        if should_reject(expected + self.config.handover_s, left):
            raise Rejected(
                f"{name!r} cannot start before the request's deadline (expected {expected:.1f} s)", expected
            )
        instance_id = await on_loop(
            lambda retry: self.state.scale_up(name, want, device, retry=retry, claim=claim)
        )
        if instance_id is None:
            return None
        claimed: Claim | None = asyncio.get_running_loop().create_future() if claim else None
        task = self._spawn(self.starter.start(instance_id, name, record, device, deadline, claimed))
        if claimed is not None:
            self._claims[name] = self._claims.get(name, 0) + 1
            task.add_done_callback(functools.partial(_unresolved, claimed))
        return claimed

    async def _reclaim(self, name: str, record: FunctionRecord) -> tuple[str | None, float]:
        """Make room for ``name``'s model on this router's devices by stopping idle instances
        of other functions, the longest idle first, until it can be placed; returns the
        placement then (None: still no room). A keep-alive promises a quick next request, not
        memory that a request waiting now needs: an idle instance's weights stay resident
        (unpinned, so the pool evicts only what the new model needs), minScale instances stay,
        and so do busy ones, which the waiting request waits for instead. Nothing is stopped
        unless stopping every idle candidate would make room: while busy instances hold too
        much, stopping idle ones gains nothing (a waiting request would otherwise stop every
        other function's instance the moment it went idle, however long it waits)."""
        async with self._reclaiming:  # one at a time: concurrent waiters would stop too much
            device, expected = await self.starter.place(record)  # another waiter made room
            if device is not None:
                return device, expected
            mine = sorted(self.launcher.devices())
            records = await asyncio.to_thread(self.state.functions)
            idle: list[tuple[float, str, int]] = []  # (keep-alive deadline, function, minScale)
            freed: dict[str, set[str]] = {}  # device -> models the idle candidates pin
            vacating: dict[str, int] = {}  # device -> idle candidates (the instances-per-device limit)
            kept: dict[str, set[str]] = {}  # device -> models the instances that stay pin
            for other, other_record in records.items():
                instances = await asyncio.to_thread(self.state.instances, other)
                min_scale = other_record.scaling.min_scale
                live = sum(i.state in ("starting", "ready") for i in instances)
                model = other_record.model.model_id if other_record.model is not None else ""
                stoppable = other != name and live > min_scale
                for inst in instances:
                    if inst.device not in mine:
                        continue
                    if stoppable and inst.state == "ready" and inst.in_flight == 0:
                        idle.append((inst.deadline, other, min_scale))
                        vacating[inst.device] = vacating.get(inst.device, 0) + 1
                        freed.setdefault(inst.device, set())  # its KV blocks, at least
                        if min_scale == 0:  # else some stay, pinning the model: which ones is not known
                            freed[inst.device].add(model)
                            continue
                    kept.setdefault(inst.device, set()).add(model)
            unpinned = {d: models - kept.get(d, set()) for d, models in freed.items()}
            if not idle or (await self.starter.place(record, unpinned, vacating))[0] is None:
                return None, math.inf  # not even with every idle candidate stopped: wait
            for _, other, min_scale in sorted(idle):
                # Past every deadline: the state's atomic expiry drains them as if timed out.
                now = time.time() + _FAR_FUTURE_S
                for instance_id in await asyncio.to_thread(self.state.expire, other, min_scale, now, mine):
                    log.info("stopping idle instance %s of %s: %s needs its memory", instance_id, other, name)
                    await self._drain(other, instance_id)
                device, expected = await self.starter.place(record)
                if device is not None:
                    return device, expected
            return None, math.inf

    # ----- reconcile ------------------------------------------------------------------------

    async def run(self) -> None:
        """Reconcile every tick until cancelled (errors are logged, never fatal)."""
        while True:
            try:
                await self.reconcile()
            except SchedulerError as exc:
                log.warning("reconcile: %s", exc)
            except Exception:  # a pool or Redis hiccup must not end keep-alive and health checks
                log.exception("reconcile failed")
            await asyncio.sleep(self.config.tick_s)

    async def reconcile(self, now: float | None = None) -> None:
        """One pass: expire idle instances, forget dead ones, keep minScale, report devices."""
        await self.release_pending()
        read_at = time.monotonic()
        records = await asyncio.to_thread(self.state.functions)
        if self._on_records is not None:
            try:  # the gateway's cache: its failure must not stop expiry, health checks, minScale
                self._on_records(records, read_at)
            except Exception:
                log.exception("handing the function records on failed")
        names = set(records) | set(await asyncio.to_thread(self.state.functions_with_instances))
        mine = sorted(self.launcher.devices())
        for name in sorted(names):
            record = records.get(name)
            if record is None:  # deleted: drain everything it still runs
                await self.retire(name)
            else:
                await self.expire_idle(name, record, mine, now)
            await self.forget_dead(name, mine)
            if record is not None:
                await self.keep_min_scale(name, record)
        await self.report_devices()

    async def release_pending(self) -> None:
        """Release the slots whose release failed while Redis was away (oldest first)."""
        while self._unreleased:
            instance_id, keep_alive = self._unreleased[0]
            await asyncio.to_thread(self.state.release, instance_id, keep_alive)
            self._unreleased.pop(0)

    async def expire_idle(
        self, name: str, record: FunctionRecord, devices: list[str], now: float | None
    ) -> None:
        """Drain the instances on ``devices`` idle past their keep-alive (minScale stay)."""
        min_scale = record.scaling.min_scale
        for instance_id in await asyncio.to_thread(self.state.expire, name, min_scale, now, devices):
            self._spawn(self._drain(name, instance_id, standby=True))

    async def forget_dead(self, name: str, devices: list[str]) -> None:
        """Forget the instances on ``devices`` whose process died, and starts nobody finishes."""
        for inst in await asyncio.to_thread(self.state.instances, name):
            if inst.device not in devices:
                continue  # another node's agent judges its own instances
            if inst.state == "ready" and not self.launcher.alive(inst.instance_id):
                await self.instance_lost(name, inst)
            elif (
                inst.state == "starting"
                and not self.starter.launching(inst.instance_id)
                and time.time() - inst.created > self.config.stale_start_s
            ):  # its start was lost (a crashed gateway, a failed write): nobody will finish it
                await asyncio.to_thread(self.state.forget_from, name, inst.instance_id, "starting")
                self._notify(name)

    async def keep_min_scale(self, name: str, record: FunctionRecord) -> None:
        """Start an instance when fewer than minScale are live (not while a failed start backs off)."""
        min_scale = record.scaling.min_scale
        if min_scale == 0 or record.model is None or self.starter.backing_off(name):
            return
        if self.starter.room_pause_s(name) > 0:  # its pool keeps refusing it for room
            return
        instances = await asyncio.to_thread(self.state.instances, name)
        if sum(i.state in ("starting", "ready") for i in instances) < min_scale:
            device, _ = await self.starter.place(record)
            if device is not None:
                new_id = await asyncio.to_thread(self.state.scale_up, name, min_scale, device)
                if new_id is not None:
                    self._spawn(self.starter.start(new_id, name, record, device, time.time() + 600))

    async def report_devices(self) -> None:
        """Re-publish the devices' pool stats, every ``report_every_s``."""
        if time.monotonic() - self._last_report >= self.config.report_every_s:
            self._last_report = time.monotonic()
            await self.starter.report()

    async def retire(self, name: str) -> None:
        """Drain and stop every instance of ``name`` on this router's devices (after ``delete``
        or a redeploy); other nodes' gateways retire theirs."""
        await self.drop_leases(name)
        await self.launcher.retire(name)
        mine = set(self.launcher.devices())
        for inst in await asyncio.to_thread(self.state.instances, name):
            if inst.state == "ready" and inst.device in mine:
                try:
                    await asyncio.to_thread(self.state.transition, inst.instance_id, "ready", "draining")
                except StateConflict:
                    continue
                self._spawn(self._drain(name, inst.instance_id))

    async def _drain(self, name: str, instance_id: str, standby: bool = False) -> None:
        """Stop ``instance_id``; ``standby``: it idled out (the launcher may prepare the next
        start of ``name`` ahead of time), not retired."""
        await self.launcher.stop(instance_id, standby)
        await asyncio.to_thread(self.state.forget_from, name, instance_id, "draining")
        await self.starter.report()  # residency is unchanged, but pins and sessions are not

    # ----- plumbing -------------------------------------------------------------------------

    def _notify(self, name: str) -> None:
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Free every leased slot, then stop the scheduler's tasks."""
        await self.leases.drop_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
