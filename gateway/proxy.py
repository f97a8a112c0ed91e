"""Forwarding one invocation to an instance: route, send, stream back, release.

Connections to workers are pooled (one ``aiohttp.ClientSession`` per gateway: it costs about
0.3 ms less per request than httpx, and the gateway's overhead budget is 2 ms). A JSON answer
is read whole and returned; an SSE answer is passed through chunk by chunk as it arrives;
the worker's ``Server-Timing`` header (its own service time) is passed on with either.
Every request carries the instance's credential (``X-Ember-Worker-Token``).

Delivery is at most once: only a connection that could not be made (nothing was sent) is
routed again (a dead instance is forgotten). Once the request may have reached the worker, a
failure is one 502 ``instance_failed`` and the request is never re-sent: a handler that
crashes its worker runs once. A request on an early route (an instance still being
activated, :mod:`scheduler.router`) names its instance; the worker's 503 ``not_started`` there,
with the never-ran header naming that instance, says the activation failed before the request
ran, and only that answer, only on such a route, routes the request again. Pooled connections
idle at most 30 s, less than the worker's keep-alive (``runtime.worker.KEEP_ALIVE_S``), so a
request is never written to a connection the worker already closed. If the worker dies
mid-stream the client gets one ``error`` event and ``[DONE]``, as OpenAI streams end on
errors. The instance's slot is released in every case.
Where a request goes is a :class:`Routing`'s choice: an instance the embedded router runs, or in
cluster mode the function's Knative Service (its cluster-local URL; Knative picks the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import anyio
import yarl
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from gateway.metrics import Metrics
from runtime.errors import error_body
from scheduler.errors import FunctionNotFound, SchedulerError
from scheduler.launcher import INSTANCE_HEADER, NEVER_RAN_HEADER
from scheduler.records import FunctionRecord
from scheduler.router import Route
from scheduler.state import ClusterState, on_loop

WORKER_TOKEN_HEADER = "x-ember-worker-token"  # runtime.worker_guard.TOKEN_HEADER
POOL_KEEP_ALIVE_S = 30.0  # idle pooled connections: below the worker's keep-alive (75 s)
PRECONNECT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)  # a standby's /healthz (Invoker.preconnect)
PASSED_ON = ("server-timing", "retry-after")  # worker response headers the client gets
# Failures that happen before any byte of the request is sent: safe to route again.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class Routing(Protocol):
    """Where invocations go: :class:`scheduler.router.Router` in embedded mode (instances it
    starts and scales), :class:`scheduler.knative.targets.ServiceTargets` in cluster mode
    (each function's Knative Service)."""

    async def route(
        self, name: str, record: FunctionRecord, deadline: float, since: float | None = None
    ) -> Route: ...

    async def done(
        self, name: str, route: Route, keep_alive_s: float, service_s: float, reusable: bool = True
    ) -> None: ...

    async def instance_lost(self, name: str, lost: Route, keep_alive_s: float | None = None) -> bool: ...

    async def retire(self, name: str) -> None: ...


class InvocationError(SchedulerError):
    """The instance failed while answering (HTTP 502)."""

    code = "instance_failed"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    request_timeout_s: float = 300.0  # default deadline of a request (X-Ember-Timeout overrides)
    connect_retries: int = 2  # re-routes after a connection to an instance could not be made
    record_ttl_s: float = 1.0  # how long a function record is reused without asking Redis

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0 or self.connect_retries < 0 or self.record_ttl_s < 0:
            raise ValueError("request_timeout_s must be > 0; connect_retries and record_ttl_s >= 0")


class Invoker:
    """The invocation path of the gateway."""

    def __init__(self, state: ClusterState, router: Routing, metrics: Metrics, config: ProxyConfig) -> None:
        self.state = state
        self.router = router
        self.metrics = metrics
        self.config = config
        self._records: dict[str, tuple[float, FunctionRecord]] = {}  # name -> (fetched at, record)
        self._forgets = 0  # forget() calls so far
        self._last_forget = -math.inf  # when forget() last ran (monotonic s)
        self._urls: dict[tuple[str, str], yarl.URL] = {}
        self._preconnecting: set[asyncio.Task[None]] = set()  # preconnect()'s GETs (kept referenced)
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=POOL_KEEP_ALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),  # workers set no cookies: skip the jar per request
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s, connect=5.0),
            auto_decompress=False,
        )

    async def close(self) -> None:
        for task in list(self._preconnecting):
            task.cancel()
        await self.http.close()

    def preconnect(self, url: str, token: str) -> asyncio.Task[None]:
        """Open, or keep open, an idle pooled connection to the worker at ``url``: a standby,
        which a request may soon be sent to ahead of its activation (runtime.standby_pool).
        That request then does not open one on the cold path (~1 ms on a 2-core host). A
        ``/healthz`` GET in the background; when it fails, no connection is kept, nothing else."""
        task = asyncio.get_running_loop().create_task(self._preconnect(url, token))
        self._preconnecting.add(task)
        task.add_done_callback(self._preconnecting.discard)
        return task

    async def _preconnect(self, url: str, token: str) -> None:
        if self.http.closed:  # closing: an announcement that came too late (nothing to keep)
            return
        health, headers = self._url(url, "/healthz"), {WORKER_TOKEN_HEADER: token}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.http.get(health, headers=headers, timeout=PRECONNECT_TIMEOUT) as resp:
                await resp.read()

    async def record(self, name: str) -> FunctionRecord:
        """The function's record, cached for ``record_ttl_s`` (this gateway's own deploys and
        deletes invalidate it at once; other gateways' are seen within the TTL)."""
        now = time.monotonic()
        hit = self._records.get(name)
        if hit is not None and now - hit[0] < self.config.record_ttl_s:
            return hit[1]
        forgets = self._forgets
        record = await on_loop(lambda retry: self.state.function(name, retry))
        # Not kept when a deploy or delete forgot a record meanwhile (a read in a thread, Redis
        # being away, may predate it), nor over a newer read (records_read's).
        cached = self._records.get(name)
        if self._forgets == forgets and (cached is None or cached[0] < now):
            self._records[name] = (now, record)
        return record

    def _url(self, base: str, path: str) -> yarl.URL:
        """The parsed URL of ``path`` on an instance, cached (yarl parsing costs ~20 us)."""
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:  # instances come and go: bound the cache
                self._urls.clear()
            url = self._urls[key] = yarl.URL(base + path)
        return url

    def forget(self, name: str) -> None:
        """Drop a cached record (after a deploy or delete of ``name``)."""
        self._records.pop(name, None)
        self._forgets += 1
        self._last_forget = time.monotonic()

    def records_read(self, records: Mapping[str, FunctionRecord], read_at: float) -> None:
        """Every function's record as the scheduler's reconcile read them (``read_at``:
        monotonic seconds before the read began; :meth:`scheduler.router.Router.on_records`),
        cached as if this gateway had fetched them then. A request after more than
        ``record_ttl_s`` of idle then takes its function's record without a Redis round trip
        on its path (the first call after idle, ~0.2-0.4 ms on a 2-core host, waking Redis). A
        read that began before a deploy or delete on this gateway forgot a record is not taken
        at all (it may predate that change; the next read is), a record fetched after the
        read began is kept, and one missing from the read is dropped: deleted by another
        gateway."""
        if self._last_forget >= read_at:
            return
        for name, record in records.items():
            cached = self._records.get(name)
            if cached is None or cached[0] < read_at:
                self._records[name] = (read_at, record)
        gone = [name for name, (at, _) in self._records.items() if name not in records and at < read_at]
        for name in gone:
            del self._records[name]

    def deadline(self, timeout_header: str | None) -> float:
        timeout = self.config.request_timeout_s
        if timeout_header:
            try:
                requested = float(timeout_header)
            except ValueError:
                requested = math.nan
            if math.isnan(requested) or requested <= 0:
                raise BadRequest("X-Ember-Timeout must be a positive number of seconds")
            timeout = min(timeout, requested)
        return time.time() + max(0.0, timeout)

    async def forward(
        self, name: str, path: str, body: bytes, route_label: str, timeout: str | None
    ) -> Response:
        """Send ``body`` to ``path`` on an instance of ``name``; returns the response to relay."""
        t0 = time.perf_counter()
        arrived = time.time()
        record = await self.record(name)
        deadline = self.deadline(timeout)
        request_id = uuid.uuid4().hex
        headers = {
            "content-type": "application/json",
            "x-ember-request-id": request_id,
            "x-ember-deadline": f"{deadline:.3f}",
        }
        keep_alive = record.scaling.keep_alive_s
        unreachable = 0  # connections that could not be made (never-ran answers are not counted)
        ended = 0  # never-ran answers of ready instances (that ended with their pool)
        since: float | None = None  # set once the request is routed again
        while True:
            route = await self.router.route(name, record, deadline, since)
            since = arrived
            if not route.cold:
                self.metrics.route.labels(name).observe(time.perf_counter() - t0)
            sent = {**headers, WORKER_TOKEN_HEADER: route.token} if route.token else headers
            if route.early:  # the worker holds it until the instance's activation ends
                sent = {**sent, INSTANCE_HEADER: route.instance_id}
            try:  # returns once the headers are in; the body is read (or relayed) below
                upstream = await self.http.post(self._url(route.url, path), data=body, headers=sent)
            except _NOT_SENT as exc:  # nothing reached the instance: route again
                await self._lost(name, route, keep_alive)
                if unreachable == self.config.connect_retries:
                    raise InvocationError(
                        f"instance {route.instance_id} of {name!r} is unreachable: {exc}"
                    ) from None
                unreachable += 1
                continue
            except BaseException as exc:
                # The request may have reached the worker: never re-send it (at most once).
                with anyio.CancelScope(shield=True):
                    if isinstance(exc, aiohttp.ClientConnectionError | TimeoutError):
                        await self._lost(name, route, keep_alive)  # forgotten if its process died
                    else:  # a malformed response, cancellation: free the slot
                        await self.router.done(
                            name, route, keep_alive, time.perf_counter() - t0, reusable=False
                        )
                if isinstance(exc, aiohttp.ClientError | TimeoutError):
                    self.metrics.requests.labels(name, route_label, "502").inc()
                    self.metrics.errors.labels(name, "instance_failed").inc()
                    raise InvocationError(f"instance {route.instance_id} of {name!r} failed: {exc}") from None
                raise
            # The instance never ran it: its activation failed first (an early route), or it
            # ended with its pool before the request came (runtime.survivors).
            if _never_ran(upstream, route.instance_id):
                upstream.close()  # that worker is being ended, or waits to be assigned again
                if route.early:
                    await self.router.instance_lost(name, route, keep_alive)  # frees the slot
                else:  # (the agent may learn of the pool's death a moment after the worker)
                    await self._lost(name, route, keep_alive)
                    ended += 1
                    if ended > self.config.connect_retries:  # not just ended: never route there
                        self.metrics.requests.labels(name, route_label, "502").inc()
                        self.metrics.errors.labels(name, "instance_failed").inc()
                        raise InvocationError(
                            f"instance {route.instance_id} of {name!r} ended; the request never ran"
                        ) from None
                # Route again, to the process the launch tries next or a ready instance: as
                # often as starts fail for want of room, say, as a waiting request would wait
                # (it never ran; each try is another process's activation), until its deadline.
                if time.time() >= deadline:
                    self.metrics.requests.labels(name, route_label, "502").inc()
                    self.metrics.errors.labels(name, "instance_failed").inc()
                    raise InvocationError(
                        f"no instance of {name!r} started before the request's deadline"
                    ) from None
                continue
            break

        async def finish(status: int, reusable: bool) -> None:
            elapsed = time.perf_counter() - t0
            self.metrics.requests.labels(name, route_label, str(status)).inc()
            self.metrics.latency.labels(name).observe(elapsed)
            await self.router.done(name, route, keep_alive, elapsed, reusable)

        status = upstream.status
        # The worker's own timing, and its Retry-After on a 503 (no KV room, no room in the SLO).
        passed_on = {h: v for h in PASSED_ON if (v := upstream.headers.get(h)) is not None} or None
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                upstream.close()
                await finish(502, False)
                self.metrics.errors.labels(name, "instance_failed").inc()
                raise InvocationError(f"instance {route.instance_id} of {name!r} failed: {exc}") from None
            self.metrics.ttft.labels(name).observe(time.perf_counter() - t0)
            upstream.release()
            if status >= 400:
                self.metrics.errors.labels(name, _error_type(content)).inc()
            return Response(
                content,
                status_code=status,
                headers=passed_on,
                media_type=upstream.headers.get("content-type", "application/json"),
                background=BackgroundTask(finish, status, True),
            )

        async def relay() -> AsyncIterator[bytes]:
            first, complete = True, False
            try:
                async for chunk in upstream.content.iter_any():
                    if first:
                        self.metrics.ttft.labels(name).observe(time.perf_counter() - t0)
                        first = False
                    yield chunk
                complete = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.metrics.errors.labels(name, "instance_failed").inc()
                error = error_body("instance_failed", f"the instance failed mid-stream: {exc}")
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                await self._lost(name, route, None)
            finally:
                # Shielded: when the client hangs up, Starlette cancels this generator, and the
                # slot must still be released and the upstream connection closed.
                with anyio.CancelScope(shield=True):
                    if complete:
                        upstream.release()  # the connection goes back to the pool
                    else:
                        upstream.close()  # abandoned: the worker must see the hang-up and stop
                    await finish(status, complete)

        return StreamingResponse(
            relay(),
            status_code=status,
            headers=passed_on,
            media_type="text/event-stream",
        )

    async def _lost(self, name: str, route: Route, keep_alive: float | None) -> None:
        """The instance behind ``route`` did not answer: forget it if its process is gone
        (:meth:`Router.instance_lost`), else free the slot (when ``keep_alive`` is given)."""
        await asyncio.sleep(0.05)  # let the agent's child watcher notice the exit
        await self.router.instance_lost(name, route, keep_alive)


def _never_ran(upstream: aiohttp.ClientResponse, instance_id: str) -> bool:
    """Whether a worker answered that a request for ``instance_id`` never ran: held for an
    activation that failed, or come after the instance ended with its pool
    (:data:`scheduler.launcher.NEVER_RAN_HEADER`, with the 503
    :data:`~scheduler.launcher.NOT_STARTED`)."""
    return upstream.status == 503 and upstream.headers.get(NEVER_RAN_HEADER) == instance_id


def _error_type(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


def request_model(parsed: Any) -> str:
    """The function an OpenAI request (its parsed body) names in ``model`` (``FUNCTION`` or
    ``FUNCTION:ADAPTER``), or a :class:`SchedulerError` (HTTP 400 / 404)."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str) or not parsed["model"]:
        raise BadRequest("model: the name of a deployed function is required")
    if not parsed["model"].isascii():  # function names are DNS labels; this also keeps lone surrogates out
        raise FunctionNotFound(f"function {parsed['model']!r} is not deployed")
    # FUNCTION:ADAPTER selects one of the function's LoRA adapters (its instance checks the name).
    return str(parsed["model"]).partition(":")[0]


class BadRequest(SchedulerError):
    """A malformed invocation (HTTP 400)."""

    code = "invalid_request_error"
