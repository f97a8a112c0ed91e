"""A function pod simulated with Linux namespaces (issue 11): the worker runs under
``unshare --pid --ipc --mount`` with a private ``/dev/shm`` and the pool's socket directory
bind-mounted read-only (as Knative mounts a hostPath), attaches to a pool outside its
namespaces (the arena comes over the socket as a file descriptor) and serves. Skipped where
``unshare`` is refused (it needs root or user namespaces)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from gpu_pool.client import PoolClient
from runtime.worker_guard import TOKEN_HEADER
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState
from tests.conftest import PoolProcess, wait_until
from tests.runtime.pod_worker import (
    free_port,
    make_home,
    pod_environment,
    put_function,
    read,
    start_worker,
    wait_status,
)

pytestmark = pytest.mark.slow

UNSHARE = ["unshare", "--pid", "--ipc", "--mount", "--fork", "--kill-child"]
# Inside the namespaces, before the worker: a private /dev/shm, the pool directory read-only at
# the path the pod sees (EMBER_POOL_DIR), and proof that it is read-only.
POD_SETUP = """set -e
mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm
mount --bind "$HOST_POOL_DIR" "$EMBER_POOL_DIR"
mount -o remount,bind,ro "$EMBER_POOL_DIR"
if touch "$EMBER_POOL_DIR/probe" 2>/dev/null; then echo "the pool directory is writable" >&2; exit 3; fi
exec "$@"
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = [*UNSHARE, "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"]
    return subprocess.run(probe, check=False, capture_output=True).returncode == 0


def _mounts(pid: int) -> dict[str, tuple[str, str, str]]:
    """Mount point -> (mount id, filesystem type, mount options) as process ``pid`` sees them."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        out[fields[4]] = (fields[0], fields[sep + 1], fields[5])  # the last mount at a point wins
    return out


def test_a_worker_in_its_own_namespaces_attaches_to_a_pool_outside_and_serves(
    tmp_path: Path, redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    if not _unshare_works():
        pytest.skip("unshare --pid --ipc --mount is refused here")
    home = make_home(tmp_path / "tiny")
    put_function(state, home)
    host_pool_dir, pod_pool_dir = tmp_path / "host-run", tmp_path / "pod-run"
    host_pool_dir.mkdir()
    pod_pool_dir.mkdir()
    pool = PoolProcess(host_pool_dir / "cpu.sock", "16MiB", store=(home.model.store_path,))
    env = pod_environment(home, redis_server.url, pod_pool_dir, free_port(), HOST_POOL_DIR=str(host_pool_dir))
    logs = tmp_path / "logs"
    proc = start_worker(["--function", "tiny"], env, logs, prefix=[*UNSHARE, "sh", "-c", POD_SETUP, "pod"])
    url = f"http://127.0.0.1:{env['PORT']}"
    try:
        wait_status(f"{url}/readyz", 200, proc, logs, timeout=120)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
        (worker_pid,) = (int(p) for p in children.split())  # unshare's child: the pod's pid 1
        for ns in ("pid", "ipc", "mnt"):
            assert os.readlink(f"/proc/{worker_pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
        status = Path(f"/proc/{worker_pid}/status").read_text()
        assert next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[-1] == "1"
        mounts = _mounts(worker_pid)
        assert mounts[str(pod_pool_dir)][2].split(",")[0] == "ro"
        shm_id, shm_type, _ = mounts["/dev/shm"]
        ours = _mounts(os.getpid()).get("/dev/shm", ("",))[0]
        assert shm_type == "tmpfs" and shm_id != ours  # its own /dev/shm

        auth = {TOKEN_HEADER: env["EMBER_WORKER_TOKEN"]}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
            reply = http.post("/invoke", json={"n": 2})
        assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")
        with PoolClient(pool.socket_path) as observer:
            assert observer.stats()["pinned_bytes"] > 0  # its weights: the pool's, outside

        os.kill(worker_pid, signal.SIGTERM)  # what the kubelet sends the container
        assert proc.wait(timeout=60) == 0, read(logs / "stderr")[-3000:]
        wait_until(lambda: state.instances("tiny") == [], timeout=10)
        with PoolClient(pool.socket_path) as observer:
            assert observer.stats()["sessions"] == 1  # the observer's own
        assert not (host_pool_dir / "probe").exists()
    finally:
        if proc.poll() is None:
            proc.kill()  # --kill-child takes the worker along
            proc.wait()
        pool.stop()
