"""The allocator, Reuse Store and process tests again, on a CUDA arena (marked ``gpu``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from gpu_pool.client import PoolClient
from gpu_pool.manifest import Manifest
from tests.conftest import random_tensors, wait_until, write_entry
from tests.gpu_pool.test_reuse_store import ReuseStoreMachine, manifests  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu


def _cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


@pytest.fixture(autouse=True)
def _need_cuda() -> None:
    if not _cuda_available():
        pytest.skip("needs CuPy and a CUDA device")


class CudaReuseStoreMachine(ReuseStoreMachine):
    @staticmethod
    def make_arena(capacity: int):  # type: ignore[no-untyped-def]
        from gpu_pool.arena.cuda import CudaArena

        return CudaArena(0, capacity, host_cache_bytes=1 << 20)


def test_reuse_store_state_machine_on_cuda(manifests: list[Manifest]) -> None:  # noqa: F811
    CudaReuseStoreMachine.manifests = manifests
    run_state_machine_as_test(
        CudaReuseStoreMachine,
        settings=settings(
            max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


@pytest.fixture
def cuda_pool(tmp_path: Path) -> Iterator[str]:
    sock = str(tmp_path / "cuda.sock")
    store_root = tmp_path / "store"  # where the tests write their entries
    store_root.mkdir()
    cmd = [sys.executable, "-m", "gpu_pool", "--device", "cuda:0", "--arena", "64MiB", "--socket", sock]
    proc = subprocess.Popen(
        [*cmd, "--store", str(store_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        assert json.loads(line)["device"] == "cuda:0"
        yield sock
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


CLIENT = """
    import json, sys
    from gpu_pool import store
    from gpu_pool.client import PoolClient
    c = PoolClient(sys.argv[1])
    t = c.acquire(store.read(sys.argv[2]))["t1"]
    kv = c.kv_alloc(2, 4096)
    assert t.is_cuda
    print(json.dumps({"offset": t.data_ptr() - c.arena().data_ptr(), "sum": int(t.long().sum())}), flush=True)
    sys.stdin.readline()
"""


def test_two_processes_attach_over_ipc_and_see_the_same_bytes(cuda_pool: str, tmp_path: Path) -> None:
    tensors = random_tensors(5, [1000, 300_000, 17])
    manifest = write_entry(tmp_path / "store", "m", tensors)
    entry = str(tmp_path / "store" / "m")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CLIENT), cuda_pool, entry],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(2)
    ]
    try:
        infos = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        assert len(infos) == 2
        assert infos[0] == infos[1]
        assert infos[0]["sum"] == int(tensors["t1"].long().sum())
        with PoolClient(cuda_pool) as observer:
            assert observer.stats()["bytes_loaded"] == manifest.nbytes
            assert observer.stats()["kv_bytes"] > 0
            os.kill(procs[0].pid, signal.SIGKILL)
            os.kill(procs[1].pid, signal.SIGKILL)

            def released() -> bool:
                s = observer.stats()
                return s["pinned_bytes"] == 0 and s["kv_bytes"] == 0

            assert wait_until(released, timeout=1.0) < 1.0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
