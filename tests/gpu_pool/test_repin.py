"""Pinning again what a release unpinned (``reacquire``, a standby's activation): in the store,
where its views must still point, and through a real daemon, where anything else falls back
to a plain acquire in the same round trip. The state machine of ``test_reuse_store.py`` also
reacquires between its other steps."""

from __future__ import annotations

import asyncio
import copy
import shutil
from pathlib import Path

import pytest

from gpu_pool.arena.cpu import CpuArena
from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.errors import SessionError
from gpu_pool.planner.eviction import EvictionPolicy
from gpu_pool.server.reuse_store import ReuseStore, StoreConfig
from tests.conftest import PoolProcess, random_tensors, write_entry

MIB = 1 << 20


def test_a_released_model_is_pinned_again_where_it_was_and_counted_as_a_request(tmp_path: Path) -> None:
    model = write_entry(tmp_path, "m", random_tensors(1, [1000, 250_000, 7]))
    arena = CpuArena(4 * MIB, prefault=False)
    try:
        store = ReuseStore(arena)
        store.open_session("s")
        assert store.reacquire("s", model) is None  # nothing acquired
        store.acquire("s", model)
        store.release("s")
        first = store.acquire("s", model, access=False)  # a standby's preparation
        assert store.reacquire("s", model) is None  # not released since: nothing to pin again
        store.release("s")
        before = dict(store.counters)
        assert store.reacquire("s", copy.copy(model)) is None  # the same model, trusted anew
        store.release("s")  # (the daemon then acquires it the usual way)
        store.acquire("s", model, access=False)
        store.release("s")
        before = dict(store.counters)
        again = store.reacquire("s", model)
        assert again is not None and again.bytes_reused == model.nbytes and again.bytes_loaded == 0
        assert all(t.pins == {"s": 1} for t in store.tensors.values())
        assert {e.name: store.tensors[e.fingerprint].offset for e in model.tensors} == first.placements
        assert store.counters["acquires"] == before.get("acquires", 0) + 1
        assert store.counters["bytes_reused"] == before.get("bytes_reused", 0) + model.nbytes
        assert store.rates.rate(model.model_id, store.clock()) > 0  # a request for the model
        assert store.reacquire("s", model) is None  # once per release
        store.release("s")
        store.acquire("s", model)  # an acquire since the release: its own pins
        assert store.reacquire("s", model) is None
    finally:
        arena.close()


def test_a_released_model_evicted_moved_or_reloaded_is_not_pinned_again(tmp_path: Path) -> None:
    """Views made before the release would point at other bytes: the caller acquires again."""
    models = [write_entry(tmp_path, f"m{i}", random_tensors(i, [MIB])) for i in range(3)]
    big = write_entry(tmp_path, "big", random_tensors(9, [2 * MIB]))
    arena = CpuArena(4 * MIB, prefault=False)
    try:
        store = ReuseStore(arena, StoreConfig(eviction=EvictionPolicy.LRU))
        for sid, model in zip("abc", models, strict=True):
            store.open_session(sid)
            store.acquire(sid, model)
            store.release(sid)
        store.evict(models[1].model_id)  # a hole between m0 and m2: loading big moves m2 into it
        store.open_session("d")
        assert store.acquire("d", big).bytes_moved == MIB
        assert store.reacquire("b", models[1]) is None  # evicted
        assert store.reacquire("c", models[2]) is None  # moved
        assert store.reacquire("a", models[0]) is not None  # untouched
        store.release("a")
        store.evict(models[0].model_id)
        store.acquire("d", models[0])  # loaded again, at the same offset: another record
        assert store.tensors[models[0].tensors[0].fingerprint].offset == 0
        assert store.reacquire("a", models[0]) is None
    finally:
        arena.close()


def test_reacquire_through_the_daemon(pool_process: PoolProcess, store_root: Path) -> None:
    """Unchanged: one short reply, counted as an acquire. Evicted meanwhile: the daemon acquires
    the session's last manifest itself and sends the placements. Refused: a session whose last
    acquire was of another model (or of none), and a model the store no longer holds."""
    model = write_entry(store_root, "m", random_tensors(1, [1000, 250_000, 7, 4096]))
    other = write_entry(store_root, "o", random_tensors(2, [64]))

    async def scenario() -> None:
        with PoolClient(pool_process.socket_path) as c:
            with pytest.raises(RemotePoolError) as nothing:
                await c.reacquire_async(model)
            assert nothing.value.kind is SessionError
            assert c.can_reacquire
            c.acquire_placements(model)
            c.release()
            placements = c.acquire_placements(model, access=False)
            c.release()
            with pytest.raises(RemotePoolError) as another:
                await c.reacquire_async(other)
            assert another.value.kind is SessionError
            acquires = c.stats()["acquires"]
            assert await c.reacquire_async(model) is None
            assert c.last_acquire is not None and c.last_acquire.bytes_reused == model.nbytes
            assert c.stats()["acquires"] == acquires + 1 and c.stats()["pinned_bytes"] > 0
            c.release()
            with PoolClient(pool_process.socket_path, admin_token=pool_process.admin_token) as admin:
                assert admin.evict() > 0
            again = await c.reacquire_async(model)
            assert again is not None and set(again) == set(placements)
            assert c.last_acquire is not None and c.last_acquire.bytes_loaded == model.nbytes
            assert c.views(model, again)["t1"].equal(random_tensors(1, [1000, 250_000, 7, 4096])["t1"])
            c.release()
            # Removed from the store while resident: refused, as an acquire of it would be.
            shutil.rmtree(Path(model.tensors[0].file).parent)
            with pytest.raises(RemotePoolError) as removed:
                await c.reacquire_async(model)
            assert removed.value.code == "untrusted_manifest"
            assert c.stats()["pinned_bytes"] == 0

    asyncio.run(scenario())
