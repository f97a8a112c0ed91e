"""Supervision: a SIGKILLed redis-server or pool daemon heals; ``/readyz`` tells readiness."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from bench.procs import alive, child_pids, kill
from gateway.spawn import ServeProcess
from gpu_pool.client import PoolClient
from tests.gateway.conftest import chat_spec, instances, wait_for

pytestmark = pytest.mark.slow

ASK = {"model": "kept", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def functions(http: httpx.Client) -> list[str]:
    resp = http.get("/v1/functions")
    assert resp.status_code == 200, resp.text
    return [f["metadata"]["name"] for f in resp.json()["functions"]]


def test_readyz_when_ready(server: ServeProcess, http: httpx.Client) -> None:
    wait_for(lambda: http.get("/readyz").status_code == 200, timeout=120)  # a warm worker is up
    assert http.get("/readyz").json() == {
        "status": "ready",
        "components": {"redis": "ready", "pools": "ready", "warm_worker": "ready"},
    }
    assert http.get("/healthz").json() == {"status": "ok"}


def test_redis_killed_restarts_without_losing_functions(server: ServeProcess, http: httpx.Client) -> None:
    assert http.post("/v1/functions", json=chat_spec("kept", keep_alive="60s")).status_code == 201
    (victim,) = child_pids(server.proc.pid, "redis-server")
    kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=5) as quick:
        assert functions(quick) == ["kept"]  # Redis retries bridge the restart
    assert time.monotonic() - t0 < 5
    (restarted,) = child_pids(server.proc.pid, "redis-server")
    assert restarted != victim


def test_readyz_names_an_unanswering_redis(server: ServeProcess, http: httpx.Client) -> None:
    (redis_pid,) = child_pids(server.proc.pid, "redis-server")
    kill(redis_pid, signal.SIGSTOP)  # alive but silent: not restarted, not ready
    try:
        resp = http.get("/readyz")
    finally:
        kill(redis_pid, signal.SIGCONT)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    body = resp.json()
    assert body["status"] == "not_ready" and body["components"]["redis"] == "not_ready"
    assert body["error"] == {"type": "not_ready", "message": "not ready: redis"}
    wait_for(lambda: http.get("/readyz").status_code == 200, timeout=10)


def test_pool_killed_fails_its_instances_and_heals(server: ServeProcess, http: httpx.Client) -> None:
    if "kept" not in functions(http):
        assert http.post("/v1/functions", json=chat_spec("kept", keep_alive="60s")).status_code == 201
    assert http.post("/v1/chat/completions", json=ASK).status_code == 200
    (instance,) = instances(http, "kept")
    wait_for(lambda: http.get("/readyz").status_code == 200, timeout=120)  # a warm worker again
    (pool_pid,) = child_pids(server.proc.pid, "gpu_pool")

    kill(pool_pid, signal.SIGKILL)
    t0 = time.monotonic()
    seen: list[tuple[int, str]] = []

    def listed() -> bool:
        return instance["id"] in {i["id"] for i in instances(http, "kept")}

    while time.monotonic() - t0 < 30 and (listed() or len(seen) < 20):
        resp = http.get("/readyz")
        seen.append((resp.status_code, resp.json()["components"]["pools"]))
        time.sleep(0.05)
    assert not listed()  # failed fast: its pool session is gone
    assert alive(int(instance["pid"]))  # its worker waits to serve the function again
    assert (503, "not_ready") in seen  # until the new daemon serves
    wait_for(lambda: http.post("/v1/chat/completions", json=ASK).status_code == 200, timeout=60, interval=0.2)
    healed_s = time.monotonic() - t0
    print(f"pool SIGKILL: requests succeed again after {healed_s:.1f} s")
    (new,) = instances(http, "kept")
    assert new["id"] != instance["id"] and int(new["bytes_loaded"]) > 0  # weights reloaded
    assert new["pid"] == instance["pid"]  # in the same worker (runtime.survivors)
    (new_pool,) = child_pids(server.proc.pid, "gpu_pool")
    assert new_pool != pool_pid
    with PoolClient(server.pool_socket) as pool:  # same socket path, the new daemon serves it
        assert pool.stats()["capacity_bytes"] > 0
    assert http.get("/readyz").json()["components"]["pools"] == "ready"
    assert healed_s < 20  # ~5 s on an idle machine: pool start, then weights loaded again
