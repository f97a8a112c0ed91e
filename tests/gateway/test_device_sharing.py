"""One instance per device at a time (``EMBER_INSTANCES_PER_DEVICE=1``): the baseline that
LLM-Mesh's co-location is measured against (ServerlessLLM's one model per device).

A request for a second function waits while the first function's instance is busy, then the
idle instance is stopped and the second starts on the freed device: never two instances on
the device at once, and no request refused for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.zoo import Zoo
from gateway.spawn import ServeProcess
from tests.gateway.conftest import serve_zoo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(zoo: Zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    env = {"EMBER_PREWARM": "2", "EMBER_STANDBY": "0", "EMBER_INSTANCES_PER_DEVICE": "1"}
    with serve_zoo(zoo, tmp_path_factory.mktemp("home"), env, ["tiny-a-bf16", "tiny-e-bf16"]) as proc:
        yield proc


def live_instances(http: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    functions = http.get("/v1/cluster").json()["functions"]
    return {
        name: [i for i in fn["instances"] if i["state"] in ("starting", "ready")]
        for name, fn in functions.items()
    }


def test_functions_take_turns_on_the_device(server: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # never two live instances on the device
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while not stop.is_set():
                seen.append(sum(len(v) for v in live_instances(http).values()))
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post("/v1/chat/completions", json={**body, "model": "tiny-a-bf16", "max_tokens": 4})
            assert r.status_code == 200, r.text
            # tiny-a's instance is busy with a long answer: tiny-e waits for it, then takes the device.
            results: dict[str, int] = {}

            def ask(model: str, max_tokens: int) -> None:
                with httpx.Client(base_url=server.url, timeout=120) as own:
                    resp = own.post(
                        "/v1/chat/completions", json={**body, "model": model, "max_tokens": max_tokens}
                    )
                    results[model] = resp.status_code

            long = threading.Thread(target=ask, args=("tiny-a-bf16", 200))
            long.start()
            time.sleep(0.3)
            ask("tiny-e-bf16", 4)
            long.join(120)
            assert results == {"tiny-a-bf16": 200, "tiny-e-bf16": 200}
            now = live_instances(http)
            assert len(now.get("tiny-e-bf16", [])) == 1 and not now.get("tiny-a-bf16")
    finally:
        stop.set()
        watcher.join()
    assert seen and max(seen) == 1, seen
