"""The cluster manifests are valid Kubernetes objects (schema-checked, strict: no unknown fields)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

MANIFESTS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "knative").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_is_valid(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_the_deployment_points_at_the_redis_service() -> None:
    ember = list(yaml.safe_load_all((MANIFESTS[0].parent / "ember.yaml").read_text()))
    redis = list(yaml.safe_load_all((MANIFESTS[0].parent / "redis.yaml").read_text()))
    (deployment,) = [d for d in ember if d["kind"] == "Deployment"]
    (service,) = [d for d in redis if d["kind"] == "Service"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0" in args
