"""The Knative backend's settings from EMBER_* variables (bad values fail loudly, naming the
variable), per-function worker tokens, and the invocation targets they give the gateway."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path

import pytest

from scheduler.knative.config import KnativeConfig, KnativeConfigError
from scheduler.knative.targets import ServiceTargets
from scheduler.knative.tokens import ClusterSecretError, WorkerTokens, worker_token
from scheduler.records import FunctionRecord
from scheduler.spec import SpecError

SECRET = "s" * 40


def test_defaults_without_any_variable() -> None:
    config = KnativeConfig.from_env({})
    assert config == KnativeConfig()
    assert (config.namespace, config.gpu_runtime_class, config.apply_dir) == ("ember-fn", "nvidia", None)
    assert config.url("chat") == "http://chat.ember-fn.svc.cluster.local"


def test_every_variable_is_read() -> None:
    config = KnativeConfig.from_env(
        {
            "EMBER_IMAGE": "registry.example/ember:1.2",
            "EMBER_KNATIVE_NAMESPACE": "functions",
            "EMBER_KNATIVE_GPU_RUNTIME_CLASS": "",
            "EMBER_KNATIVE_TARGET_PERCENT": "80",
            "EMBER_KNATIVE_MAX_TIMEOUT": "3600",
            "EMBER_KNATIVE_TIMEOUT_SLACK": "1.5",
            "EMBER_KNATIVE_URL": "http://127.0.0.1:9000/",
            "EMBER_KNATIVE_APPLY": "dir:/srv/gitops/functions",
        }
    )
    assert config == KnativeConfig(
        image="registry.example/ember:1.2",
        namespace="functions",
        gpu_runtime_class=None,
        target_percent=80,
        max_timeout_s=3600,
        timeout_slack=1.5,
        url_template="http://127.0.0.1:9000",
        apply_dir=Path("/srv/gitops/functions"),
    )
    assert config.url("anything") == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("EMBER_IMAGE", "ember latest"),
        ("EMBER_KNATIVE_NAMESPACE", "Ember_Fn"),
        ("EMBER_KNATIVE_GPU_RUNTIME_CLASS", "Nvidia!"),
        ("EMBER_KNATIVE_TARGET_PERCENT", "0"),
        ("EMBER_KNATIVE_TARGET_PERCENT", "101"),
        ("EMBER_KNATIVE_TARGET_PERCENT", "seventy"),
        ("EMBER_KNATIVE_MAX_TIMEOUT", "0"),
        ("EMBER_KNATIVE_MAX_TIMEOUT", "10m"),
        ("EMBER_KNATIVE_TIMEOUT_SLACK", "0.5"),
        ("EMBER_KNATIVE_TIMEOUT_SLACK", "nan"),
        ("EMBER_KNATIVE_URL", "http://{service}.{cluster}.local"),
        ("EMBER_KNATIVE_URL", "http://{service}.svc/invoke"),
        ("EMBER_KNATIVE_URL", "ftp://{service}"),
        ("EMBER_KNATIVE_URL", "http://{service"),
        ("EMBER_KNATIVE_URL", "http://127.0.0.1:99999"),
        ("EMBER_KNATIVE_URL", "http://user:pw@{service}"),
        ("EMBER_KNATIVE_APPLY", "s3://bucket"),
        ("EMBER_KNATIVE_APPLY", "dir:relative/path"),
        ("EMBER_KNATIVE_APPLY", "dir:"),
    ],
)
def test_bad_values_fail_loudly_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(KnativeConfigError, match=variable):
        KnativeConfig.from_env({variable: value})


def test_a_function_token_is_the_hmac_of_its_qualified_id() -> None:
    tokens = WorkerTokens.from_env({"EMBER_CLUSTER_SECRET": SECRET})
    expected = hmac.new(SECRET.encode(), b"team-a/chat", hashlib.sha256).hexdigest()
    assert tokens.token("team-a/chat") == expected == worker_token(SECRET.encode(), "team-a/chat")
    assert len({tokens.token(f) for f in ("chat", "team-a/chat", "team-b/chat")}) == 3
    assert WorkerTokens(b"t" * 40).token("chat") != tokens.token("chat")  # a new secret rotates them
    assert SECRET not in repr(tokens)


@pytest.mark.parametrize("environ", [{}, {"EMBER_CLUSTER_SECRET": ""}, {"EMBER_CLUSTER_SECRET": "short"}])
def test_a_missing_or_short_cluster_secret_is_refused(environ: dict[str, str]) -> None:
    with pytest.raises(ClusterSecretError, match="EMBER_CLUSTER_SECRET"):
        WorkerTokens.from_env(environ)


def test_targets_route_every_request_to_the_service_with_its_token() -> None:
    tokens = WorkerTokens(SECRET.encode())
    targets = ServiceTargets(KnativeConfig(namespace="fns"), tokens)
    record = FunctionRecord.create("team-a/chat", {"spec": {}})

    async def routes() -> None:
        first = await targets.route("team-a/chat", record, 0.0)
        assert first.url == "http://team-a--chat.fns.svc.cluster.local"
        assert first.token == tokens.token("team-a/chat") and not first.cold
        assert await targets.route("team-a/chat", record, 0.0) == first
        assert await targets.instance_lost("team-a/chat", first, 1.0) is False  # Knative replaces pods
        with pytest.raises(SpecError):
            await targets.route("my--chat", record, 0.0)

    asyncio.run(routes())
