"""At-most-once delivery with early routes (pipelined activation): a request sent to an
instance still being activated names it, and only there does the worker's 503 ``not_started``
with the never-ran header naming that instance (the activation failed: the request never ran)
make the gateway route the request again. Any other answer (a 503 ``not_started`` body alone,
as a handler's error could carry, or the header naming another instance), and any answer
from an ordinary route, is relayed as it is. Real sockets: an
HTTP server stands in for the workers' side of the wire, a real redis-server holds the record."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from gateway.metrics import Metrics
from gateway.proxy import WORKER_TOKEN_HEADER, InvocationError, Invoker, ProxyConfig
from runtime.errors import error_body
from scheduler.launcher import INSTANCE_HEADER, NEVER_RAN_HEADER, NOT_STARTED
from scheduler.records import FunctionRecord
from scheduler.router import Route
from scheduler.state import ClusterState
from tests.scheduler.test_reclaim import deploy


class ScriptedRouting:
    """Hands out ``routes`` in order and records what the invoker reports back."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes
        self.done_calls: list[tuple[str, bool]] = []  # (instance id, reusable)
        self.since: list[float | None] = []  # what each route() was told
        self.lost_calls: list[tuple[str, bool]] = []  # (instance id, slot freed)

    async def route(
        self, name: str, record: FunctionRecord, deadline: float, since: float | None = None
    ) -> Route:
        self.since.append(since)
        return self.routes.pop(0)

    async def done(
        self, name: str, route: Route, keep_alive_s: float, service_s: float, reusable: bool = True
    ) -> None:
        self.done_calls.append((route.instance_id, reusable))

    async def instance_lost(self, name: str, lost: Route, keep_alive_s: float | None = None) -> bool:
        self.lost_calls.append((lost.instance_id, keep_alive_s is not None))
        return False

    async def retire(self, name: str) -> None:
        return None


@asynccontextmanager
async def workers() -> AsyncIterator[tuple[str, list[tuple[str, str | None]]]]:
    """A server whose ``/never/...`` answers as a worker whose activation failed (503
    ``not_started``, the never-ran header naming the request's instance, or "1"), ``/body/...``
    the same body without the header, ``/other/...`` the header naming another instance,
    ``/busy/...`` 503 with another error, and ``/ok/...`` 200. Yields its URL and the (path,
    instance header) of each request."""
    seen: list[tuple[str, str | None]] = []

    async def answer(request: web.Request) -> web.Response:
        instance_id = request.headers.get(INSTANCE_HEADER)
        seen.append((request.path, instance_id))
        kind = request.path.split("/")[1]
        if kind == "ok":
            return web.json_response({"served_by": request.path})
        code = "kv_cache_exhausted" if kind == "busy" else NOT_STARTED
        headers = {"never": {NEVER_RAN_HEADER: instance_id or "1"}, "other": {NEVER_RAN_HEADER: "7"}}
        return web.json_response(error_body(code, "no"), status=503, headers=headers.get(kind))

    app = web.Application()
    app.router.add_post("/{kind}/invoke", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def test_a_request_that_never_ran_is_routed_again(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)

    async def scenario() -> None:
        async with workers() as (url, seen):
            routing = ScriptedRouting(
                [Route("1", f"{url}/never", True, 0.0, early=True), Route("2", f"{url}/ok", True, 0.0)]
            )
            invoker = Invoker(state, routing, Metrics(), ProxyConfig())
            try:
                response = await invoker.forward("f", "/invoke", b"{}", "invoke", None)
                assert response.status_code == 200
                assert json.loads(bytes(response.body)) == {"served_by": "/ok/invoke"}
                # The early route named its instance; the slot it held was freed at once.
                assert seen == [("/never/invoke", "1"), ("/ok/invoke", None)]
                assert routing.lost_calls == [("1", True)] and routing.done_calls == []
                # Routed again as the request it is: a start that failed since it arrived fails it.
                first, again = routing.since
                assert first is None and again is not None and again <= time.time()
            finally:
                await invoker.close()

    asyncio.run(scenario())


def test_other_answers_and_ordinary_routes_are_relayed_as_they_are(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)

    async def scenario() -> None:
        async with workers() as (url, seen):
            routing = ScriptedRouting(
                [
                    Route("1", f"{url}/busy", True, 0.0, early=True),  # another 503: relayed
                    Route("2", f"{url}/body", True, 0.0, early=True),  # no header: it may have run
                    Route("3", f"{url}/other", True, 0.0, early=True),  # another instance's header
                    Route("4", f"{url}/never", False, 0.0),  # not early: never re-sent
                ]
            )
            invoker = Invoker(state, routing, Metrics(), ProxyConfig())
            try:
                for expected in ("kv_cache_exhausted", NOT_STARTED, NOT_STARTED, NOT_STARTED):
                    response = await invoker.forward("f", "/invoke", b"{}", "invoke", None)
                    assert response.status_code == 503
                    assert json.loads(bytes(response.body))["error"]["type"] == expected
                    assert response.background is not None
                    await response.background()  # the slot is released once relayed
                assert [path for path, _ in seen] == [
                    f"/{k}/invoke" for k in ("busy", "body", "other", "never")
                ]
                assert routing.done_calls == [(i, True) for i in ("1", "2", "3", "4")]
                assert routing.lost_calls == []
            finally:
                await invoker.close()

    asyncio.run(scenario())


def test_never_ran_answers_use_no_retry_and_end_at_the_deadline(state: ClusterState) -> None:
    """A request that never ran is routed again as often as activations fail (as a waiting
    request waits through failed starts), not within the budget for unreachable instances, and
    gets one clear error once its deadline passed."""
    deploy(state, "f", 1 << 20)

    async def scenario() -> None:
        async with workers() as (url, _):
            config = ProxyConfig(connect_retries=0)
            never = [Route(str(i), f"{url}/never", True, 0.0, early=True) for i in range(3)]
            routing = ScriptedRouting([*never, Route("9", f"{url}/ok", False, 0.0)])
            invoker = Invoker(state, routing, Metrics(), config)
            try:
                response = await invoker.forward("f", "/invoke", b"{}", "invoke", None)
                assert response.status_code == 200 and len(routing.lost_calls) == 3
                # Activations that keep failing: one error once the deadline passed.
                routing.routes = [Route(str(i), f"{url}/never", True, 0.0, early=True) for i in range(10000)]
                t0 = time.monotonic()
                try:
                    await invoker.forward("f", "/invoke", b"{}", "invoke", "0.3")
                except InvocationError as exc:
                    assert "before the request's deadline" in str(exc)
                else:
                    raise AssertionError("no error")
                assert 0.25 < time.monotonic() - t0 < 5.0
            finally:
                await invoker.close()

    asyncio.run(scenario())


def test_a_preconnected_worker_takes_its_early_request_on_the_connection_already_open(
    state: ClusterState,
) -> None:
    """``Invoker.preconnect`` (a standby announced by the agent) leaves an idle connection that
    the request sent ahead of the activation then uses: no connection is opened on the cold
    path. A worker that cannot be reached is no error (nothing is kept)."""
    deploy(state, "f", 1 << 20)

    async def scenario() -> None:
        peers: list[tuple[str, int, str | None]] = []  # (path, client port, worker token)

        async def answer(request: web.Request) -> web.Response:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            assert peer is not None
            peers.append((request.path, int(peer[1]), request.headers.get(WORKER_TOKEN_HEADER)))
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_get("/healthz", answer)
        app.router.add_post("/invoke", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        with socket.socket() as probe:  # a port nobody listens on
            probe.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
        routing = ScriptedRouting([Route("1", url, True, 0.0, "worker-token", early=True)])
        invoker = Invoker(state, routing, Metrics(), ProxyConfig())
        try:
            await invoker.preconnect(closed, "worker-token")
            await invoker.preconnect(url, "worker-token")
            response = await invoker.forward("f", "/invoke", b"{}", "invoke", None)
            assert response.status_code == 200
            (health, invoke) = peers
            assert health[0] == "/healthz" and health[2] == "worker-token"
            assert invoke[0] == "/invoke" and invoke[2] == "worker-token"
            assert invoke[1] == health[1]  # the same client port: the connection preconnect opened
            await invoker.close()
            await invoker.preconnect(url, "worker-token")  # announced while closing: nothing, no error
            assert len(peers) == 2
        finally:
            await invoker.close()
            await runner.cleanup()

    asyncio.run(scenario())
