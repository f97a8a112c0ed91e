"""The worker as a Knative container (issue 11): Knative's runtime contract against a real
``ember worker --function`` process, a real Redis and a real pool daemon. No cluster runs
here: the pod's environment is what a rendered revision gives its container."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpu_pool.client import PoolClient
from runtime.drain import Lifecycle
from runtime.knative_worker import DEFAULT_GRACE_S, DEFAULT_REFRESH_S, KnativeConfig, Revision
from runtime.worker_guard import TOKEN_HEADER
from scheduler import cluster_keys
from scheduler.knative.config import KnativeConfig as ServiceConfig
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.render import render_record
from scheduler.state import ClusterState
from tests.conftest import PoolProcess, wait_until
from tests.runtime.pod_worker import (
    Home,
    free_port,
    get_status,
    make_home,
    pod_environment,
    put_function,
    read,
    start_worker,
    wait_status,
)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Home:
    return make_home(tmp_path_factory.mktemp("tiny"))


# ----- configuration from the pod's environment ---------------------------------------------------


def test_config_follows_the_pod_environment() -> None:
    env = {"PORT": "9090", "POD_IP": "10.1.2.3", "K_SERVICE": "chat", "K_REVISION": "chat-00002",
           "K_CONFIGURATION": "chat", "EMBER_GRACE_SECONDS": "12.5",
           "EMBER_POOL_WAIT_SECONDS": "0"}  # fmt: skip
    config = KnativeConfig.from_env(env)
    assert (config.port, config.grace_s, config.pool_wait_s, config.host) == (9090, 12.5, 0.0, "0.0.0.0")
    assert config.url == "http://10.1.2.3:9090"
    assert config.revision == Revision("chat", "chat-00002", "chat")
    assert config.revision.fields() == {"k_service": "chat", "k_revision": "chat-00002",
                                        "k_configuration": "chat"}  # fmt: skip
    default = KnativeConfig.from_env({})
    assert (default.port, default.grace_s, default.url) == (8080, DEFAULT_GRACE_S, "")
    assert (default.refresh_s, default.record_ttl_s) == (DEFAULT_REFRESH_S, 3 * DEFAULT_REFRESH_S)
    assert KnativeConfig.from_env({"EMBER_RECORD_REFRESH_SECONDS": "0.5"}).record_ttl_s == 1.5
    assert KnativeConfig.from_env({"POD_IP": "fd00::1"}).url == "http://[fd00::1]:8080"
    assert Revision().fields() == {}


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"PORT": "http"}, "PORT"),
        ({"PORT": "70000"}, "PORT"),
        ({"PORT": "0"}, "PORT"),
        ({"PORT": "²"}, "PORT"),  # regressions: non-ASCII digits (int() refused it unnamed) ...
        ({"PORT": "٨٠٨٠"}, "PORT"),  # ... or took it as port 8080
        ({"EMBER_GRACE_SECONDS": "0"}, "EMBER_GRACE_SECONDS"),
        ({"EMBER_GRACE_SECONDS": "nan"}, "EMBER_GRACE_SECONDS"),
        ({"EMBER_GRACE_SECONDS": "1e9"}, "EMBER_GRACE_SECONDS"),
        ({"EMBER_GRACE_SECONDS": "soon"}, "EMBER_GRACE_SECONDS"),
        ({"EMBER_POOL_WAIT_SECONDS": "-1"}, "EMBER_POOL_WAIT_SECONDS"),
        ({"EMBER_RECORD_REFRESH_SECONDS": "0.01"}, "EMBER_RECORD_REFRESH_SECONDS"),
        ({"EMBER_RECORD_REFRESH_SECONDS": "inf"}, "EMBER_RECORD_REFRESH_SECONDS"),
        ({"EMBER_RECORD_REFRESH_SECONDS": "often"}, "EMBER_RECORD_REFRESH_SECONDS"),
        ({"POD_IP": "10.0.0.300"}, "10.0.0.300"),
        ({"K_REVISION": "x" * 300}, "K_REVISION"),
    ],
)
def test_bad_settings_fail_loudly(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        KnativeConfig.from_env(env)


def test_readiness_follows_the_lifecycle() -> None:
    life = Lifecycle()
    assert life.readiness() == (503, {"status": "starting"})
    life.ready = True
    assert life.readiness() == (200, {"status": "ready"}) and life.serving
    life.draining = True
    assert life.readiness() == (503, {"status": "draining"}) and not life.serving


# ----- the contract, against real processes -------------------------------------------------------


@pytest.fixture
def pod(
    home: Home, redis_server: object, state: ClusterState, tmp_path: Path
) -> Iterator[tuple[dict[str, str], Path, Path]]:
    """(environment, pool directory, logs directory) of a function pod whose pool is not up yet."""
    put_function(state, home)
    pool_dir = tmp_path / "run"
    pool_dir.mkdir()
    env = pod_environment(home, redis_server.url, pool_dir, free_port())  # type: ignore[attr-defined]
    yield env, pool_dir, tmp_path / "logs"


@pytest.mark.slow
def test_runtime_contract_port_readiness_order_and_sigterm_during_a_stream(
    home: Home, state: ClusterState, pod: tuple[dict[str, str], Path, Path]
) -> None:
    env, pool_dir, logs = pod
    token, port = env["EMBER_WORKER_TOKEN"], env["PORT"]
    url = f"http://127.0.0.1:{port}"
    proc = start_worker(["--function", "tiny"], env, logs)
    pool = None
    try:
        # Listening on $PORT before it can serve: /readyz is 503 while the node's pool is not up.
        wait_status(f"{url}/readyz", 503, proc, logs, timeout=120)
        assert httpx.get(f"{url}/readyz").json() == {"status": "starting"}
        assert get_status(f"{url}/healthz") == 200  # liveness: no credential
        assert httpx.post(f"{url}/invoke", json={}).status_code == 401  # everything else needs it
        (starting,) = state.instances("tiny")
        assert (starting.state, starting.device, starting.url) == ("starting", "node-a/cpu", "")
        assert token.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()  # hidden once read

        pool = PoolProcess(pool_dir / "cpu.sock", "16MiB", store=(home.model.store_path,))
        wait_status(f"{url}/readyz", 200, proc, logs, timeout=60)  # attached, engine built: ready
        (ready,) = state.instances("tiny")
        assert (ready.state, ready.url) == ("ready", f"http://127.0.0.1:{port}")
        assert ready.details == {"k_service": "tiny", "k_revision": "tiny-00001", "k_configuration": "tiny"}
        with PoolClient(pool.socket_path) as observer:
            assert observer.stats()["pinned_bytes"] > 0  # the instance holds its weights

        # SIGTERM while a stream is in flight: the stream completes, then the worker exits 0.
        auth = {TOKEN_HEADER: token}
        events: list[object] = []
        with (
            httpx.Client(base_url=url, headers=auth, timeout=60) as http,
            http.stream("POST", "/invoke", json={"n": 6, "pause": 0.25}) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: state.instances("tiny")[0].state == "draining", timeout=10)
            # No new requests: a new connection is refused (or told the pod is draining).
            assert get_status(f"{url}/readyz") in (None, 503)
            events = [first, *(line for line in lines if line.startswith("data: "))]
        assert events[-1] == "data: [DONE]" and len(events) == 7, events
        assert proc.wait(timeout=60) == 0, read(logs / "stderr")[-3000:]
        with PoolClient(pool.socket_path) as observer:
            stats = observer.stats()
        assert stats["sessions"] == 1  # the observer's own: the worker's session was released
        assert stats["pinned_bytes"] == 0 and stats["num_kv_blocks"] == 0
        assert stats["resident_bytes"] > 0  # the weights stay resident for the next instance
        assert state.instances("tiny") == []  # its record is removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pool is not None:
            pool.stop()


@pytest.mark.slow
def test_a_stream_outlasting_the_grace_period_is_cut_and_the_worker_still_exits(
    home: Home, state: ClusterState, pod: tuple[dict[str, str], Path, Path]
) -> None:
    env, pool_dir, logs = pod
    env["EMBER_GRACE_SECONDS"] = "1"
    url = f"http://127.0.0.1:{env['PORT']}"
    pool = PoolProcess(pool_dir / "cpu.sock", "16MiB", store=(home.model.store_path,))
    proc = start_worker(["--function", "tiny"], env, logs)
    try:
        wait_status(f"{url}/readyz", 200, proc, logs, timeout=120)
        received: list[str] = []

        def stream() -> None:
            auth = {TOKEN_HEADER: env["EMBER_WORKER_TOKEN"]}
            try:
                with httpx.stream("POST", f"{url}/invoke", json={"n": 100, "pause": 0.2}, headers=auth,
                                  timeout=60) as resp:  # fmt: skip
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            received.append(line)
            except httpx.TransportError:
                pass  # the cut

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: len(received) > 0, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, read(logs / "stderr")[-3000:]
        reader.join(30)
        assert "data: [DONE]" not in received  # 100 events at 0.2 s could not finish in 1 s
        assert state.instances("tiny") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pool.stop()


@pytest.mark.slow
def test_a_pod_whose_pool_never_comes_fails_and_leaves_no_record(
    state: ClusterState, pod: tuple[dict[str, str], Path, Path]
) -> None:
    env, _, logs = pod
    env["EMBER_POOL_WAIT_SECONDS"] = "1"
    proc = start_worker(["--function", "tiny"], env, logs)
    try:
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "cpu.sock" in read(logs / "stderr") and "waited 1 s" in read(logs / "stderr")
    assert state.instances("tiny") == []


@pytest.mark.slow
def test_a_sigkilled_pods_record_expires_while_a_live_pods_is_renewed(
    home: Home, state: ClusterState, pod: tuple[dict[str, str], Path, Path]
) -> None:
    """Regression (issue 11): a pod killed outright (OOM kill, node loss) never removes its
    record; the record expires unless the worker's heartbeat renews it, starting or ready."""
    env, pool_dir, logs = pod
    env["EMBER_RECORD_REFRESH_SECONDS"] = "0.25"  # TTL 0.75 s
    url = f"http://127.0.0.1:{env['PORT']}"
    proc = start_worker(["--function", "tiny"], env, logs)
    pool = None
    try:
        wait_status(f"{url}/readyz", 503, proc, logs, timeout=120)  # starting: no pool yet
        (starting,) = state.instances("tiny")
        key = f"{state.p}instance:{starting.instance_id}"
        assert 0 < state.r.pttl(key) <= 750
        time.sleep(2.0)  # well past the TTL: the heartbeat renews it while the pod waits
        assert [i.state for i in state.instances("tiny")] == ["starting"]
        pool = PoolProcess(pool_dir / "cpu.sock", "16MiB", store=(home.model.store_path,))
        wait_status(f"{url}/readyz", 200, proc, logs, timeout=60)
        time.sleep(1.5)
        (ready,) = state.instances("tiny")
        assert (ready.instance_id, ready.state) == (starting.instance_id, "ready")
        assert 0 < state.r.pttl(key) <= 750

        proc.send_signal(signal.SIGKILL)  # no SIGTERM, no gone(): only the TTL removes it
        proc.wait(timeout=10)
        wait_until(lambda: state.instances("tiny") == [], timeout=5)
        assert not state.r.exists(key) and not state.r.exists(f"{state.p}fn:tiny:instances")
        assert state.functions_with_instances() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pool is not None:
            pool.stop()


MOUNTED_HANDLER = """
def handler(event, context):
    return {"echo": event, "file": __file__}
"""


def configmap_mount(directory: Path, data: dict[str, str]) -> None:
    """What the kubelet makes of a configMap volume: the keys as symlinks through ``..data`` to a
    timestamped directory (which is how it swaps contents atomically), all read-only."""
    stamp = directory / "..2025_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    for key, text in data.items():
        (stamp / key).write_text(text)
        (stamp / key).chmod(0o444)
        (directory / key).symlink_to(f"..data/{key}")
    (directory / "..data").symlink_to(stamp.name)


@pytest.mark.slow
def test_a_pod_runs_the_custom_handler_from_its_mounted_configmap(
    home: Home, state: ClusterState, pod: tuple[dict[str, str], Path, Path]
) -> None:
    """Issue 11: the function's record names the module where the gateway stored it (a path no
    pod has); the rendered revision mounts the module's ConfigMap under the pod's functions root
    and names it in EMBER_FUNCTION_HANDLER; the worker loads and serves it from there."""
    env, pool_dir, logs = pod
    code = HandlerCode("echo.py", "handler", MOUNTED_HANDLER)
    document = state.function("tiny").spec
    document["spec"]["handler"] = f"/srv/gateway/functions/default/tiny/{code.digest}/echo.py:handler"
    model = state.function("tiny").model
    state.put_function("tiny", document, model)
    rendered = render_record(state.function("tiny"), ServiceConfig(), code)
    assert rendered.config_map is not None
    (container,) = rendered.service["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "ember-handler"]
    (handler_env,) = [e for e in container["env"] if e["name"] == "EMBER_FUNCTION_HANDLER"]
    # The pod's EMBER_HOME is this test's home: the mount lands at the same place under it.
    relative = Path(mount["mountPath"]).relative_to(f"{cluster_keys.NODE_HOME}/functions")
    mounted = home.path / "functions" / relative
    configmap_mount(mounted, rendered.config_map["data"])
    env["EMBER_FUNCTION_HANDLER"] = handler_env["value"]

    url = f"http://127.0.0.1:{env['PORT']}"
    pool = PoolProcess(pool_dir / "cpu.sock", "16MiB", store=(home.model.store_path,))
    proc = start_worker(["--function", "tiny"], env, logs)
    try:
        wait_status(f"{url}/readyz", 200, proc, logs, timeout=120)
        auth = {TOKEN_HEADER: env["EMBER_WORKER_TOKEN"]}
        answer = httpx.post(f"{url}/invoke", json={"hi": 1}, headers=auth, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["echo"] == {"hi": 1}
        assert Path(answer.json()["file"]).is_relative_to(os.path.realpath(mounted))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, read(logs / "stderr")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pool.stop()
