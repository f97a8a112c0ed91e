"""End to end: a deploy that finds the disk full is a 507 with ``Retry-After`` that leaves
nothing half-written, and the same deploy succeeds once there is space again.

``ember serve`` runs in a mount namespace of its own (``unshare``) where ``EMBER_HOME/models``
and ``EMBER_HOME/functions`` are small tmpfs file systems: a real ``ENOSPC``, nothing mocked.
The test fills and frees them through ``/proc/PID/root``, which resolves paths in the server's
namespace.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.function_code import with_handler_module
from gateway.spawn import ServeProcess
from tests.gateway.conftest import FUNCTIONS, chat_spec

pytestmark = pytest.mark.slow

MOUNTS = {"models": "1g", "functions": "1m"}  # tmpfs sizes: SmolLM2's store entry is ~270 MB
FILLER = "filler"


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return os.system("unshare -rm true >/dev/null 2>&1") == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if not _can_unshare():
        pytest.skip("needs `unshare -rm` (user and mount namespaces) for a tmpfs of its own")
    home = tmp_path_factory.mktemp("full-home")
    script = "set -e; "
    for name, size in MOUNTS.items():
        (home / name).mkdir(mode=0o700)
        script += f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$0/{name}"; '
    prefix = ("unshare", "-rm", "sh", "-c", script + 'exec "$@"', str(home))
    proc = ServeProcess(home, env={"EMBER_PREWARM": "0", "EMBER_ARENA": "64MiB"}, prefix=prefix)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def inside(server: ServeProcess, name: str) -> Path:
    """``EMBER_HOME/name`` as the server sees it (its tmpfs, not the directory under it)."""
    return Path(f"/proc/{server.proc.pid}/root") / str(server.home.resolve()).lstrip("/") / name


def fill(directory: Path) -> None:
    """Take every free block of the file system ``directory`` is on."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    fd = os.open(directory / FILLER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, free)
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0


def leftovers(directory: Path) -> list[str]:
    """What a failed write left in ``directory`` (lock files are the registry's, and empty)."""
    return sorted(p.name for p in directory.iterdir() if p.name != FILLER and not p.name.startswith(".lock-"))


def assert_storage_full(response: httpx.Response, what: str) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["type"] == "insufficient_storage"
    assert f"no space left on the server to store {what}" in error["message"]
    assert int(response.headers["retry-after"]) >= 1


def test_a_full_model_store_is_507_and_the_deploy_succeeds_once_there_is_space(server: ServeProcess) -> None:
    models = inside(server, "models")
    assert os.statvfs(models).f_blocks * os.statvfs(models).f_frsize <= 1 << 30  # the tmpfs
    fill(models)
    with httpx.Client(base_url=server.url, timeout=300) as http:
        full = http.post("/v1/functions", json=chat_spec("full"))
        assert_storage_full(full, "the model of spec.model.source")
        assert http.get("/healthz").status_code == 200  # the same keep-alive connection
        assert leftovers(models) == []  # no partial store entry, no staging directory
        assert http.get("/v1/functions/full").status_code == 404
        (models / FILLER).unlink()
        created = http.post("/v1/functions", json=chat_spec("full"))
        assert created.status_code == 201, created.text
        assert http.get("/v1/functions/full").status_code == 200


def test_a_full_function_store_is_507_and_the_upload_succeeds_once_there_is_space(
    server: ServeProcess,
) -> None:
    functions = inside(server, "functions")
    fill(functions)
    spec_file = FUNCTIONS / "summarize" / "function.yaml"
    body = with_handler_module(yaml.safe_load(spec_file.read_text()), spec_file)  # as `ember deploy -f`
    with httpx.Client(base_url=server.url, timeout=300) as http:
        full = http.post("/v1/functions", json=body)
        assert_storage_full(full, "the handler module ")
        assert http.get("/v1/functions/summarize").status_code == 404
        assert [p for p in functions.rglob("*") if p.is_file() and p.name != FILLER] == []
        (functions / FILLER).unlink()
        created = http.post("/v1/functions", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["handler"].startswith(f"{server.home.resolve() / 'functions'}/")
