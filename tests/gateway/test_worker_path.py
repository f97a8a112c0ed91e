"""The gateway -> worker path through a real ``ember serve`` (issue 10): delivery at most once,
the instance's credential on every forwarded request (never shown), the workers' health in
``/v1/cluster``, and OpenAI fields Ember does not implement answered 400."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.spawn import ServeProcess
from tests.gateway.conftest import chat_spec, instances

pytestmark = pytest.mark.slow

CRASHING_HANDLER = """
import os


def handler(event, context):
    with open({marker!r}, "a") as f:
        f.write("ran\\n")
    os._exit(1)  # the function's code takes its worker down
"""


def test_a_request_that_crashes_its_worker_runs_once(
    server: ServeProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Not tmp_path: made after the workers were sandboxed, beside an ancestor of EMBER_HOME, it is
    # unwritable to them (runtime.sandbox); EMBER_HOME/tmp is their TMPDIR.
    marker = server.home / "tmp" / "crashing-runs.txt"
    module = tmp_path / "crashing.py"
    module.write_text(CRASHING_HANDLER.format(marker=str(marker)))
    document = chat_spec("crashing", keep_alive="30s")
    document["spec"]["handler"] = f"{module}:handler"
    assert http.post("/v1/functions", json=document).status_code == 201
    resp = http.post("/v1/functions/crashing/invoke", json={})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["type"] == "instance_failed"
    assert marker.read_text().splitlines() == ["ran"]  # delivered once, never re-sent
    assert http.delete("/v1/functions/crashing").status_code == 204


def test_forwarded_requests_carry_the_instance_credential_which_is_never_shown(
    server: ServeProcess, http: httpx.Client
) -> None:
    assert http.post("/v1/functions", json=chat_spec("guarded", keep_alive="30s")).status_code == 201
    ask = {"model": "guarded", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=ask).status_code == 200  # the gateway gets in
    (instance,) = instances(http, "guarded")
    assert "token" not in instance
    direct = httpx.post(f"{instance['url']}/v1/chat/completions", json=ask, timeout=30)
    assert direct.status_code == 401  # a local process without the credential does not
    assert direct.json()["error"]["type"] == "unauthorized"
    (device,) = http.get("/v1/cluster").json()["devices"].values()
    assert device["worker_failures"] == 0 and device["backoff_s"] == 0  # workers start fine
    unimplemented = http.post("/v1/chat/completions", json={**ask, "best_of": 3})
    error = unimplemented.json()["error"]
    assert unimplemented.status_code == 400 and error["message"].startswith("best_of:")
    assert (error["param"], error["code"]) == ("best_of", "unsupported_parameter")  # through the gateway
    assert http.delete("/v1/functions/guarded").status_code == 204
