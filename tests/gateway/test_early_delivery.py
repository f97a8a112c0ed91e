"""At-most-once delivery with early routes (pipelined activation): a request sent to an
instance still being activated names it, and only there does the worker's 503 ``not_started``
(the activation failed: the request never ran) make the gateway route the request again. Any
other answer, and that answer from an ordinary route, is relayed as it is. Real sockets: an
HTTP server stands in for the workers' side of the wire, a real redis-server holds the record."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from gateway.metrics import Metrics
from gateway.proxy import InvocationError, Invoker, ProxyConfig
from runtime.errors import error_body
from scheduler.launcher import INSTANCE_HEADER, NOT_STARTED
from scheduler.records import FunctionRecord
from scheduler.router import Route
from scheduler.state import ClusterState
from tests.scheduler.test_reclaim import deploy


class ScriptedRouting:
    """Hands out ``routes`` in order and records what the invoker reports back."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes
        self.done_calls: list[tuple[str, bool]] = []  # (instance id, reusable)

    async def route(self, name: str, record: FunctionRecord, deadline: float) -> Route:
        return self.routes.pop(0)

    async def done(
        self, name: str, route: Route, keep_alive_s: float, service_s: float, reusable: bool = True
    ) -> None:
        self.done_calls.append((route.instance_id, reusable))

    async def instance_lost(self, name: str, lost: Route, keep_alive_s: float | None = None) -> bool:
        raise AssertionError("no instance is lost in these tests")

    async def retire(self, name: str) -> None:
        return None


@asynccontextmanager
async def workers() -> AsyncIterator[tuple[str, list[tuple[str, str | None]]]]:
    """A server whose ``/never/...`` answers 503 ``not_started`` and ``/busy/...`` 503 with
    another error; ``/ok/...`` answers 200. Yields its URL and the (path, instance header) seen."""
    seen: list[tuple[str, str | None]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get(INSTANCE_HEADER)))
        kind = request.path.split("/")[1]
        if kind == "ok":
            return web.json_response({"served_by": request.path})
        code = NOT_STARTED if kind == "never" else "kv_cache_exhausted"
        return web.json_response(error_body(code, "no"), status=503)

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
                assert routing.done_calls == [("1", False)]
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
                    Route("2", f"{url}/never", False, 0.0),  # not early: never re-sent
                ]
            )
            invoker = Invoker(state, routing, Metrics(), ProxyConfig())
            try:
                for expected in ("kv_cache_exhausted", NOT_STARTED):
                    response = await invoker.forward("f", "/invoke", b"{}", "invoke", None)
                    assert response.status_code == 503
                    assert json.loads(bytes(response.body))["error"]["type"] == expected
                    assert response.background is not None
                    await response.background()  # the slot is released once relayed
                assert [path for path, _ in seen] == ["/busy/invoke", "/never/invoke"]
                assert routing.done_calls == [("1", True), ("2", True)]
            finally:
                await invoker.close()

    asyncio.run(scenario())


def test_every_attempt_that_never_ran_ends_in_one_clear_error(state: ClusterState) -> None:
    deploy(state, "f", 1 << 20)

    async def scenario() -> None:
        async with workers() as (url, _):
            config = ProxyConfig(connect_retries=1)
            routing = ScriptedRouting([Route(str(i), f"{url}/never", True, 0.0, early=True) for i in (1, 2)])
            invoker = Invoker(state, routing, Metrics(), config)
            try:
                t0 = time.monotonic()
                try:
                    await invoker.forward("f", "/invoke", b"{}", "invoke", None)
                except InvocationError as exc:
                    assert "did not start" in str(exc)
                else:
                    raise AssertionError("no error")
                assert time.monotonic() - t0 < 5.0
                assert routing.done_calls == [("1", False), ("2", False)] and routing.routes == []
            finally:
                await invoker.close()

    asyncio.run(scenario())
