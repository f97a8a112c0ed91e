"""Shared fixtures: real store entries on disk, real pool daemons in their own processes."""

from __future__ import annotations

import mmap
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_pool import store
from gpu_pool.manifest import Manifest
from gpu_pool.spawn import PoolProcess as SpawnedPool
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState


def random_tensors(seed: int, sizes: list[int], prefix: str = "t") -> dict[str, torch.Tensor]:
    """Named uint8 tensors of the given byte sizes filled with seeded random bytes."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }


def write_entry(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> Manifest:
    return store.write(root / name, tensors, model_id=name)


class PoolProcess(SpawnedPool):
    """A pool daemon for tests: no pre-faulting, ``arena`` defaulting to 16 MiB, trusting the
    model store roots in ``store`` (none: it refuses every acquire of tensors)."""

    def __init__(
        self, socket_path: Path, arena: str = "16MiB", *extra: str, store: tuple[Path, ...] = ()
    ) -> None:
        super().__init__(
            str(socket_path),
            arena,
            extra_args=extra,
            env={"EMBER_POOL_PREFAULT": "false"},
            store_roots=store,
        )


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real redis-server of our own (append-only file under ``tmp_path``)."""
    srv = EmbeddedRedis(tmp_path / "redis")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def state(redis_server: EmbeddedRedis) -> Iterator[ClusterState]:
    """A ClusterState over the test's own redis-server (records fsynced, as ``ember serve``'s)."""
    s = ClusterState.from_url(redis_server.url, sync_records=redis_server.sync_files)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """The model store root of a test: entries written under it load into ``pool_process``."""
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture
def pool_process(tmp_path: Path, store_root: Path) -> Iterator[PoolProcess]:
    pool = PoolProcess(tmp_path / "pool.sock", store=(store_root,))
    try:
        yield pool
    finally:
        pool.stop()


def wait_until(predicate: object, timeout: float, interval: float = 0.01) -> float:
    """Seconds until ``predicate()`` is true; raises AssertionError after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


class CountingSocket:
    """The client's real socket, counting the writes (one per round trip of requests)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writes = 0
        self.bytes = 0

    def sendall(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def mapped_pages(address: int, num_pages: int) -> list[bool]:
    """Whether each page from ``address`` is in this process's page tables (/proc/self/pagemap's
    present bit, readable without privilege)."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // mmap.PAGESIZE * 8)
        entries = pagemap.read(num_pages * 8)
    return [bool(int.from_bytes(entries[i : i + 8], "little") >> 63) for i in range(0, len(entries), 8)]
