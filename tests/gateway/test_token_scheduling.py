"""Co-located instances on the CPU device run token by token (LLM-Mesh §5, ``runtime.mesh``).

With ``EMBER_TOKEN_SCHEDULING=on`` two functions' instances share the CPU device: every
iteration of either waits for the agent's grant, and both answer concurrent streams in full.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.zoo import Zoo, function_spec
from gateway.spawn import ServeProcess
from tests.gateway.conftest import serve_zoo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(zoo: Zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    env = {"EMBER_PREWARM": "2", "EMBER_STANDBY": "0", "EMBER_TOKEN_SCHEDULING": "on"}
    with serve_zoo(zoo, tmp_path_factory.mktemp("home"), env, ["tiny-a-bf16", "tiny-e-bf16"]) as proc:
        yield proc


def cpu_tokens(http: httpx.Client) -> dict[str, Any]:
    devices = http.get("/v1/cluster").json()["devices"]
    (cpu,) = [d for d in devices.values() if d["device"] == "cpu"]
    return dict(cpu["token_scheduling"])


def test_two_functions_share_the_cpu_token_by_token(server: ServeProcess) -> None:
    results: dict[str, list[int]] = {}

    def stream(model: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for _ in range(2):
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                usage = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
                results.setdefault(model, []).append(usage[-1])

    threads = [threading.Thread(target=stream, args=(m,)) for m in ("tiny-a-bf16", "tiny-e-bf16")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == {"tiny-a-bf16": [24, 24], "tiny-e-bf16": [24, 24]}  # every token
    with httpx.Client(base_url=server.url, timeout=30) as http:
        deadline = time.monotonic() + 10
        tokens = cpu_tokens(http)
        while tokens["instances"] < 2 and time.monotonic() < deadline:  # reports come every second
            time.sleep(0.5)
            tokens = cpu_tokens(http)
        assert tokens["instances"] == 2
        assert tokens["grants"] >= 2  # both instances were granted the device


def test_a_request_the_device_cannot_serve_within_its_slo_gets_a_clear_503(
    server: ServeProcess, zoo: Zoo
) -> None:
    """Shadow validation (LLM-Mesh §5.3): while another function streams on the device, a
    function whose SLO the device cannot meet has its requests refused before any byte of an
    answer, with Retry-After, once their first token could no longer come in time; the other
    function keeps serving."""
    spec = function_spec(zoo.model("tiny-a-bf16"), keep_alive="60s")
    spec["metadata"] = {"name": "impatient"}
    # No decode iteration takes 0.1 ms: one token per TPOT is out of reach (shadow case 3).
    spec["spec"]["slo"] = {"ttft": "300ms", "tpot": "0.1ms"}  # type: ignore[index]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/functions", json=spec).status_code == 201
        alone = http.post("/v1/chat/completions", json={**body, "model": "impatient"})
        assert alone.status_code == 200, alone.text  # nobody else on the device: admitted anyway
        streaming = threading.Event()

        def neighbour() -> None:  # a long stream of another function keeps the device busy
            long = {**body, "model": "tiny-e-bf16", "max_tokens": 256, "ignore_eos": True, "stream": True}
            with (
                httpx.Client(base_url=server.url, timeout=120) as own,
                own.stream("POST", "/v1/chat/completions", json=long) as r,
            ):
                for _ in r.iter_lines():
                    streaming.set()

        busy = threading.Thread(target=neighbour)
        busy.start()
        assert streaming.wait(60)
        refused = http.post("/v1/chat/completions", json={**body, "model": "impatient"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "slo_unattainable"
        assert refused.headers["retry-after"] == "1"
        busy.join(120)
        served = http.post("/v1/chat/completions", json={**body, "model": "tiny-a-bf16"})
        assert served.status_code == 200, served.text
        deadline = time.monotonic() + 10
        while cpu_tokens(http).get("refused", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cpu_tokens(http)["refused"] >= 1
