"""``ember node``: the node's supervised CPU pool on ``$EMBER_POOL_DIR/cpu.sock`` and its
residency reports in the cluster's Redis (real pool daemon, real redis-server)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.compose import run_node
from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.errors import KVQuotaExceeded
from runtime.node_daemon import NodeConfig
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState


@pytest.fixture
def pool_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ember-node-", dir="/tmp"))  # short: socket paths < 108 bytes
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    base = {"EMBER_HOME": str(tmp_path), "EMBER_NODE_NAME": "n1"}
    assert NodeConfig.from_env(base).node == "n1"
    with pytest.raises(ValueError, match="EMBER_POOL_ARENA"):
        NodeConfig.from_env({**base, "EMBER_POOL_ARENA": "lots"})
    with pytest.raises(ValueError, match="EMBER_REPORT_INTERVAL"):
        NodeConfig.from_env({**base, "EMBER_REPORT_INTERVAL": "0"})
    with pytest.raises(ValueError, match="node name"):
        NodeConfig.from_env({**base, "EMBER_NODE_NAME": "a/b"})
    with pytest.raises(ValueError, match="too long"):
        NodeConfig.from_env({**base, "EMBER_POOL_DIR": "/tmp/" + "x" * 120})


def test_node_serves_pool_reports_and_recovers(
    tmp_path: Path, pool_dir: Path, redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    env = {
        "EMBER_HOME": str(tmp_path / "home"),
        "EMBER_POOL_DIR": str(pool_dir),
        "EMBER_NODE_NAME": "node-a",
        "EMBER_POOL_ARENA": "64MiB",
        "EMBER_POOL_SESSION_KV_QUOTA": "1MiB",
        "EMBER_REPORT_INTERVAL": "0.2",
        "EMBER_REDIS_URL": redis_server.url,
    }
    socket_path = str(pool_dir / "cpu.sock")

    def report_time() -> float:
        report = state.device_reports().get("node-a/cpu")
        return float(report.document["updated"]) if report is not None else 0.0

    async def wait(predicate: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(predicate):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_node(env, stop))
        try:
            await wait(lambda: report_time() > 0, 60)
            report = state.device_reports()["node-a/cpu"]
            assert report.document["capacity_bytes"] == 64 << 20
            # A function pod's session: no ticket, KV up to the node's per-session quota.
            with PoolClient(socket_path, timeout=5.0) as client:
                client.kv_alloc(2, 256 << 10)
                with pytest.raises(RemotePoolError) as refused:
                    client.kv_alloc(8, 256 << 10)
                assert refused.value.kind is KVQuotaExceeded
            # SIGKILL of the pool: restarted on the same socket, and reports resume.
            pid = int(client_pid(socket_path))
            os.kill(pid, signal.SIGKILL)
            await wait(lambda: client_pid(socket_path) not in (None, pid), 30)
            before = report_time()
            await wait(lambda: report_time() > before, 10)
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        assert not Path(socket_path).exists() or client_pid(socket_path) is None

    asyncio.run(scenario())


def client_pid(socket_path: str) -> int | None:
    """The pid of the live pool daemon started for ``socket_path`` (None: none serves it)."""
    try:
        with PoolClient(socket_path, timeout=2.0) as client:
            client.stats()
    except OSError:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"gpu_pool" in b" ".join(argv) and socket_path.encode() in argv and status != "Z":
            return int(entry.name)
    return None


def test_node_registers_deployed_models_in_its_own_store(
    tmp_path: Path, pool_dir: Path, state: ClusterState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployed function's model appears in the node's store under the gateway's model id,
    a source this node cannot read is retried without stopping anything."""
    from runtime.node_daemon import NodeDaemon, WantedModel
    from tests.runtime.pod_worker import make_home, put_function

    monkeypatch.setenv("EMBER_MODEL_ROOTS", str(tmp_path))
    gateway_home = make_home(tmp_path / "gw")  # what the gateway registered at deploy
    put_function(state, gateway_home)
    node_home = tmp_path / "node"
    config = NodeConfig.from_env(
        {"EMBER_HOME": str(node_home), "EMBER_POOL_DIR": str(pool_dir), "EMBER_NODE_NAME": "n1"}
    )
    missing = WantedModel(str(tmp_path / "gone.gguf"), "float32", "gone-000000000000-fp32")

    def wanted() -> list[WantedModel]:
        record = state.function("tiny")
        assert record.model is not None
        model = record.spec["spec"]["model"]
        return [WantedModel(model["source"], model["dtype"], record.model.model_id), missing]

    daemon = NodeDaemon(config, state.report_device, wanted)
    done = asyncio.run(daemon.sync_models())
    model_id = gateway_home.model.model_id
    assert done == [model_id]
    assert Path(daemon.registered[model_id]) == node_home / "models" / model_id
    assert any((node_home / "models" / model_id).iterdir())
    assert asyncio.run(daemon.sync_models()) == []  # idempotent; the missing source waits its backoff


def test_a_slow_registration_does_not_hold_back_the_reports(
    tmp_path: Path, pool_dir: Path, state: ClusterState
) -> None:
    """Regression: registration ran in the report loop's tick, so a model taking longer than
    the extender's report TTL (10 s) to register (a large conversion, a slow source) left the
    node's record stale and the extender filtered out a node whose pool served."""
    import threading

    from runtime.node_daemon import NodeDaemon, WantedModel

    config = NodeConfig.from_env(
        {"EMBER_HOME": str(tmp_path / "node"), "EMBER_POOL_DIR": str(pool_dir),
         "EMBER_NODE_NAME": "n1", "EMBER_REPORT_INTERVAL": "0.1"}
    )  # fmt: skip
    release = threading.Event()

    def wanted() -> list[WantedModel]:  # the cluster state answering as slowly as a long register
        release.wait(10)
        return []

    reports: list[float] = []

    def report(device_id: str, record: dict[str, object]) -> None:
        reports.append(time.monotonic())
        state.report_device(device_id, record)

    async def main() -> None:
        daemon = NodeDaemon(config, report, wanted)
        await daemon.start()
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        try:
            await asyncio.sleep(2.0)
        finally:
            release.set()
            stop.set()
            await asyncio.wait_for(task, 10)
            await daemon.close()

    asyncio.run(main())
    assert len(reports) >= 5, reports  # ~20 at 0.1 s; one while a registration held the tick


def test_stopping_does_not_wait_for_a_registration_in_flight(tmp_path: Path, pool_dir: Path) -> None:
    """Regression: registration ran in the loop's executor, which asyncio.run waits for at
    exit: SIGTERM during a long conversion kept ``ember node`` alive until it finished (or
    Kubernetes' SIGKILL)."""
    import threading

    from runtime.node_daemon import NodeDaemon, WantedModel

    config = NodeConfig.from_env(
        {"EMBER_HOME": str(tmp_path / "node"), "EMBER_POOL_DIR": str(pool_dir),
         "EMBER_NODE_NAME": "n1", "EMBER_REPORT_INTERVAL": "0.1"}
    )  # fmt: skip
    never = threading.Event()

    def wanted() -> list[WantedModel]:  # a registration that outlives the process's stop
        never.wait(20)
        return []

    async def main() -> None:
        daemon = NodeDaemon(config, lambda device, record: None, wanted)
        await daemon.start()
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 10)
        await daemon.close()

    t0 = time.monotonic()
    try:
        asyncio.run(main())
        assert time.monotonic() - t0 < 10
    finally:
        never.set()
