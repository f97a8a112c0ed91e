"""No secret value in the cluster manifests: scripts/knative-secrets generates them (fresh each
run, covering every reference from the right namespace), Redis requires its password and the
generated URL carries it, and `ember serve` joins EMBER_REDIS_PASSWORD into its Redis URL."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from gateway.redis_auth import with_password
from gateway.serve import ServeConfig
from scheduler.redis_server import find_redis_server
from scheduler.state import ClusterState
from tests.deploy.knative_rules import validate
from tests.deploy.shipped import KNATIVE, kustomization, shipped

ROOT = Path(__file__).resolve().parents[2]
SECRETISH = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|AUTH|REDIS_URL", re.IGNORECASE)


def generated() -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "knative-secrets")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def secrets_of(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    """(namespace, name) -> stringData of every Secret."""
    return {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d["stringData"]
        for d in docs
        if d["kind"] == "Secret"
    }


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(namespace, pod spec) of every workload."""
    return [
        (d["metadata"]["namespace"], d["spec"]["template"]["spec"])
        for d in docs
        if "template" in d.get("spec", {})
    ]


def secret_refs(docs: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(namespace, Secret, key) of every secretKeyRef and Secret volume item."""
    refs = set()
    for namespace, spec in pod_specs(docs):
        for container in spec["containers"] + spec.get("initContainers", []):
            for env in container.get("env", []):
                if "secretKeyRef" in env.get("valueFrom", {}):
                    ref = env["valueFrom"]["secretKeyRef"]
                    refs.add((namespace, ref["name"], ref["key"]))
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                refs |= {
                    (namespace, volume["secret"]["secretName"], i["key"]) for i in volume["secret"]["items"]
                }
    return refs


def test_no_manifest_holds_a_secret_value() -> None:
    docs = shipped()
    assert [d for d in docs if d["kind"] == "Secret"] == []  # generated, never committed
    for _, spec in pod_specs(docs):
        for container in spec["containers"]:
            for env in container.get("env", []):
                if SECRETISH.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
    for path in KNATIVE.iterdir():
        assert not re.search(r"replace-me|changeme|password\s*[:=]\s*\S", path.read_text(), re.IGNORECASE)


def test_the_generated_secrets_are_fresh_valid_and_cover_every_reference() -> None:
    first, second = generated(), generated()
    assert [p for d in first for p in validate(d)] == []
    secrets, again = secrets_of(first), secrets_of(second)
    for (namespace, name), data in secrets.items():
        for key, value in data.items():
            assert value != again[namespace, name][key], (namespace, name, key)
    ember = "ember"
    api_key, password = secrets[ember, "ember-api-key"]["key"], secrets[ember, "ember-redis"]["password"]
    cluster = secrets[ember, "ember-cluster"]["secret"]
    assert min(len(api_key), len(password), len(cluster)) >= 43  # 32 random bytes
    assert len({api_key, password, cluster}) == 3
    assert secrets[ember, "ember-redis"]["redis.conf"] == f"requirepass {password}\n"
    url = urlsplit(secrets[ember, "ember-redis"]["url"])
    redis_service = next(
        d for d in shipped() if d["kind"] == "Service" and d["metadata"]["name"] == "ember-redis"
    )
    assert url.hostname == f"ember-redis.{redis_service['metadata']['namespace']}.svc"
    assert (url.password, url.port) == (password, redis_service["spec"]["ports"][0]["port"])
    # function pods read only the URL and the cluster secret, from their own namespace
    assert secrets["ember-fn", "ember-redis"] == {"url": secrets[ember, "ember-redis"]["url"]}
    assert secrets["ember-fn", "ember-cluster"] == {"secret": cluster}
    # every reference in the manifests resolves, and every generated key in ember is used
    provided = {(ns, name, key) for (ns, name), data in secrets.items() for key in data}
    assert secret_refs(shipped()) <= provided
    assert {p for p in provided if p[0] == ember} <= secret_refs(shipped())


def test_the_script_applies_the_namespaces_as_the_kustomization_does() -> None:
    """Re-running it (to rotate) must not strip the namespaces' labels set by apply -k."""
    script = {d["metadata"]["name"]: d for d in generated() if d["kind"] == "Namespace"}
    listed = {d["metadata"]["name"]: d for d in shipped() if d["kind"] == "Namespace"}
    assert script == listed
    assert "namespaces.yaml" in kustomization()["resources"]


def test_the_generated_url_opens_the_redis_the_generated_conf_protects(tmp_path: Path) -> None:
    data = secrets_of(generated())["ember", "ember-redis"]
    conf = tmp_path / "redis.conf"
    conf.write_text(data["redis.conf"])
    url = urlsplit(data["url"])
    with redis_server(conf, url.password or "") as port:
        local = url._replace(netloc=f":{url.password}@127.0.0.1:{port}").geturl()
        client = redis.Redis.from_url(local)
        try:
            assert client.ping()
        finally:
            client.close()
        anonymous = redis.Redis(port=port)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.ping()
        finally:
            anonymous.close()


@contextlib.contextmanager
def redis_server(conf: Path, password: str) -> Iterator[int]:
    """A real redis-server with ``conf`` on a free loopback TCP port; yields the port once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [find_redis_server(), str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            probe = redis.Redis(port=port, password=password)
            try:
                probe.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
            finally:
                probe.close()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[str]:
    """A real redis-server that requires a password; yields its URL (no password)."""
    conf = tmp_path / "redis.conf"
    conf.write_text("requirepass s3cret/with:odd@chars\n")
    with redis_server(conf, "s3cret/with:odd@chars") as port:
        yield f"redis://127.0.0.1:{port}/0"


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
