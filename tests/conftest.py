"""Shared fixtures: real store entries on disk, real pool daemons in their own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_pool import store
from gpu_pool.manifest import Manifest


def random_tensors(seed: int, sizes: list[int], prefix: str = "t") -> dict[str, torch.Tensor]:
    """Named uint8 tensors of the given byte sizes filled with seeded random bytes."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }


def write_entry(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> Manifest:
    return store.write(root / name, tensors, model_id=name)


class PoolProcess:
    """A pool daemon running as `python -m gpu_pool` in its own process."""

    def __init__(self, socket_path: Path, arena: str = "16MiB", *extra: str) -> None:
        self.socket_path = str(socket_path)
        env = dict(os.environ, EMBER_POOL_PREFAULT="false")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpu_pool",
                "--device",
                "cpu",
                "--arena",
                arena,
                "--socket",
                self.socket_path,
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"pool daemon failed to start: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        self.ready = json.loads(line)
        assert self.ready["event"] == "ready"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def pool_process(tmp_path: Path) -> Iterator[PoolProcess]:
    pool = PoolProcess(tmp_path / "pool.sock")
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
