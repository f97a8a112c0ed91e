"""No secret value in the cluster manifests: scripts/knative-secrets generates them, Redis
requires its password, and `ember serve` joins EMBER_REDIS_PASSWORD into its Redis URL."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import yaml

from gateway.redis_auth import with_password
from gateway.serve import ServeConfig
from scheduler.redis_server import find_redis_server
from scheduler.state import ClusterState

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "knative").glob("*.yaml"))
SECRETISH = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|AUTH", re.IGNORECASE)


def documents(paths: list[Path]) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


def generated() -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "knative-secrets")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c
        for d in docs
        if "template" in d.get("spec", {})
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def test_no_manifest_holds_a_secret_value() -> None:
    docs = documents(MANIFESTS)
    assert [d for d in docs if d["kind"] == "Secret"] == []  # generated, never committed
    for container in containers(docs):
        for env in container.get("env", []):
            if SECRETISH.search(env["name"]):
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
    for path in MANIFESTS:
        assert not re.search(r"replace-me|changeme|password\s*[:=]\s*\S", path.read_text(), re.IGNORECASE)


def test_the_generated_secrets_are_fresh_valid_and_cover_every_reference() -> None:
    first, second = generated(), generated()
    for document in first:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    secrets = {d["metadata"]["name"]: d["stringData"] for d in first if d["kind"] == "Secret"}
    again = {d["metadata"]["name"]: d["stringData"] for d in second if d["kind"] == "Secret"}
    assert secrets["ember-api-key"]["key"] != again["ember-api-key"]["key"]
    assert secrets["ember-redis"]["password"] != again["ember-redis"]["password"]
    assert len(secrets["ember-api-key"]["key"]) >= 43 and len(secrets["ember-redis"]["password"]) >= 43
    assert secrets["ember-redis"]["redis.conf"] == f"requirepass {secrets['ember-redis']['password']}\n"
    docs = documents(MANIFESTS)
    refs = [
        env["valueFrom"]["secretKeyRef"]
        for c in containers(docs)
        for env in c.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    ]
    assert {(r["name"], r["key"]) for r in refs} == {
        ("ember-api-key", "key"),
        ("ember-redis", "password"),
    }
    (redis_set,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = redis_set["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "ember-redis"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert pod["containers"][0]["args"][0] == f"{mount['mountPath']}/redis.conf"  # requirepass


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on loopback TCP that requires a password; yields its URL (no password)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "redis.conf"
    conf.write_text("requirepass s3cret/with:odd@chars\n")
    proc = subprocess.Popen(
        [find_redis_server(), str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, password="s3cret/with:odd@chars").ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_ember_serve_joins_the_redis_password_into_its_url(
    password_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_REDIS_URL", password_redis)
    without = ClusterState.from_url(ServeConfig.from_env().redis_url or "")
    with pytest.raises(redis.exceptions.AuthenticationError):
        without.r.ping()
    without.close()
    monkeypatch.setenv("EMBER_REDIS_PASSWORD", "s3cret/with:odd@chars")
    url = ServeConfig.from_env().redis_url or ""
    state = ClusterState.from_url(url)
    try:
        assert state.list_functions() == {}
    finally:
        state.close()
    with pytest.raises(ValueError, match="carries a password"):
        with_password(url, "other")
    with pytest.raises(ValueError, match="no external Redis"):
        with_password(None, "pw")
