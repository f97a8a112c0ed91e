"""The extender over HTTP: ``ember extender`` as a real process over a real Redis, and mounted
in the gateway's app."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayConfig, create_app
from gateway.extender import ExtenderServeConfig, extender_app, extender_for
from gateway.limits import EdgeLimits
from gateway.spawn import ExtenderProcess
from scheduler import cluster_keys
from scheduler.errors import StateUnavailable
from scheduler.extender.service import ExtenderConfig
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


def args(nodes: list[str], model: str = "m", weight: int = 100 * MB) -> dict[str, Any]:
    annotations = {cluster_keys.ANNOTATION_MODEL: model, cluster_keys.ANNOTATION_WEIGHT_BYTES: str(weight)}
    pod = {"metadata": {"name": "chat-1", "namespace": "ember-fn", "annotations": annotations}}
    return {"Pod": pod, "NodeNames": nodes}


def seed(state: ClusterState) -> None:
    common = {"evictable_bytes": 0, "load_bandwidth": 1e9}
    state.report_device("warm/cpu", {"free_bytes": 0, "models": {"m": 100 * MB}, **common})
    state.report_device("cold/cpu", {"free_bytes": 1 << 30, "models": {}, **common})


@pytest.fixture
def extender(redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path) -> Iterator[ExtenderProcess]:
    seed(state)
    env = {"EMBER_MAX_BODY_BYTES": "65536", "EMBER_EXTENDER_CACHE": "0"}
    proc = ExtenderProcess(redis_server.url, tmp_path / "extender.log", env=env)
    try:
        yield proc
    finally:
        proc.stop()


def test_filter_and_prioritize_over_http(extender: ExtenderProcess) -> None:
    assert extender.url.endswith("/extender")
    with httpx.Client(base_url=extender.url, timeout=10) as http:
        filtered = http.post("/filter", json=args(["warm", "cold", "gone"]))
        assert filtered.status_code == 200
        assert filtered.json() == {
            "Nodes": None,
            "NodeNames": ["warm", "cold"],
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {"gone": "no pool report for gone/cpu (pool down or not started)"},
            "Error": "",
        }
        scored = http.post("/prioritize", json=args(["warm", "cold"])).json()
        assert scored == [{"Host": "warm", "Score": 10}, {"Host": "cold", "Score": 0}]
        nodes = {"items": [{"metadata": {"name": "cold"}, "spec": {"podCIDR": "10.0.0.0/24"}}]}
        as_list = http.post("/filter", json={"Pod": args([])["Pod"], "Nodes": nodes}).json()
        assert as_list["NodeNames"] is None and as_list["Nodes"]["items"] == nodes["items"]
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json() == {"status": "ok"}
    assert [d["event"] for d in extender.decisions()] == [
        "extender.filter", "extender.prioritize", "extender.filter",
    ]  # fmt: skip
    assert extender.decisions()[1]["best"] == "warm"


def test_bad_requests_get_json_errors(extender: ExtenderProcess) -> None:
    with httpx.Client(base_url=extender.url, timeout=10) as http:
        cases = [
            (http.post("/filter", content=b"{"), 400, "invalid_request_error"),
            (http.post("/filter", content=b"[" * 100 + b"]" * 100), 400, "invalid_request_error"),
            (http.post("/filter", json={"Pod": {}, "NodeNames": []}), 400, "invalid_extender_args"),
            (http.post("/prioritize", json=args(["a"] * 2)), 400, "invalid_extender_args"),
            (http.post("/prioritize", content=b" " * 70000), 413, "request_too_large"),
            (http.get("/filter"), 405, "method_not_allowed"),
            (http.post("/bind", json={}), 404, "not_found"),
            # Regression: a lone surrogate in a node name failed to encode in the answer (500).
            (
                http.post("/filter", content=b'{"Pod": {"metadata": {}}, "NodeNames": ["\\ud800"]}'),
                400,
                "invalid_extender_args",
            ),
        ]
        for response, status, kind in cases:
            assert response.status_code == status, response.text
            assert response.json()["error"]["type"] == kind
    assert extender.alive()


def test_sigterm_stops_it_cleanly_and_bad_settings_exit_2(extender: ExtenderProcess) -> None:
    extender.proc.send_signal(signal.SIGTERM)
    assert extender.proc.wait(30) == 0
    bad = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "extender", "--redis", "redis://x:1"],
        env={"EMBER_EXTENDER_REPORT_TTL": "never", "PATH": "/usr/bin"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "EMBER_EXTENDER_REPORT_TTL" in bad.stderr
    # Regression: an address it cannot listen on was a traceback.
    unbound = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "extender", "--redis", "redis://x:1", "--port", "0"],
        env={"EMBER_HOST": "999.1.1.1", "PATH": "/usr/bin"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unbound.returncode == 1 and "cannot listen on 999.1.1.1" in unbound.stderr
    assert "Traceback" not in unbound.stderr
    with pytest.raises(ValueError, match="Redis URL"):
        ExtenderServeConfig(redis_url="")
    with pytest.raises(ValueError, match="prefix"):
        ExtenderServeConfig(redis_url="redis://x", prefix="extender/")


def test_one_malformed_device_report_does_not_fail_every_placement(
    extender: ExtenderProcess, state: ClusterState
) -> None:
    """Regression: a report that is not JSON, or holds Infinity, failed the whole read (500 or
    409 for every pod); now only its node is unresolvable and the others are judged."""
    state.r.set(f"{state.p}device:junk/cpu", "not json")
    state.r.set(f"{state.p}device:inf/cpu", '{"v": 1, "free_bytes": 1e999, "updated": 0}')
    with httpx.Client(base_url=extender.url, timeout=10) as http:
        out = http.post("/filter", json=args(["warm", "junk", "inf"]))
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["NodeNames"] == ["warm"]
    assert "not a JSON document" in body["FailedAndUnresolvableNodes"]["junk"]
    assert "free_bytes" in body["FailedAndUnresolvableNodes"]["inf"]


def test_the_extender_answers_at_once_when_redis_is_away(
    redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    """Regression: its read retried for the state's 10 s, beyond kube-scheduler's httpTimeout
    (2 s as shipped), in every pod's scheduling cycle."""
    extender = extender_for(state, ExtenderConfig(cache_s=0.0))
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StateUnavailable):
        asyncio.run(extender.filter(args(["a"])))
    assert time.monotonic() - t0 < 2.0


def test_mounted_in_the_gateway_app(state: ClusterState) -> None:
    """The gateway serves it under a prefix; kube-scheduler sends no API key, so none is asked."""
    seed(state)
    app = create_app(state, GatewayConfig(api_key="k" * 32))
    extender = extender_for(state, ExtenderConfig(cache_s=0.0))
    app.mount("/extender", extender_app(extender, EdgeLimits(max_body_bytes=4096), ping=state.r.ping))

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [
                await http.post("/extender/prioritize", json=args(["cold", "warm"])),
                await http.post("/extender/filter", content=json.dumps(args(["x" * 200] * 30)).encode()),
                await http.get("/extender/readyz"),
                await http.get("/v1/functions"),
            ]

    scored, too_large, ready, functions = asyncio.run(calls())
    assert scored.json() == [{"Host": "cold", "Score": 0}, {"Host": "warm", "Score": 10}]
    assert too_large.status_code == 413
    assert ready.json() == {"status": "ok"}
    assert functions.status_code == 401  # the gateway's own routes still want the key
