"""A deploy or delete whose record Redis stored but did not confirm on disk (scheduler.durable)
is answered 503 ``state_not_durable``, after the rest of it happened: the uploaded module is
stored (or removed), so repeating the request completes it instead of finding it half done."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.function_code import FunctionCodeConfig
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState
from tests.gateway.test_function_code import MODULE, upload


class Disk:
    """An fsync that fails while ``failing`` (an I/O error on the state directory's disk)."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.server = server
        self.failing = False

    def sync(self) -> None:
        if self.failing:
            raise OSError(errno.EIO, "Input/output error")
        self.server.sync_files()


@pytest.fixture
def disk(redis_server: EmbeddedRedis) -> Disk:
    return Disk(redis_server)


@pytest.fixture
def flaky_state(redis_server: EmbeddedRedis, disk: Disk) -> Iterator[ClusterState]:
    state = ClusterState.from_url(redis_server.url, sync_records=disk.sync)
    try:
        yield state
    finally:
        state.close()


def test_a_deploy_and_a_delete_not_on_disk_finish_and_say_so(
    flaky_state: ClusterState, disk: Disk, tmp_path: Path
) -> None:
    code = FunctionCodeConfig(tmp_path / "home" / "functions")
    with TestClient(create_app(flaky_state, GatewayConfig(code=code))) as http:
        disk.failing = True
        deployed = http.post("/v1/functions", json=upload("echo", "echo.py", MODULE))
        assert deployed.status_code == 503 and deployed.headers["retry-after"] == "1"
        error = deployed.json()["error"]
        assert error["type"] == "state_not_durable" and "Input/output error" in error["message"]
        assert str(tmp_path) not in error["message"]  # no path of the server's in the answer
        assert "echo" in flaky_state.functions()  # stored, with its module
        assert code.function_dir("echo").is_dir()
        disk.failing = False
        again = http.post("/v1/functions", json=upload("echo", "echo.py", MODULE))
        assert again.status_code == 201, again.text  # repeating it completes it

        disk.failing = True
        deleted = http.delete("/v1/functions/echo")
        assert deleted.status_code == 503 and deleted.json()["error"]["type"] == "state_not_durable"
        assert "echo" not in flaky_state.functions()
        assert not code.function_dir("echo").exists()  # its module went with it all the same
