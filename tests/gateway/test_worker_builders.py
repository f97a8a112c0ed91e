"""The composition root's cluster-mode workers (issue 11): ``build_knative_worker`` reads the
function's record from a real Redis and records the pod's instance; ``build_openwhisk_worker``
finds the node's pool or starts a private one; a pod's record is never expired by keep-alive."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gateway.compose import (
    FUNCTION_SPEC_ENV,
    WORKER_TOKEN_ENV,
    _openwhisk_assignment,
    build_knative_worker,
    build_openwhisk_worker,
)
from gateway.pod_instance import NEVER_EXPIRES
from gpu_pool.client import PoolClient
from runtime.knative_worker import Revision
from runtime.openwhisk import InitValue
from runtime.sources import ROOTS_ENV
from scheduler.errors import FunctionNotFound
from scheduler.records import ModelRef
from scheduler.redis_server import EmbeddedRedis
from scheduler.spec import SpecError
from scheduler.state import ClusterState
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

DOCUMENT = {
    "apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": "chat"},
    "spec": {"model": {"source": "pkg:x/y.gguf"}, "handler": "default", "maxTokens": 64},
}  # fmt: skip


def _env(redis: EmbeddedRedis, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        WORKER_TOKEN_ENV: "t" * 32,
        "EMBER_REDIS_URL": redis.url,
        "EMBER_NODE_NAME": "node-a.example",
        "EMBER_POOL_DIR": str(tmp_path / "run"),
        "POD_IP": "10.0.0.7",
        "PORT": "8081",
        "K_SERVICE": "chat",
        "K_REVISION": "chat-00001",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v}


def _deploy(state: ClusterState, function_id: str = "chat", model: bool = True) -> None:
    ref = ModelRef("tiny-abc-fp32", "/models/tiny-abc-fp32", 1000) if model else None
    state.put_function(function_id, DOCUMENT, ref)


def test_knative_worker_reads_its_function_and_records_its_instance(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path
) -> None:
    _deploy(state, "team-a/chat")
    worker = build_knative_worker("team-a/chat", _env(redis_server, tmp_path), 1 << 20)
    message = worker.assignment
    assert message.spec == DOCUMENT and message.model_dir == "/models/tiny-abc-fp32"
    assert message.pool_socket == str(tmp_path / "run" / "cpu.sock") and message.pool_ticket is None
    assert message.deadline > time.time() + 300  # the pool wait, then the initializer's own time
    assert worker.guard.token == "t" * 32 and worker.guard.max_body_bytes == 1 << 20
    assert (worker.config.port, worker.config.url) == (8081, "http://10.0.0.7:8081")
    (inst,) = state.instances("team-a/chat")
    assert (inst.instance_id, inst.state, inst.device) == (
        message.instance_id,
        "starting",
        "node-a.example/cpu",
    )
    worker.record.ready(worker.config.url, worker.config.revision)
    (inst,) = state.instances("team-a/chat")
    assert (inst.state, inst.url) == ("ready", "http://10.0.0.7:8081")
    assert inst.details == {"k_service": "chat", "k_revision": "chat-00001"}  # no credential
    worker.record.draining()
    worker.record.draining()  # a second SIGTERM: already draining, no error
    assert state.instances("team-a/chat")[0].state == "draining"
    worker.record.gone()
    assert state.instances("team-a/chat") == []


def test_a_pods_instance_is_not_drained_by_keep_alive(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path
) -> None:
    _deploy(state)
    worker = build_knative_worker("chat", _env(redis_server, tmp_path), 1 << 20)
    worker.record.ready("", Revision())
    assert state.instances("chat")[0].deadline == NEVER_EXPIRES
    # A router expiring without a device filter (a gateway running no pool) must not drain it:
    # Knative ends it.
    assert state.expire("chat", 0, now=time.time() + 365 * 86400) == []
    assert state.instances("chat")[0].state == "ready"
    worker.record.gone()


def test_a_pods_record_expires_unless_renewed_and_is_rewritten_when_lost(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path
) -> None:
    """A SIGKILLed pod cannot remove its record, so the record has a TTL (3 heartbeats) that the
    worker renews; a record that expired while the pod still serves is written again."""
    _deploy(state)
    env = _env(redis_server, tmp_path, EMBER_RECORD_REFRESH_SECONDS="2")
    worker = build_knative_worker("chat", env, 1 << 20)
    assert worker.config.record_ttl_s == 6.0
    key = f"{state.p}instance:{worker.record.instance_id}"
    assert 0 < state.r.pttl(key) <= 6000
    assert worker.record.refresh()
    # Lost while starting (Redis unreachable for longer than the TTL): ready() writes it whole.
    state.r.delete(key)
    worker.record.ready(worker.config.url, worker.config.revision)
    (inst,) = state.instances("chat")
    assert (inst.state, inst.url, inst.deadline) == ("ready", "http://10.0.0.7:8081", NEVER_EXPIRES)
    assert inst.details == {"k_service": "chat", "k_revision": "chat-00001"}
    assert 0 < state.r.pttl(key) <= 6000
    state.r.delete(key)
    assert not worker.record.refresh()  # the heartbeat writes it again too
    assert [i.state for i in state.instances("chat")] == ["ready"]
    # A record that is there in another state is not overwritten: that is a real conflict.
    state.transition(worker.record.instance_id, "ready", "gone")
    worker.record.draining()  # suppressed, as for a pod that never became ready
    assert [i.state for i in state.instances("chat")] == ["gone"]
    worker.record.gone()
    worker.record.refresh()  # a beat racing the exit: writes nothing back
    assert state.instances("chat") == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({WORKER_TOKEN_ENV: ""}, WORKER_TOKEN_ENV),
        ({WORKER_TOKEN_ENV: "short"}, "at least 16"),
        ({"EMBER_NODE_NAME": ""}, "EMBER_NODE_NAME"),
        ({"EMBER_NODE_NAME": "Node_A"}, "EMBER_NODE_NAME"),
        ({"EMBER_REDIS_URL": ""}, "EMBER_REDIS_URL"),
        ({"EMBER_REDIS_PASSWORD": "pw"}, "EMBER_REDIS_PASSWORD"),  # the unix URL carries one already
        ({"PORT": "eighty"}, "PORT"),
        ({"EMBER_RECORD_REFRESH_SECONDS": "0"}, "EMBER_RECORD_REFRESH_SECONDS"),
    ],
)
def test_bad_pod_settings_fail_loudly_and_record_nothing(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path, change: dict[str, str], needle: str
) -> None:
    _deploy(state)
    env = {**_env(redis_server, tmp_path), **change}
    with pytest.raises(ValueError, match=needle):
        build_knative_worker("chat", {k: v for k, v in env.items() if v}, 1 << 20)
    assert state.instances("chat") == []


def test_missing_function_bad_id_and_unregistered_model(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path
) -> None:
    env = _env(redis_server, tmp_path)
    with pytest.raises(FunctionNotFound):
        build_knative_worker("chat", env, 1 << 20)
    with pytest.raises(ValueError, match="not a function id"):
        build_knative_worker("Team/Chat", env, 1 << 20)
    _deploy(state, model=False)
    with pytest.raises(ValueError, match="not registered"):
        build_knative_worker("chat", env, 1 << 20)
    assert state.instances("chat") == []


def test_a_pods_handler_is_its_revisions_mounted_module(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMBER_FUNCTION_HANDLER (rendered with the ConfigMap mount) replaces the record's handler,
    a path on the gateway; it must name a module in the function's own directory."""
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    document = {**DOCUMENT, "spec": {**DOCUMENT["spec"], "handler": "/gateway/functions/x/hello.py:handler"}}
    state.put_function("team-a/chat", document, ModelRef("tiny-abc-fp32", "/models/tiny-abc-fp32", 1000))
    digest = "0123456789abcdef01234567"
    env = _env(redis_server, tmp_path, EMBER_FUNCTION_HANDLER=f"team-a/chat/{digest}/hello.py:handler")
    worker = build_knative_worker("team-a/chat", env, 1 << 20)
    functions = tmp_path / "home" / "functions"
    assert worker.assignment.handler == f"{functions}/team-a/chat/{digest}/hello.py:handler"
    worker.record.gone()
    for bad in (
        f"team-a/other/{digest}/hello.py:handler",  # another function's directory
        "team-a/chat/../hello.py:handler",
        f"/abs/team-a/chat/{digest}/hello.py:handler",
        f"team-a/chat/{digest}/hello.txt:handler",
        "hello.py:handler",
    ):
        with pytest.raises(ValueError, match="EMBER_FUNCTION_HANDLER"):
            build_knative_worker("team-a/chat", {**env, "EMBER_FUNCTION_HANDLER": bad}, 1 << 20)
    assert state.instances("team-a/chat") == []


# ----- OpenWhisk -------------------------------------------------------------------------------------


def test_openwhisk_uses_the_nodes_pool_when_there_is_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    pool = PoolProcess(run / "cpu.sock")
    try:
        worker = build_openwhisk_worker({"EMBER_HOME": str(tmp_path / "home"), "EMBER_POOL_DIR": str(run)})
        assert worker.pool_socket == str(run / "cpu.sock")
        worker.close()
        assert pool.alive()  # not ours to stop
    finally:
        pool.stop()


def test_openwhisk_starts_a_private_pool_otherwise(tmp_path: Path) -> None:
    env = {
        "EMBER_HOME": str(tmp_path / "home"),
        "EMBER_POOL_DIR": str(tmp_path / "none"),
        "EMBER_ARENA": "8MiB",
    }
    worker = build_openwhisk_worker(env)
    try:
        with PoolClient(worker.pool_socket) as client:
            assert client.stats()["capacity_bytes"] == 8 << 20
    finally:
        worker.close()
    assert not os.path.exists(worker.pool_socket) and not Path(worker.pool_socket).parent.exists()


def test_openwhisk_init_registers_the_specs_model_and_resolves_relative_handlers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ROOTS_ENV, str(tmp_path))
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(1))
    home = tmp_path / "home"
    spec = f"""
apiVersion: ember.dev/v1
kind: Function
metadata: {{name: echo}}
spec:
  model: {{source: "gguf:{tmp_path / "tiny.gguf"}", dtype: float32}}
  handler: echo.py:main
"""
    message = _openwhisk_assignment(InitValue(spec, {}, "/guest/echo"), home, "/x/cpu.sock", None)
    assert message.instance_id == "/guest/echo" and message.pool_socket == "/x/cpu.sock"
    assert message.handler == f"{home / 'functions' / 'echo.py'}:main"
    assert Path(message.model_dir).parent == home / "models" and Path(message.model_dir).is_dir()
    # No code: the image's own spec, if it has one.
    spec_file = tmp_path / "function.yaml"
    spec_file.write_text(spec.replace("echo.py:main", "default"))
    baked = _openwhisk_assignment(InitValue(None), home, "/x/cpu.sock", str(spec_file))
    assert baked.handler == "default" and baked.instance_id == "openwhisk"
    with pytest.raises(ValueError, match=FUNCTION_SPEC_ENV):
        _openwhisk_assignment(InitValue(None), home, "/x/cpu.sock", None)
    with pytest.raises(SpecError, match="unknown field"):
        _openwhisk_assignment(InitValue(spec + "  extra: 1\n"), home, "/x/cpu.sock", None)
    # Regression: the action's spec could name any Python file of the image as its handler.
    (tmp_path / "evil.py").write_text("raise SystemExit('loaded')\n")
    for handler in ("../../evil.py:main", f"{tmp_path / 'evil.py'}:main"):
        with pytest.raises(ValueError, match="not a module under"):
            _openwhisk_assignment(InitValue(spec.replace("echo.py:main", handler)), home, "/x/cpu.sock", None)


@pytest.mark.parametrize(
    "argv",
    [
        ["worker"],
        ["worker", "--name", "x"],
        ["worker", "--function", "chat", "--model-dir", "/m"],
        ["worker", "--openwhisk", "--token-stdin"],
    ],
)
def test_the_worker_verb_takes_one_mode(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    assert main(argv) == 2
    assert "ember worker:" in capsys.readouterr().err
