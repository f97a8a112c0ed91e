"""TIDAL early reject: a request that cannot start before its deadline gets 503 + Retry-After at once."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.gateway.conftest import chat_spec, instances, wait_for

pytestmark = pytest.mark.slow


def ask(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "single",
        "messages": [{"role": "user", "content": "Tell me a long story about the moon."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def test_busy_function_at_max_scale_rejects_early(http: httpx.Client) -> None:
    spec = chat_spec("single", keep_alive="60s", max_scale=1, concurrency=1)
    assert http.post("/v1/functions", json=spec).status_code == 201
    t0 = time.monotonic()
    assert http.post("/v1/chat/completions", json=ask(48)).status_code == 200  # learns the service time
    service_s = time.monotonic() - t0
    occupied = threading.Event()
    results: list[int] = []

    def occupy() -> None:
        with (
            httpx.Client(base_url=str(http.base_url), timeout=300) as other,
            other.stream("POST", "/v1/chat/completions", json=ask(96, stream=True)) as resp,
        ):
            occupied.set()
            resp.read()
            results.append(resp.status_code)

    worker = threading.Thread(target=occupy)
    worker.start()
    occupied.wait(60)
    wait_for(lambda: instances(http, "single")[0]["in_flight"] == 1, timeout=10)
    timeout = max(0.2, service_s / 4)  # far less than one request's service time
    t1 = time.monotonic()
    rejected = http.post("/v1/chat/completions", json=ask(8), headers={"X-Ember-Timeout": f"{timeout:.2f}"})
    elapsed = time.monotonic() - t1
    assert rejected.status_code == 503, rejected.text
    assert rejected.json()["error"]["type"] == "rejected" and int(rejected.headers["retry-after"]) >= 1
    assert elapsed < timeout  # rejected up front, not after waiting out the deadline
    worker.join(300)
    assert results == [200]  # the running request was not disturbed


def test_deadline_already_too_short_for_a_cold_start(http: httpx.Client) -> None:
    assert http.post("/v1/functions", json=chat_spec("cold-only", keep_alive="1s")).status_code == 201
    body = {**ask(4), "model": "cold-only"}
    rejected = http.post("/v1/chat/completions", json=body, headers={"X-Ember-Timeout": "0.001"})
    assert rejected.status_code == 503 and rejected.json()["error"]["type"] == "rejected"
    assert instances(http, "cold-only") == []  # nothing was started for it
