"""``/readyz`` on a management-only gateway: Redis readiness, no key needed, nothing revealed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState

KEY = "k" * 32


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, ClusterState]]:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    state = ClusterState.from_url(server.url)
    try:
        yield server, state
    finally:
        state.close()
        server.stop()


def test_readyz_needs_no_key_and_tells_only_readiness(served: tuple[EmbeddedRedis, ClusterState]) -> None:
    server, state = served
    with TestClient(create_app(state, GatewayConfig(api_key=KEY))) as http:
        assert http.get("/v1/functions").status_code == 401  # the key still guards the rest
        resp = http.get("/readyz")
        assert resp.status_code == 200
        assert resp.json() == {
            "status": "ready",
            "components": {"redis": "ready", "pools": "ready", "warm_worker": "ready"},
        }
        server.stop()  # Redis away: not ready, with Retry-After, and no error text from Redis
        resp = http.get("/readyz")
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json() == {
            "status": "not_ready",
            "components": {"redis": "not_ready", "pools": "ready", "warm_worker": "ready"},
            "error": {"type": "not_ready", "message": "not ready: redis"},
        }
        assert http.get("/healthz").status_code == 200  # liveness is not readiness
        assert "/readyz" not in http.get("/openapi.json").text
