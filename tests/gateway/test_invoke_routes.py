"""One invocation implementation: the routes FastAPI declares (OpenAPI, 405 for other
methods) run the same code as the fast path that claims them ahead of FastAPI's routing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, Serving, create_app
from gateway.errors import HANDLED, Unauthorized, render_error
from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig, request_model
from gateway.routes.invoke import Invocations, invoke_routes
from gateway.tenants import Authenticator, Principal, TenantKeys
from scheduler.redis_server import EmbeddedRedis
from scheduler.router import Router
from scheduler.state import ClusterState
from tests.scheduler.test_leases import RoutingOnlyLauncher

KEY = "invoke-routes-" + "k" * 20
PATHS = ("/v1/functions/missing/invoke", "/v1/chat/completions", "/v1/completions")


@pytest.fixture
def app_and_state(redis_server: EmbeddedRedis) -> Iterator[tuple[Any, ClusterState, Invoker]]:
    state = ClusterState.from_url(redis_server.url)
    router = Router(state, RoutingOnlyLauncher())

    async def make_invoker() -> Invoker:
        return Invoker(state, router, Metrics(), ProxyConfig())

    invoker = asyncio.run(make_invoker())

    async def register(source: str, dtype: str) -> dict[str, Any]:
        raise AssertionError("nothing is deployed in these tests")

    try:
        serving = Serving(register, router, invoker, Metrics())
        yield create_app(state, GatewayConfig(api_key=KEY), serving), state, invoker
    finally:
        asyncio.run(invoker.close())
        state.close()


def declared_only(state: ClusterState, invoker: Invoker) -> FastAPI:
    """An app with only the declared invocation routes, authenticating with the admin key."""

    async def check_key(authorization: str) -> Principal:
        who = await Authenticator(KEY, TenantKeys(state)).principal(authorization)
        if who is None:
            raise Unauthorized("missing or wrong API key (send Authorization: Bearer KEY)")
        return who

    app = FastAPI()
    app.include_router(invoke_routes(Invocations(invoker, check_key, render_error, HANDLED)))
    return app


def test_declared_invoke_routes_answer_like_the_fast_path(
    app_and_state: tuple[Any, ClusterState, Invoker],
) -> None:
    app = app_and_state[0]
    body = {"model": "missing", "messages": [], "prompt": "x"}
    # The declared routes alone, without the fast-path middleware in front of them.
    with TestClient(app) as full, TestClient(declared_only(app_and_state[1], app_and_state[2])) as declared:
        for path in PATHS:
            answers = []
            for http in (full, declared):
                denied = http.post(path, json=body)
                missing = http.post(path, json=body, headers={"authorization": f"Bearer {KEY}"})
                answers.append((denied.status_code, denied.json(), missing.status_code, missing.json()))
            assert answers[0] == answers[1], path
            assert answers[0][0] == 401 and answers[0][2] == 404, answers[0]
        assert full.get("/v1/completions", headers={"authorization": f"Bearer {KEY}"}).status_code == 405
        paths = full.get("/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()["paths"]
        assert all("post" in paths[p] for p in ("/v1/functions/{name}/invoke", *PATHS[1:]))


def test_an_adapter_request_routes_to_its_function() -> None:
    """``FUNCTION:ADAPTER`` (a LoRA adapter of the function) routes like ``FUNCTION``."""
    assert request_model({"model": "chat:french"}) == "chat"
    assert request_model({"model": "team-a/chat:french"}) == "team-a/chat"
    assert request_model({"model": "chat"}) == "chat"
