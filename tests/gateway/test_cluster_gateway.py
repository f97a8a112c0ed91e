"""Cluster mode's gateway (``ember gateway``) end to end, without a cluster.

A real ``ember gateway`` process over a real Redis, its Knative backend writing manifests to
a directory (``EMBER_KNATIVE_APPLY=dir:``, the GitOps mode), and a real ``ember worker``
(the tiny model, over a real pool) standing where the function's Service URL points
(``EMBER_KNATIVE_URL``): deploys render and apply the Service and its token Secret,
invocations reach the worker with the function's derived token (JSON and SSE), describe and
list show the Service's readiness, deletes remove the objects. Knative itself (autoscaling,
the activator, queue-proxy) is not here: there is no cluster. Delivery at most once is
checked in process against real sockets: a Service that cannot be connected to, and one that
takes the request and hangs up.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.cluster_gateway import ClusterGatewayConfig
from gateway.compose import build_cluster
from gateway.spawn import ServeProcess
from runtime.registry import RegisteredModel, register
from runtime.sources import ROOTS_ENV, SourceRoots
from runtime.worker_guard import TOKEN_HEADER
from scheduler import cluster_keys
from scheduler.extender.policies import PlacementConfig
from scheduler.extender.service import ExtenderConfig
from scheduler.knative.config import KnativeConfig
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.tokens import WorkerTokens, worker_token
from scheduler.records import DeviceReport
from scheduler.redis_server import EmbeddedRedis
from tests.conftest import PoolProcess
from tests.deploy.knative_rules import validate
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
SECRET = "cluster-secret-" + "x" * 32
API_KEY = "cluster-gateway-key-" + "k" * 16
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
    "temperature": 0,
}


@dataclass
class Cluster:
    gateway: ServeProcess
    manifests: Path
    model: RegisteredModel
    gguf: Path
    worker_url: str

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120
        )

    def spec(self, name: str = "tiny", **body: Any) -> dict[str, Any]:
        source = {"source": f"gguf:{self.gguf}", "dtype": "float32"}
        spec = {"model": source, "scaling": {"keepAlive": "30s", "concurrency": 4}, **body}
        return {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis, a pool, ``ember worker --name tiny`` holding the function's derived token, and
    ``ember gateway`` whose Service URL is that worker."""
    root = Path(os.path.realpath(tmp_path_factory.mktemp("cluster")))
    gguf = root / "models" / "tiny.gguf"
    gguf.parent.mkdir()
    write_tiny_gguf(gguf, hf_weights(7))
    home = root / "home"
    model = register(f"gguf:{gguf}", "float32", home=home, roots=SourceRoots((gguf.parent,)))
    redis = EmbeddedRedis(root / "redis")
    redis.start()
    pool = PoolProcess(root / "pool.sock", "8MiB", store=(model.store_path,))
    worker = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--name", "tiny", "--model-dir", str(model.directory),
         "--pool-socket", pool.socket_path, "--token-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    gateway = None
    try:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(worker_token(SECRET.encode(), "tiny") + "\n")  # what its pod's Secret holds
        worker.stdin.flush()
        ready = json.loads(worker.stdout.readline())
        env = {
            "EMBER_REDIS_URL": redis.url,
            "EMBER_CLUSTER_SECRET": SECRET,
            "EMBER_API_KEY": API_KEY,
            "EMBER_KNATIVE_APPLY": f"dir:{root / 'manifests'}",
            "EMBER_KNATIVE_URL": ready["url"],  # every function's "Service" is this worker
            ROOTS_ENV: str(gguf.parent),
        }
        gateway = ServeProcess(home, env=env, verb="gateway")
        yield Cluster(gateway, root / "manifests", model, gguf, ready["url"])
    finally:
        if gateway is not None:
            assert gateway.stop() == 0, (home / "serve.log").read_text()[-3000:]
        worker.terminate()
        worker.communicate(timeout=30)
        pool.stop()
        redis.stop()


def ember(cluster: Cluster, *args: str) -> str:
    environ = dict(os.environ, EMBER_URL=cluster.gateway.url, EMBER_API_KEY=API_KEY)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, env=environ, cwd=ROOT,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_deploy_invoke_describe_list_delete_through_the_service(cluster: Cluster) -> None:
    with cluster.http() as http:
        assert http.get("/readyz").status_code == 200
        deployed = http.post("/v1/functions", json=cluster.spec())
        assert deployed.status_code == 201, deployed.text

        # The backend applied the rendered Service and the Secret with the derived token.
        service = yaml.safe_load((cluster.manifests / "tiny.service.yaml").read_text())
        annotations = service["spec"]["template"]["metadata"]["annotations"]
        assert annotations[cluster_keys.ANNOTATION_MODEL] == cluster.model.model_id
        assert int(annotations[cluster_keys.ANNOTATION_WEIGHT_BYTES]) == cluster.model.manifest().nbytes
        assert service["spec"]["template"]["spec"]["containerConcurrency"] == 4
        secret = yaml.safe_load((cluster.manifests / "tiny.secret.yaml").read_text())
        assert secret["stringData"]["token"] == worker_token(SECRET.encode(), "tiny")

        # Invocations reach the worker, which accepts only its own token.
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        direct = httpx.post(f"{cluster.worker_url}/v1/chat/completions", json=CHAT, timeout=30)
        assert direct.status_code == 401  # without the derived token, the worker refuses
        with http.stream("POST", "/v1/functions/tiny/invoke", json={**CHAT, "stream": True}) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 2
        assert all("choices" in json.loads(e) for e in events[:-1])

        # describe and list show the Service's readiness (no cluster: Unknown, NoCluster).
        described = http.get("/v1/functions/tiny").json()
        knative = described["status"]["knative"]
        assert (knative["service"], knative["namespace"], knative["found"]) == ("tiny", "ember-fn", True)
        assert (knative["ready"], knative["reason"]) == ("Unknown", "NoCluster")
        (listed,) = http.get("/v1/functions").json()["functions"]
        assert listed["status"]["knative"] == knative
        assert "READY" in ember(cluster, "list").splitlines()[0]
        assert "knative:" in ember(cluster, "describe", "tiny")

        assert http.delete("/v1/functions/tiny").status_code == 204
        assert not list(cluster.manifests.glob("tiny.*"))
        assert http.get("/v1/functions/tiny").status_code == 404


@pytest.mark.slow
def test_a_spec_knative_cannot_express_is_refused_before_anything_is_stored(cluster: Cluster) -> None:
    with cluster.http() as http:
        for name, body, field in (
            ("long-keepalive", {"scaling": {"keepAlive": "3h"}}, "spec.scaling.keepAlive"),
            ("my--chat", {}, "metadata.name"),
            ("custom", {"handler": "hello.py:handler"}, "spec.handler"),  # its module not uploaded
        ):
            refused = http.post("/v1/functions", json=cluster.spec(name, **body))
            assert refused.status_code == 400, refused.text
            assert field in refused.json()["error"]["message"]
            assert http.get(f"/v1/functions/{name}").status_code == 404
        assert not list(cluster.manifests.glob("*.yaml"))


@pytest.mark.slow
def test_a_custom_handler_deploys_with_its_code_as_a_configmap(cluster: Cluster) -> None:
    """Issue 11: the uploaded module is stored, rendered as an immutable ConfigMap applied with
    the Service (the pods mount it); new code replaces it; a delete removes it."""
    manifests = cluster.manifests
    with cluster.http() as http:
        for version in ("v1", "v2"):
            source = f"def handler(event, context):\n    return {{'version': '{version}'}}\n"
            body = {
                "function": cluster.spec("hello", handler="hello.py:handler"),
                "files": {"hello.py": source},
            }
            deployed = http.post("/v1/functions", json=body)
            assert deployed.status_code == 201, deployed.text
            code = HandlerCode("hello.py", "handler", source)
            stored = deployed.json()["spec"]["handler"]
            assert stored.endswith(f"/{code.digest}/hello.py:handler")  # the gateway's own path
            config_map = yaml.safe_load((manifests / "hello.code.yaml").read_text())
            assert config_map["metadata"]["name"] == f"hello-code-{code.digest}"
            assert config_map["data"] == {"hello.py": source} and config_map["immutable"] is True
            service = yaml.safe_load((manifests / "hello.service.yaml").read_text())
            (container,) = service["spec"]["template"]["spec"]["containers"]
            env = {"name": "EMBER_FUNCTION_HANDLER", "value": f"default/hello/{code.digest}/hello.py:handler"}
            assert env in container["env"]
            assert validate(config_map) == [] and validate(service) == []
        assert http.delete("/v1/functions/hello").status_code == 204
        assert not list(manifests.glob("hello.*"))


@pytest.mark.slow
def test_a_service_name_owned_by_another_function_changes_nothing(cluster: Cluster) -> None:
    theirs = {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "taken"}}
    cluster.manifests.mkdir(exist_ok=True)
    (cluster.manifests / "taken.service.yaml").write_text(yaml.safe_dump(theirs))
    with cluster.http() as http:
        refused = http.post("/v1/functions", json=cluster.spec("taken"))
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "knative_conflict"
        assert http.get("/v1/functions/taken").status_code == 404  # the new record was taken back
    assert yaml.safe_load((cluster.manifests / "taken.service.yaml").read_text()) == theirs
    (cluster.manifests / "taken.service.yaml").unlink()


# ----- at most once, in process: real Redis, real sockets ----------------------------------------


def test_the_gateway_serves_ember_schedulers_extender_without_an_api_key(cluster: Cluster) -> None:
    """kube-scheduler sends no API key: /extender answers without one (a NetworkPolicy guards
    it), while the function routes still require the key."""
    pod = {"metadata": {"name": "p", "namespace": "ember-fn", "annotations": {}}}
    with httpx.Client(base_url=cluster.gateway.url, timeout=30) as anonymous:
        assert anonymous.get("/v1/functions").status_code == 401
        filtered = anonymous.post("/extender/filter", json={"Pod": pod, "NodeNames": ["node-a"]})
        assert filtered.status_code == 200, filtered.text
        assert set(filtered.json()) >= {"NodeNames", "FailedNodes"}
        scores = anonymous.post("/extender/prioritize", json={"Pod": pod, "NodeNames": ["node-a"]})
        assert scores.status_code == 200 and isinstance(scores.json(), list)


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


def test_a_service_that_cannot_be_connected_to_is_a_502_after_the_connect_retries(
    redis_url: str, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    answer = invoke_cluster(redis_url, tmp_path, f"http://127.0.0.1:{port}")
    assert answer.status_code == 502
    assert (
        answer.json()["error"]["type"] == "instance_failed"
        and "unreachable" in answer.json()["error"]["message"]
    )


def test_a_service_that_takes_the_request_and_fails_gets_it_once(redis_url: str, tmp_path: Path) -> None:
    received: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))  # the request arrived: now fail
        writer.close()

    async def scenario() -> httpx.Response:
        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await invoke_cluster_async(redis_url, tmp_path, f"http://127.0.0.1:{port}")
        finally:
            server.close()

    answer = asyncio.run(scenario())
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "instance_failed"
    assert len(received) == 1  # never re-sent once it may have reached the worker
    headers = received[0].decode("latin-1").lower()
    assert f"{TOKEN_HEADER}: {worker_token(SECRET.encode(), 'tiny')}" in headers


def invoke_cluster(redis_url: str, tmp_path: Path, service_url: str) -> httpx.Response:
    return asyncio.run(invoke_cluster_async(redis_url, tmp_path, service_url))


async def invoke_cluster_async(redis_url: str, tmp_path: Path, service_url: str) -> httpx.Response:
    """Deploy ``tiny`` (its record only) on an in-process cluster gateway whose Service URL is
    ``service_url``, and invoke it once."""
    config = ClusterGatewayConfig(
        home=tmp_path / "home",
        redis_url=redis_url,
        tokens=WorkerTokens(SECRET.encode()),
        knative=KnativeConfig(url_template=service_url, apply_dir=tmp_path / "manifests"),
        request_timeout_s=10.0,
    )
    node = build_cluster(config)
    try:
        document = {
            "apiVersion": "ember.dev/v1",
            "kind": "Function",
            "metadata": {"name": "tiny"},
            "spec": {},
        }
        await asyncio.to_thread(node.state.put_function, "tiny", document)
        transport = httpx.ASGITransport(app=node.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return await http.post("/v1/chat/completions", json=CHAT)
    finally:
        await node.close()


def test_the_mounted_extender_judges_by_its_configured_report_ttl(redis_url: str, tmp_path: Path) -> None:
    """Regression: build_cluster mounted the extender with the default settings, so an
    operator's EMBER_EXTENDER_REPORT_TTL (say, for nodes reporting every 15 s) was ignored and
    every node whose report was older than 10 s was filtered out."""
    config = ClusterGatewayConfig(
        home=tmp_path / "home",
        redis_url=redis_url,
        tokens=WorkerTokens(SECRET.encode()),
        knative=KnativeConfig(url_template="http://{service}.ember-fn", apply_dir=tmp_path / "manifests"),
        extender=ExtenderConfig(PlacementConfig(report_ttl_s=60.0), cache_s=0.0),
    )
    annotations = {cluster_keys.ANNOTATION_MODEL: "m", cluster_keys.ANNOTATION_WEIGHT_BYTES: "1000"}
    pod = {"metadata": {"name": "p", "annotations": annotations}}

    async def filtered() -> httpx.Response:
        node = build_cluster(config)
        try:
            report = DeviceReport.encode({"free_bytes": 1 << 30, "models": {}}, updated=time.time() - 30)
            await asyncio.to_thread(node.state.r.set, f"{node.state.p}device:node-a/cpu", json.dumps(report))
            transport = httpx.ASGITransport(app=node.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                return await http.post("/extender/filter", json={"Pod": pod, "NodeNames": ["node-a"]})
        finally:
            await node.close()

    out = asyncio.run(filtered())
    assert out.status_code == 200 and out.json()["NodeNames"] == ["node-a"], out.text


@pytest.mark.parametrize(
    ("env", "code", "message"),
    [
        ({"EMBER_CLUSTER_SECRET": SECRET}, 2, "EMBER_REDIS_URL"),
        ({"EMBER_REDIS_URL": "redis://127.0.0.1:1/0"}, 2, "EMBER_CLUSTER_SECRET"),
        ({"EMBER_REDIS_URL": "redis://127.0.0.1:1/0", "EMBER_CLUSTER_SECRET": SECRET,
          "EMBER_HOST": "0.0.0.0"}, 2, "EMBER_API_KEY"),
        ({"EMBER_REDIS_URL": "redis://127.0.0.1:1/0", "EMBER_CLUSTER_SECRET": SECRET,
          "EMBER_KNATIVE_URL": "http://{pod}.cluster"}, 2, "EMBER_KNATIVE_URL"),
        # Regression: the mounted extender ignored its settings (ember extender reads them).
        ({"EMBER_REDIS_URL": "redis://127.0.0.1:1/0", "EMBER_CLUSTER_SECRET": SECRET,
          "EMBER_EXTENDER_REPORT_TTL": "soon"}, 2, "EMBER_EXTENDER_REPORT_TTL"),
        # The Kubernetes API backend without credentials: refused at start, not at the first deploy.
        ({"EMBER_REDIS_URL": "redis://127.0.0.1:1/0", "EMBER_CLUSTER_SECRET": SECRET,
          "KUBECONFIG": "/nonexistent/kubeconfig"}, 1, "no Kubernetes credentials"),
    ],
)  # fmt: skip
def test_ember_gateway_refuses_to_start_without_what_it_needs(
    tmp_path: Path, env: dict[str, str], code: int, message: str
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "KUBERNETES_"))}
    environ.update(EMBER_HOME=str(tmp_path), **env)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "gateway", "--port", "0"], capture_output=True, text=True,
        env=environ, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert message in done.stderr
