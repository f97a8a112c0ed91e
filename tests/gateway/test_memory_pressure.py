"""A cold start whose model does not fit next to other functions' idle instances.

The pool holds one tiny model at a time (an 8 MiB arena, models of ~6.4 MB). An idle
instance of another function holds its model pinned until its keep-alive (60 s here) runs
out; a request for a second function must not be refused for that (it used to get 503 "no
device can hold"): the router stops the idle instance, whose weights stay resident and
evictable, and starts the new one. A busy instance is waited for instead, and a model larger
than every pool is still refused at once, without stopping anything first.
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
    env = {"EMBER_ARENA": "8MiB", "EMBER_PREWARM": "2", "EMBER_STANDBY": "0"}
    with serve_zoo(
        zoo, tmp_path_factory.mktemp("home"), env, ["tiny-a-bf16", "tiny-e-bf16", "tiny-d-q4"]
    ) as proc:
        yield proc


def chat(http: httpx.Client, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return http.post("/v1/chat/completions", json={**body, "ignore_eos": True})


def instances(http: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    functions = http.get("/v1/cluster").json()["functions"]
    return {name: fn["instances"] for name, fn in functions.items()}


def test_an_idle_instance_makes_room_and_a_busy_one_is_waited_for(server: ServeProcess, zoo: Zoo) -> None:
    assert zoo.model("tiny-a-bf16").nbytes + zoo.model("tiny-e-bf16").nbytes > 8 << 20  # one at a time
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = chat(http, "tiny-a-bf16")
        assert r.status_code == 200, r.text
        (a,) = instances(http)["tiny-a-bf16"]
        r = chat(http, "tiny-e-bf16")  # tiny-a-bf16's instance is idle for 60 s more: it yields
        assert r.status_code == 200, r.text
        now = instances(http)
        assert a["id"] not in {i["id"] for i in now["tiny-a-bf16"]}
        assert len(now["tiny-e-bf16"]) == 1

        # Now tiny-e-bf16's instance is busy with a long answer: a request for tiny-a-bf16
        # waits for it to finish, then takes its room (no 503).
        long: list[httpx.Response] = []

        def busy_request() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as other:
                long.append(chat(other, "tiny-e-bf16", 256))

        busy = threading.Thread(target=busy_request)
        busy.start()
        time.sleep(0.3)
        r = chat(http, "tiny-a-bf16")
        busy.join()
        assert r.status_code == 200, r.text
        assert long and long[0].status_code == 200, long[0].text if long else "no answer"
        assert long[0].json()["usage"]["completion_tokens"] == 256


def test_a_model_larger_than_every_pool_is_refused_at_once(server: ServeProcess, zoo: Zoo) -> None:
    assert zoo.model("tiny-d-q4").nbytes > 8 << 20
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = chat(http, "tiny-a-bf16")
        assert r.status_code == 200, r.text
        idle = [i["id"] for i in instances(http)["tiny-a-bf16"]]
        assert idle
        time.sleep(0.5)  # past the gateway's slot lease (0.25 s): the instance is idle now
        t0 = time.monotonic()
        r = chat(http, "tiny-d-q4")
        assert r.status_code == 503, r.text
        assert "larger than every pool" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5
        # Stopping other functions' idle instances could not have made room: none was stopped.
        assert [i["id"] for i in instances(http)["tiny-a-bf16"]] == idle
