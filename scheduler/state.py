"""Cluster state in Redis: functions, instances and device reports.

Everything the scheduler decides from lives here, never only in a process, so gateways,
agents and pools can restart and re-report. Values are explicit, versioned JSON (never
pickle). Every state change that two gateways could race on is one Lua script
(:mod:`scheduler.state_scripts`), so they never double-start or double-stop an instance; a
function record's change is acknowledged once it is durable (:mod:`scheduler.durable`).
Redis calls retry with tenacity on connection errors (a Redis restart while idle is survived).

Keys (``prefix`` defaults to ``ember:``)::

    {p}functions              hash  name -> {"v": 1, "spec": {...}, "model": {...} | null, "updated": t}
    {p}function_min_scale     hash  name -> its minScale (a namespace's always-on sum)
    {p}fn:{name}:instances    set   instance ids of a function
    {p}instance:{id}          hash  function, state, device, url, token, in_flight, deadline, created
                                    (a Knative pod's expires unless its worker refreshes it)
    {p}device:{id}            string {"v": 1, ...pool report..., "updated": t}
    {p}instance_seq           counter for instance ids

Records are decoded once, here, into the typed values of :mod:`scheduler.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import redis
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from scheduler import names
from scheduler import state_scripts as scripts
from scheduler.durable import RecordWriter
from scheduler.errors import (
    FunctionNotFound,
    FunctionQuotaExceeded,
    StateConflict,
    StateNotWritable,
    StateOutOfMemory,
    StatePersistenceFailed,
    StateUnavailable,
    WarmQuotaExceeded,
)
from scheduler.records import ENCODING_VERSION, DeviceReport, FunctionRecord, Instance, ModelRef, RecordError

__all__ = ["ENCODING_VERSION", "ClusterState", "Instance", "LiveCount", "Slot"]
LIVE_STATES = ("starting", "ready")
STATES = ("starting", "ready", "draining", "gone")
_UNBOUNDED = 2**31 - 1  # "desired" instances for add_instance: scale_up never declines

_T = TypeVar("_T")


class Slot(NamedTuple):
    """A routed request's instance: its id, URL and credential (sent with every request)."""

    instance_id: str
    url: str
    token: str


class LiveCount(NamedTuple):
    """A function's live instances as a routing miss saw them: what a scale-up decides on."""

    num_ready: int
    num_starting: int
    in_flight: int  # requests in flight on them (a starting one's claimed slots included)


class ClusterState:
    """Typed access to the cluster state in one Redis database."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "ember:",
        retry_seconds: float = 10.0,
        sync_records: Callable[[], None] | None = None,
    ) -> None:
        """``sync_records``: fsyncs the server's append-only file after a function record
        changes (an embedded Redis, see :mod:`scheduler.durable`); without it, ``WAITAOF``."""
        # Any: redis-py's annotations cannot say that decode_responses=True returns str.
        self.r: Any = client
        self.p = prefix
        self.retry_seconds = retry_seconds
        self._records = RecordWriter(client, sync_records)
        self._put_function = client.register_script(scripts.PUT_FUNCTION)
        self._delete_function = client.register_script(scripts.DELETE_FUNCTION)
        self._set_field = client.register_script(scripts.SET_FIELD)
        self._delete_fields = client.register_script(scripts.DELETE_FIELDS)
        self._scale_up = client.register_script(scripts.SCALE_UP)
        self._transition = client.register_script(scripts.TRANSITION)
        self._acquire = client.register_script(scripts.ACQUIRE)
        self._release = client.register_script(scripts.RELEASE)
        self._claim_starting = client.register_script(scripts.CLAIM_STARTING)
        self._expire = client.register_script(scripts.EXPIRE)
        self._refresh = client.register_script(scripts.REFRESH)
        self._prune = client.register_script(scripts.PRUNE)

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "ember:", sync_records: Callable[[], None] | None = None
    ) -> ClusterState:
        # Bounded socket timeouts: the gateway makes its routing call on its event loop.
        client = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=5.0, socket_connect_timeout=2.0
        )
        return cls(client, prefix, sync_records=sync_records)

    def close(self) -> None:
        """Close the connections to Redis."""
        self.r.close()

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``, retrying connection errors for ``retry_seconds`` (Redis restarts)."""
        retrying = retry(
            retry=retry_if_exception_type((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)),
            stop=stop_after_delay(self.retry_seconds),
            wait=wait_exponential(multiplier=0.02, max=0.5),
            reraise=True,
        )
        try:
            return retrying(fn)()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StateUnavailable(f"Redis is unreachable: {exc}") from None
        except redis.exceptions.ResponseError as exc:
            raise _typed(exc) from None
        except redis.exceptions.InvalidResponse as exc:
            # The URL names something that is not Redis (an HTTP service, say): the store is
            # unreachable all the same, not a bug to answer with a traceback or a 500.
            raise StateUnavailable(
                f"Redis is unreachable: the server at its URL is not Redis ({exc})"
            ) from None

    # ----- functions ---------------------------------------------------------------------

    def put_function(
        self,
        name: str,
        spec_document: dict[str, Any],
        model: ModelRef | None = None,
        max_in_namespace: int | None = None,
        max_min_scale: int | None = None,
    ) -> None:
        """Store a function's spec and, once registered, its model. With ``max_in_namespace``,
        a new function whose namespace already holds that many is :class:`FunctionQuotaExceeded`;
        with ``max_min_scale``, one whose ``minScale`` would take the sum over its namespace's
        functions past it is :class:`WarmQuotaExceeded` (checked and stored atomically; a
        redeploy is not a new function, and its old ``minScale`` does not count)."""
        record = FunctionRecord.create(name, spec_document, model)
        self._put_within(name, record.to_json(), record.scaling.min_scale, max_in_namespace, max_min_scale)

    def check_room(
        self,
        name: str,
        max_in_namespace: int,
        spec_document: dict[str, Any] | None = None,
        max_min_scale: int | None = None,
    ) -> None:
        """The quota error :meth:`put_function` would raise now (for ``spec_document``'s
        ``minScale``, when given): an early check before a deploy's costly steps (only
        ``put_function`` holds under concurrent deploys)."""
        min_scale = (
            0 if spec_document is None else FunctionRecord.create(name, spec_document).scaling.min_scale
        )
        self._put_within(name, "", min_scale, max_in_namespace, max_min_scale)

    def _put_within(
        self, name: str, value: str, min_scale: int, max_functions: int | None, max_min_scale: int | None
    ) -> None:
        namespace = names.split(name)[0]
        prefix = "" if namespace == names.DEFAULT_NAMESPACE else f"{namespace}/"
        caps = [_UNBOUNDED if cap is None else cap for cap in (max_functions, max_min_scale)]
        args: list[str | int] = [name, value, caps[0], prefix, min_scale, caps[1]]
        keys = [f"{self.p}functions", f"{self.p}function_min_scale"]
        if value:  # a stored record is acknowledged once it is durable
            verdict, held = self._call(lambda: self._records.run(self._put_function, keys, args))
        else:
            verdict, held = self._call(lambda: self._put_function(keys=keys, args=args))
        if int(verdict) == 1:
            raise FunctionQuotaExceeded(
                f"namespace {namespace!r} holds {held} functions, its limit is {caps[0]}: "
                "delete one before deploying another"
            )
        if int(verdict) == 2:
            raise WarmQuotaExceeded(
                f"spec.scaling.minScale: namespace {namespace!r} keeps {held} instances up by minScale, "
                f"its limit is {caps[1]}: {min_scale} more do not fit"
            )

    def function(self, name: str, retry: bool = True) -> FunctionRecord:
        """The function's record (:class:`FunctionNotFound` if it is not deployed); ``retry``:
        see :meth:`_once_or_retry`."""
        raw = self._once_or_retry(lambda: self.r.hget(f"{self.p}functions", name), retry)
        if raw is None:
            raise FunctionNotFound(f"function {name!r} is not deployed")
        return FunctionRecord.decode(name, raw)

    def functions(self) -> dict[str, FunctionRecord]:
        """Every deployed function's record, by qualified id (sorted)."""
        raw = self._call(lambda: self.r.hgetall(f"{self.p}functions"))
        return {name: FunctionRecord.decode(name, v) for name, v in sorted(raw.items())}

    def get_function(self, name: str) -> dict[str, Any]:
        """The function's spec document as stored (what ``describe`` shows)."""
        return self.function(name).spec

    def get_record(self, name: str) -> dict[str, Any]:
        """The function's record in its stored encoding (``v``, ``spec``, ``model``, ``updated``)."""
        return self.function(name).encode()

    def list_functions(self) -> dict[str, dict[str, Any]]:
        """Every deployed function's spec document, by qualified id (sorted)."""
        return {name: record.spec for name, record in self.functions().items()}

    def functions_with_instances(self) -> list[str]:
        """Every function name that has instance records (deleted functions included)."""
        pattern = f"{self.p}fn:*:instances"
        keys = self._call(lambda: [str(k) for k in self.r.scan_iter(pattern)])
        return sorted(k[len(f"{self.p}fn:") : -len(":instances")] for k in keys)

    def delete_function(self, name: str) -> None:
        """Delete the function's record (and its minScale); durable once this returns."""
        keys = [f"{self.p}functions", f"{self.p}function_min_scale"]
        if not int(self._call(lambda: self._records.run(self._delete_function, keys, [name]))):
            raise FunctionNotFound(f"function {name!r} is not deployed")

    def put_record_field(self, name: str, field: str, value: str) -> None:
        """Set ``field`` of the record hash ``{p}{name}`` (tenant keys, say), durably."""
        keys = [f"{self.p}{name}"]
        self._call(lambda: self._records.run(self._set_field, keys, [field, value]))

    def delete_record_fields(self, name: str, fields: Sequence[str]) -> int:
        """Delete ``fields`` of the record hash ``{p}{name}``, durably; how many were there."""
        keys, args = [f"{self.p}{name}"], list(fields)
        return int(self._call(lambda: self._records.run(self._delete_fields, keys, args))) if args else 0

    # ----- instances ---------------------------------------------------------------------

    def scale_up(
        self,
        function: str,
        desired: int,
        device: str,
        now: float | None = None,
        ttl_s: float | None = None,
        retry: bool = True,
        claim: bool = False,
    ) -> str | None:
        """Start one instance if fewer than ``desired`` are live; its id, or None. With
        ``ttl_s`` the record expires unless :meth:`refresh_instance` renews it; with ``claim``
        its first slot is taken at once (in flight 1, as :meth:`claim_starting` would count it)."""
        keys = [f"{self.p}fn:{function}:instances", f"{self.p}instance_seq"]
        when = now if now is not None else time.time()
        ttl_ms = 0 if ttl_s is None else _ttl_ms(ttl_s)
        args: list[Any] = [desired, function, device, when, self.p, ttl_ms, 1 if claim else 0]
        result = self._once_or_retry(lambda: self._scale_up(keys=keys, args=args), retry)
        return str(result) if result else None

    def add_instance(
        self, function: str, device: str, now: float | None = None, ttl_s: float | None = None
    ) -> str:
        """Record a new ``starting`` instance whatever the function's scale; its id. For
        instances that another autoscaler starts and stops (a Knative pod records itself,
        with a ``ttl_s`` its heartbeat renews, so a pod killed outright leaves no record)."""
        new_id = self.scale_up(function, _UNBOUNDED, device, now, ttl_s)
        assert new_id is not None  # no function has _UNBOUNDED live instances
        return new_id

    def refresh_instance(
        self, function: str, instance_id: str, ttl_s: float, fields: Mapping[str, str | int | float]
    ) -> bool:
        """Renew an expiring record's TTL; False when it was gone and ``fields`` (the whole
        record) were written again under the same id."""
        keys = [f"{self.p}instance:{instance_id}", f"{self.p}fn:{function}:instances"]
        args: list[Any] = [_ttl_ms(ttl_s), instance_id]
        for k, v in fields.items():
            args += [k, v]
        return bool(self._call(lambda: self._refresh(keys=keys, args=args)))

    def transition(
        self, instance_id: str, from_state: str, to_state: str, **fields: str | int | float
    ) -> None:
        """Atomically move an instance between states (:class:`StateConflict` if not in ``from_state``).

        Becoming ``ready`` needs a ``deadline`` (now + keep-alive): an instance that never
        serves must still expire, but not the moment it is ready.
        """
        self.transition_with(instance_id, from_state, to_state, fields)

    def transition_with(
        self,
        instance_id: str,
        from_state: str,
        to_state: str,
        fields: Mapping[str, str | int | float],
        retry: bool = True,
    ) -> None:
        """:meth:`transition` with the record's new ``fields`` as a mapping; ``retry``: see
        :meth:`_once_or_retry`."""
        if to_state not in STATES:
            raise ValueError(f"unknown state {to_state!r}")
        if to_state == "ready" and "deadline" not in fields:
            raise ValueError("a transition to ready needs deadline= (now + keep-alive)")
        args: list[Any] = [from_state, to_state]
        for k, v in fields.items():
            args += [k, v]
        ok = self._once_or_retry(
            lambda: self._transition(keys=[f"{self.p}instance:{instance_id}"], args=args), retry
        )
        if not ok:
            raise StateConflict(f"instance {instance_id} is not {from_state}")

    def _once_or_retry(self, fn: Callable[[], _T], retry: bool) -> _T:
        """``fn`` with retries, or (``retry=False``) one attempt: the gateway's event-loop fast
        path must not sit in a retry loop; it falls back to a retrying call in a thread
        (:func:`on_loop`)."""
        if retry:
            return self._call(fn)
        try:
            return fn()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StateUnavailable(f"Redis is unreachable: {exc}") from None
        except redis.exceptions.ResponseError as exc:
            raise _typed(exc) from None
        except redis.exceptions.InvalidResponse as exc:
            # The URL names something that is not Redis (an HTTP service, say): the store is
            # unreachable all the same, not a bug to answer with a traceback or a 500.
            raise StateUnavailable(
                f"Redis is unreachable: the server at its URL is not Redis ({exc})"
            ) from None

    def acquire(self, function: str, concurrency: int, retry: bool = True) -> tuple[str, str] | None:
        """Route one request: (instance id, url) of the least loaded ready instance, or None."""
        slot = self.acquire_slot(function, concurrency, retry)
        return (slot.instance_id, slot.url) if slot else None

    def acquire_slot(
        self, function: str, concurrency: int, retry: bool = True, pack: bool = False
    ) -> Slot | None:
        """:meth:`acquire` with the instance's credential: what the gateway routes with. The
        least busy ready instance with a free slot gets it, or with ``pack`` the busiest
        (LLM-Mesh's bin-packing, §7.2: batches grow, and the others idle out sooner)."""
        routed = self.acquire_or_count(function, concurrency, retry, pack)
        return routed if isinstance(routed, Slot) else None

    def acquire_or_count(
        self, function: str, concurrency: int, retry: bool = True, pack: bool = False
    ) -> Slot | LiveCount:
        """:meth:`acquire_slot`, or on a miss the function's live instances counted in the same
        script: a router that scales up next needs no read of their records (two round trips,
        ~0.2 ms of a cold start's path)."""
        keys = [f"{self.p}fn:{function}:instances"]
        args: list[str | int] = [self.p, concurrency, "pack" if pack else "spread"]
        result = self._once_or_retry(lambda: self._acquire(keys=keys, args=args), retry)
        assert isinstance(result, list) and len(result) in (3, 4), result  # state_scripts.ACQUIRE
        if len(result) == 4:
            return LiveCount(int(result[1]), int(result[2]), int(result[3]))
        return Slot(str(result[0]), str(result[1]), str(result[2]))

    def claim_starting(self, instance_id: str, concurrency: int, retry: bool = True) -> bool | None:
        """Take a slot of a ``starting`` instance (the gateway sends the request while the
        instance activates; its in-flight count carries over to ``ready``): True when taken,
        False when its ``concurrency`` slots are taken, None when it is no longer starting."""
        keys = [f"{self.p}instance:{instance_id}"]
        result = int(self._once_or_retry(lambda: self._claim_starting(keys=keys, args=[concurrency]), retry))
        return None if result < 0 else result == 1

    def release(
        self, instance_id: str, keep_alive_s: float, now: float | None = None, retry: bool = True
    ) -> int:
        """A request finished; returns the instance's remaining in-flight count."""
        deadline = (now if now is not None else time.time()) + keep_alive_s
        keys = [f"{self.p}instance:{instance_id}"]
        return int(self._once_or_retry(lambda: self._release(keys=keys, args=[deadline]), retry))

    def expire(
        self, function: str, min_scale: int, now: float | None = None, devices: list[str] | None = None
    ) -> list[str]:
        """Instances whose keep-alive ran out, now draining (at least ``min_scale`` stay); only
        on ``devices`` when given (a gateway drains what its own agent can stop)."""
        keys = [f"{self.p}fn:{function}:instances"]
        args: list[str | float | int] = [self.p, now if now is not None else time.time(), min_scale]
        args += devices or []
        ids = self._call(lambda: self._expire(keys=keys, args=args))
        return [str(i) for i in ids]

    def instances(self, function: str, retry: bool = True) -> list[Instance]:
        """The function's instance records (ordered by id); expired ones are pruned. Two round
        trips whatever the count (the records come in one pipeline): the router calls this on
        its event loop while requests wait for a start."""
        members = self._once_or_retry(lambda: self.r.smembers(f"{self.p}fn:{function}:instances"), retry)
        ids = sorted(members, key=int)

        def fetch() -> list[dict[str, str]]:
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(f"{self.p}instance:{i}")
            return list(pipe.execute())

        records = self._once_or_retry(fetch, retry) if ids else []
        out = []
        for i, h in zip(ids, records, strict=True):
            key = f"{self.p}instance:{i}"
            if h:
                out.append(Instance.decode(str(i), h))
            else:  # expired (a pod killed outright) or forgotten since SMEMBERS
                keys = [key, f"{self.p}fn:{function}:instances"]
                self._once_or_retry(functools.partial(self._prune, keys=keys, args=[i]), retry)
        return out

    def forget_instance(self, function: str, instance_id: str) -> None:
        """Drop a gone instance's record."""
        self._call(lambda: self.r.srem(f"{self.p}fn:{function}:instances", instance_id))
        self._call(lambda: self.r.delete(f"{self.p}instance:{instance_id}"))

    def forget_from(self, function: str, instance_id: str, from_state: str) -> None:
        """Mark an instance ``gone`` (if it still is ``from_state``) and drop its record."""
        with contextlib.suppress(StateConflict):
            self.transition(instance_id, from_state, "gone")
        self.forget_instance(function, instance_id)

    # ----- devices -------------------------------------------------------------------------

    def report_device(self, device_id: str, report: Mapping[str, Any]) -> None:
        """Publish a device's pool report (the node agent's ``report``)."""
        value = json.dumps(DeviceReport.encode(report))
        self._call(lambda: self.r.set(f"{self.p}device:{device_id}", value))

    def device_reports(
        self, retry: bool = True, device_ids: Sequence[str] | None = None
    ) -> dict[str, DeviceReport]:
        """Every device's latest well-formed report, by device id (sorted); malformed ones
        are left out (:meth:`device_reports_or_errors` says why)."""
        reports = self.device_reports_or_errors(retry, device_ids)
        return {k: v for k, v in reports.items() if isinstance(v, DeviceReport)}

    def device_reports_or_errors(
        self, retry: bool = True, device_ids: Sequence[str] | None = None
    ) -> dict[str, DeviceReport | RecordError]:
        """Every device's latest report (of ``device_ids`` only, when given), by device id
        (sorted), or the :class:`RecordError` its document raised: one node's malformed report
        must not hide every other node's. ``retry=False``: one attempt,
        :class:`StateUnavailable` at once when Redis is away."""
        if device_ids is not None:  # one round trip (a cold start places on its node's devices)
            keys = sorted(f"{self.p}device:{d}" for d in set(device_ids))
        else:
            # Two round trips whatever the device count (the scheduler extender reads every
            # report per placement): one SCAN page of up to 1000 keys at a time, then one MGET.
            pattern = f"{self.p}device:*"
            keys = self._once_or_retry(
                lambda: sorted(str(k) for k in self.r.scan_iter(pattern, count=1000)), retry
            )
        if not keys:
            return {}
        values: list[str | None] = self._once_or_retry(functools.partial(self.r.mget, keys), retry)
        out: dict[str, DeviceReport | RecordError] = {}
        for k, raw in zip(keys, values, strict=True):
            if raw is not None:  # deleted between the SCAN and the MGET
                device_id = k[len(f"{self.p}device:") :]
                try:
                    out[device_id] = DeviceReport.decode(device_id, str(raw))
                except RecordError as exc:
                    out[device_id] = exc
        return out

    def devices(self) -> dict[str, dict[str, Any]]:
        """Every device's report as published (what ``/v1/cluster`` shows), by device id."""
        return {device_id: r.document for device_id, r in self.device_reports().items()}


def _ttl_ms(ttl_s: float) -> int:
    """A record TTL in whole milliseconds (PEXPIRE's unit), at least 1."""
    if not 0 < ttl_s < 2**31 / 1000:
        raise ValueError(f"a record TTL must be more than 0 s, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


def _typed(exc: redis.exceptions.ResponseError) -> Exception:
    """The scheduler error for a Redis error reply that is the store's condition, not a bug:
    OOM (``maxmemory`` reached), MISCONF (a failed save), READONLY (a replica). Other
    replies (a script or command error) are returned unchanged: they are bugs."""
    text = str(exc)
    # Errors raised inside a Lua script arrive wrapped ("... script: ... OOM ..."): match anywhere.
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in text:
        return StateOutOfMemory(f"state store cannot write: Redis is out of memory ({text})")
    if "MISCONF" in text:
        return StatePersistenceFailed(f"state store cannot write: Redis cannot persist ({text})")
    if isinstance(exc, redis.exceptions.ReadOnlyError) or text.startswith("READONLY"):
        return StateNotWritable(f"state store cannot write: Redis is a read-only replica ({text})")
    return exc


async def on_loop(call: Callable[[bool], _T]) -> _T:
    """``call(False)`` on the event loop, or ``call(True)`` in a thread when Redis is away.

    ``call`` is a :class:`ClusterState` method bound to its arguments, taking ``retry``. One
    local Redis round trip on the loop costs ~0.1 ms; a hop to a thread and back costs 0.3-1 ms
    (more on busy cores), and the cold path makes several. A call that finds Redis away
    (:class:`StateUnavailable`) is retried in a thread, whose retries block no other request.
    """
    try:
        return call(False)
    except StateUnavailable:
        return await asyncio.to_thread(call, True)
