"""Progressive acquire (TIDAL §5.2) against a real daemon process: placements before the bytes,
readiness per group in access order, failure and disconnect mid-load."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.errors import LoadError
from gpu_pool.manifest import Manifest
from gpu_pool.wire.messages import Acquire
from tests.conftest import PoolProcess, random_tensors, wait_until, write_entry

pytestmark = pytest.mark.slow

SIZES = [300_000] * 24


def _pool(tmp_path: Path, store_root: Path) -> PoolProcess:
    return PoolProcess(tmp_path / "pool.sock", "64MiB", store=(store_root,))


def test_readiness_in_order_and_bytes_right_when_ready(tmp_path: Path, store_root: Path) -> None:
    tensors = random_tensors(3, SIZES)
    manifest = write_entry(store_root, "m", tensors)
    pool = _pool(tmp_path, store_root)
    try:
        with PoolClient(pool.socket_path) as c:
            ends = list(range(2, len(SIZES) + 1, 2))
            placements, readiness = c.acquire_progressive(manifest, ends)
            assert readiness is not None and readiness.ends == tuple(ends)
            views = c.views(manifest, placements)
            seen = 0
            for i, e in enumerate(manifest.tensors):
                readiness.wait(i, timeout=30)
                assert readiness.groups_ready >= max(seen, readiness.group_of(i) + 1)  # never backwards
                seen = readiness.groups_ready
                assert torch.equal(views[e.name], tensors[e.name]), e.name
            assert readiness.done and readiness.ready(0)
            with PoolClient(pool.socket_path) as other:  # committed: resident, nothing to wait for
                again, none = other.acquire_progressive(manifest)
                assert none is None and again == placements
                assert other.last_acquire is not None and other.last_acquire.bytes_loaded == 0
                stats = other.stats()
            assert stats["bytes_loaded"] == sum(SIZES) and stats["acquires"] == 2
    finally:
        pool.stop()


def test_groups_are_checked(tmp_path: Path, store_root: Path) -> None:
    manifest = write_entry(store_root, "m", random_tensors(4, [1000, 2000]))
    with pytest.raises(Exception, match="increasing"):
        Acquire.parse({"progressive": True, "groups": [2, 1]})
    pool = _pool(tmp_path, store_root)
    try:
        with PoolClient(pool.socket_path) as c:
            with pytest.raises(RemotePoolError, match="last group"):
                c.acquire_progressive(manifest, [1])  # does not cover the manifest
            assert c.stats()["num_tensors"] == 0  # refused before pinning or placing anything
    finally:
        pool.stop()


def test_failed_load_is_a_typed_error_and_leaves_nothing(tmp_path: Path, store_root: Path) -> None:
    manifest = write_entry(store_root, "m", random_tensors(5, SIZES))
    data = Path(manifest.tensors[0].file)
    pool = _pool(tmp_path, store_root)
    try:
        with PoolClient(pool.socket_path) as c:
            os.truncate(data, data.stat().st_size // 2)  # the later tensors' bytes are gone
            _, readiness = c.acquire_progressive(manifest)
            assert readiness is not None
            with pytest.raises(LoadError):
                readiness.wait_all(timeout=30)
            with pytest.raises(LoadError):  # and on every later wait
                readiness.wait(len(SIZES) - 1)
            wait_until(lambda: c.stats()["num_tensors"] == 0, 10)
            assert c.stats()["pinned_bytes"] == 0
    finally:
        pool.stop()


def test_disconnect_mid_load_leaves_the_store_consistent(tmp_path: Path, store_root: Path) -> None:
    sizes = [4 << 20] * 48
    tensors = random_tensors(6, sizes)
    manifest = write_entry(store_root, "big", tensors)
    pool = PoolProcess(tmp_path / "pool.sock", "256MiB", store=(store_root,))
    try:
        c = PoolClient(pool.socket_path)
        _, readiness = c.acquire_progressive(manifest)
        assert readiness is not None
        c.close()  # mid-load: the session goes away
        readiness.close()
        with PoolClient(pool.socket_path) as other:
            wait_until(lambda: other.stats()["sessions"] == 1, 10)
            stats = other.stats()
            assert stats["pinned_bytes"] == 0
            # Either the load ended before the daemon noticed (all resident) or none of it is.
            assert stats["num_tensors"] in (0, len(sizes))
            views = other.acquire(manifest)  # loads what is missing; bytes right either way
            for name, t in tensors.items():
                assert torch.equal(views[name], t), name
    finally:
        pool.stop()


def test_release_mid_load_cancels_or_completes_cleanly(tmp_path: Path, store_root: Path) -> None:
    sizes = [4 << 20] * 48
    tensors = random_tensors(7, sizes)
    manifest = write_entry(store_root, "big", tensors)
    pool = PoolProcess(tmp_path / "pool.sock", "256MiB", store=(store_root,))
    try:
        with PoolClient(pool.socket_path) as c:
            _, readiness = c.acquire_progressive(manifest)
            assert readiness is not None
            c.release()  # waits for the load to stop (cancelled between groups) before unpinning
            stats = c.stats()
            assert stats["pinned_bytes"] == 0 and stats["num_tensors"] in (0, len(sizes))
            if stats["num_tensors"] == 0:  # cancelled: the readiness says so
                with pytest.raises(LoadError):
                    readiness.wait_all(timeout=10)
            else:
                readiness.wait_all(timeout=10)
            views = c.acquire(manifest)
            for name, t in tensors.items():
                assert torch.equal(views[name], t), name
    finally:
        pool.stop()


def test_an_acquire_waiting_on_a_load_whose_client_went_away_loads_itself(
    tmp_path: Path, store_root: Path
) -> None:
    # Two instances start on the same evicted model: the first's progressive load is
    # cancelled when its client goes away mid-load. The second, which waited for that load,
    # plans again and loads the bytes itself instead of failing. (Rounds: the second must
    # plan while the first still loads, which one round may miss.)
    models = [write_entry(store_root, f"big{i}", random_tensors(10 + i, [4 << 20] * 24)) for i in range(4)]
    pool = PoolProcess(tmp_path / "pool.sock", "256MiB", store=(store_root,))
    try:
        for manifest in models:
            first = PoolClient(pool.socket_path)
            _, readiness = first.acquire_progressive(manifest)
            assert readiness is not None
            result: dict[str, object] = {}

            def second(manifest: Manifest = manifest, result: dict[str, object] = result) -> None:
                with PoolClient(pool.socket_path) as c:
                    try:
                        c.acquire(manifest)
                        result["ok"] = True
                    except Exception as exc:
                        result["error"] = exc

            thread = threading.Thread(target=second)
            thread.start()
            time.sleep(0.02)  # its acquire is planned: it waits for the first's load
            first.close()  # mid-load: the first's load is cancelled
            readiness.close()
            thread.join(60)
            assert result == {"ok": True}
    finally:
        pool.stop()
