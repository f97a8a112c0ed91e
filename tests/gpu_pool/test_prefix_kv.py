"""Prefix KV published into the pool and restored by later sessions: a real daemon and sockets."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gpu_pool.client import KVBlocks, PoolClient, PrefixPrefetch, RemotePoolError
from gpu_pool.config import PoolConfig
from gpu_pool.errors import ConfigError, Forbidden, InvalidArgument, ProtocolError
from gpu_pool.manifest import Manifest
from gpu_pool.server import prefix_kv
from gpu_pool.server.kv_copy import INLINE_COPY_BYTES
from gpu_pool.wire import messages
from tests.conftest import PoolProcess, random_tensors, write_entry

pytestmark = pytest.mark.slow

BLOCK = 8192
LAYOUT = "bf16-bs16"


@pytest.fixture
def manifest(store_root: Path) -> Manifest:
    return write_entry(store_root, "m", random_tensors(1, [1000, 50_000]))


def fill(client: PoolClient, n: int, seed: int, size: int = BLOCK) -> tuple[list[int], list[bytes]]:
    """``n`` KV blocks of ``size`` bytes of this session, each filled with its own byte; their
    ids and contents."""
    kv = client.kv_alloc(n, size, aligned=True)
    mem = client.kv_arena()
    contents = []
    for i, off in enumerate(kv.offsets):
        mem[off : off + size] = (seed + i) % 251 + 1
        contents.append(bytes(mem[off : off + size].numpy()))
    return list(kv.block_ids), contents


def scoped(pool: PoolProcess, scope: str = "f") -> PoolClient:
    """A session whose ticket names ``scope`` (a managed pool shares prefix KV within one only)."""
    with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
        ticket = admin.grant(64 << 20, prefix_scope=scope)
    return PoolClient(pool.socket_path, ticket=ticket)


def read_blocks(
    client: PoolClient, block_ids: list[int], offsets: dict[int, int], size: int = BLOCK
) -> list[bytes]:
    mem = client.kv_arena()
    return [bytes(mem[offsets[b] : offsets[b] + size].numpy()) for b in block_ids]


def test_published_blocks_outlive_their_session_and_restore_the_longest_run(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    hashes = [os.urandom(16) for _ in range(4)]
    with scoped(pool_process) as a:
        a.acquire(manifest)
        ids, contents = fill(a, 4, seed=10)
        assert a.kv_publish("m", LAYOUT, hashes, ids, recompute_s=0.01) == 4
        assert a.kv_publish("m", LAYOUT, hashes, ids) == 0  # already there: only touched
        stats = a.stats()
        assert stats["prefix_blocks"] == 4 and stats["prefix_bytes"] == 4 * BLOCK
    with scoped(pool_process) as b:  # a later instance of the same model
        b.acquire(manifest)
        kv = b.kv_alloc(4, BLOCK, aligned=True)
        offsets = dict(zip(kv.block_ids, kv.offsets, strict=True))
        probe = [hashes[0], hashes[1], os.urandom(16), hashes[3]]
        assert b.kv_restore("m", LAYOUT, probe, list(kv.block_ids)) == 2
        got = read_blocks(b, list(kv.block_ids), offsets)
        assert got[:2] == contents[:2] and got[2] == bytes(BLOCK)
        assert b.kv_restore("m", "other-layout", hashes, list(kv.block_ids)) == 0
        assert b.stats()["prefix_blocks_restored"] == 2


@pytest.mark.parametrize("size", [BLOCK, 512 << 10])
def test_copies_on_the_daemons_loop_and_in_a_thread_move_the_same_bytes(
    pool_process: PoolProcess, manifest: Manifest, size: int
) -> None:
    """Three blocks: 24 KiB are copied on the daemon's event loop, 1.5 MiB in a thread."""
    assert (3 * size <= INLINE_COPY_BYTES) == (size == BLOCK)
    hashes = [os.urandom(16) for _ in range(3)]
    with scoped(pool_process) as a:
        a.acquire(manifest)
        ids, contents = fill(a, 3, seed=20, size=size)
        assert a.kv_publish("m", LAYOUT, hashes, ids) == 3
    with scoped(pool_process) as b:
        b.acquire(manifest)
        kv = b.kv_alloc(3, size, aligned=True)
        offsets = dict(zip(kv.block_ids, kv.offsets, strict=True))
        assert b.kv_restore("m", LAYOUT, hashes, list(kv.block_ids)) == 3
        assert read_blocks(b, list(kv.block_ids), offsets, size) == contents


def test_blocks_and_models_a_session_does_not_own_are_forbidden(
    pool_process: PoolProcess, manifest: Manifest, store_root: Path
) -> None:
    other = write_entry(store_root, "n", random_tensors(2, [3000]))
    h = [os.urandom(16)]
    with scoped(pool_process) as a, scoped(pool_process) as b:
        a.acquire(manifest)
        b.acquire(manifest)
        theirs, _ = fill(b, 1, seed=1)
        mine, _ = fill(a, 1, seed=2)
        calls = [
            lambda: a.kv_publish("m", LAYOUT, h, theirs),
            lambda: a.kv_restore("m", LAYOUT, h, theirs),
            lambda: a.kv_publish("n", LAYOUT, h, mine),  # a model it never acquired
            lambda: a.kv_restore("n", LAYOUT, h, mine),
        ]
        for call in calls:
            with pytest.raises(RemotePoolError) as info:
                call()
            assert info.value.kind is Forbidden
        b.acquire(other)
        for bad in (
            lambda: a.kv_publish("m", LAYOUT, [b"short"], mine),
            lambda: a.kv_publish("m", LAYOUT, h * 2, mine),
            lambda: a.kv_publish("m", LAYOUT, h, mine, recompute_s=float("nan")),
            lambda: a.kv_restore("m", "a/b", h, mine),
        ):
            with pytest.raises(RemotePoolError) as info:
                bad()
            assert info.value.kind is InvalidArgument
        assert a.stats()["prefix_blocks"] == 0


def test_prefix_bytes_are_bounded_and_least_recently_used_go_first(
    tmp_path: Path, store_root: Path, manifest: Manifest
) -> None:
    pool = PoolProcess(tmp_path / "p.sock", "16MiB", "--prefix-bytes", str(3 * BLOCK), store=(store_root,))
    try:
        first = [os.urandom(16) for _ in range(2)]
        second = [os.urandom(16) for _ in range(2)]
        with scoped(pool) as c:
            c.acquire(manifest)
            ids, _ = fill(c, 4, seed=3)
            assert c.kv_publish("m", LAYOUT, first + second, ids) == 3  # the bound: a run's start
            assert c.stats()["prefix_bytes"] == 3 * BLOCK
            assert c.kv_publish("m", LAYOUT, second[1:], ids[3:]) == 1  # evicts first[0], the oldest
            assert c.kv_restore("m", LAYOUT, first, ids[:2]) == 0
            assert c.kv_restore("m", LAYOUT, first[1:] + second, ids[:3]) == 3
            assert c.stats()["prefix_blocks_evicted"] == 1
    finally:
        pool.stop()


def test_prefix_blocks_are_evictable_like_inactive_tensors(tmp_path: Path, store_root: Path) -> None:
    small = write_entry(store_root, "m", random_tensors(1, [4096]))
    big = write_entry(store_root, "big", random_tensors(3, [(8 << 20) - 16384]))
    pool = PoolProcess(tmp_path / "e.sock", "8MiB", store=(store_root,))
    try:
        hashes = [os.urandom(16) for _ in range(8)]
        with scoped(pool) as c:
            c.acquire(small)
            ids, _ = fill(c, 8, seed=4)
            assert c.kv_publish("m", LAYOUT, hashes, ids) == 8
        with PoolClient(pool.socket_path) as c:  # no session holds the prefix: nothing pins it
            c.acquire(big)  # needs some of the room the published blocks took
            stats = c.stats()
            assert stats["prefix_blocks"] < 8 and stats["models"]["big"]["resident_bytes"] == big.nbytes
            # MCE prices a prefix byte below a weight byte of its model: the weights stayed.
            assert stats["models"]["m"]["resident_bytes"] == small.nbytes
        with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
            admin.evict()
            assert admin.stats()["prefix_blocks"] == 0
    finally:
        pool.stop()


def test_scoped_tickets_keep_prefixes_within_their_scope(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    hashes = [os.urandom(16) for _ in range(2)]
    with PoolClient(pool_process.socket_path, admin_token=pool_process.admin_token) as admin:
        scopes = {"f1": "f1", "f1-again": "f1", "f2": "f2"}
        tickets = {name: admin.grant(1 << 20, prefix_scope=scope) for name, scope in scopes.items()}
    with PoolClient(pool_process.socket_path, ticket=tickets["f1"]) as a:
        a.acquire(manifest)
        ids, _ = fill(a, 2, seed=5)
        assert a.kv_publish("m", LAYOUT, hashes, ids) == 2
    for name, expected in (("f2", 0), ("f1-again", 2)):
        with PoolClient(pool_process.socket_path, ticket=tickets[name]) as c:
            c.acquire(manifest)
            ids, _ = fill(c, 2, seed=6)
            assert c.kv_restore("m", LAYOUT, hashes, ids) == expected, name
    with PoolClient(pool_process.socket_path) as unscoped:  # no ticket: no function's scope
        unscoped.acquire(manifest)
        ids, _ = fill(unscoped, 2, seed=7)
        for call in (
            lambda: unscoped.kv_restore("m", LAYOUT, hashes, ids),
            lambda: unscoped.kv_publish("m", LAYOUT, hashes, ids),  # could poison f1's prompts
        ):
            with pytest.raises(RemotePoolError) as info:
                call()
            assert info.value.kind is Forbidden


def test_prefix_bytes_config_fails_loudly() -> None:
    base = {"EMBER_POOL_DEVICE": "cpu", "EMBER_POOL_ARENA": "64MiB", "EMBER_POOL_SOCKET": "/tmp/x.sock"}
    assert PoolConfig.from_env(base).prefix_bytes is None  # a quarter of the arena
    assert PoolConfig.from_env({**base, "EMBER_POOL_PREFIX_BYTES": "8MiB"}).prefix_bytes == 8 << 20
    assert PoolConfig.from_env({**base, "EMBER_POOL_PREFIX_BYTES": "0"}).prefix_bytes == 0
    with pytest.raises(ConfigError, match="EMBER_POOL_PREFIX_BYTES"):
        PoolConfig.from_env({**base, "EMBER_POOL_PREFIX_BYTES": "lots"})
    with pytest.raises(ConfigError, match="prefix_bytes"):
        PoolConfig(device="cpu", arena_bytes=1 << 20, socket_path="/tmp/x.sock", prefix_bytes=-1)


def prefetch(client: PoolClient, manifest: Manifest, num_blocks: int, max_blocks: int) -> KVBlocks:
    """An acquire (on the session's event loop) with ``num_blocks`` blocks and the prefix."""
    prefix = PrefixPrefetch("m", LAYOUT, max_blocks)
    _, kv = asyncio.run(client.acquire_async(manifest, num_blocks, BLOCK, prefix))
    assert kv is not None
    return kv


def test_an_acquire_brings_the_prefix_its_scope_last_restored_first(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    """A new instance's acquire comes with the published blocks of the prefix its function's
    last new instance asked for from its first block (``kv_restore(first=True)``), in its first
    blocks; up to the first block no longer published, ``max_blocks`` and the blocks asked for."""
    hashes = [os.urandom(16) for _ in range(4)]
    with scoped(pool_process) as a:  # an instance computed and published three blocks
        a.acquire(manifest)
        ids, contents = fill(a, 3, seed=30)
        assert a.kv_publish("m", LAYOUT, hashes[:3], ids) == 3
    with scoped(pool_process) as b:  # the next one's first request asked for all four
        b.acquire(manifest)
        ids, _ = fill(b, 4, seed=40)
        assert b.kv_restore("m", LAYOUT, hashes, ids, first=True) == 3
        assert b.kv_restore("m", LAYOUT, hashes[2:], ids[:2]) == 1  # not from the first: not kept
    with scoped(pool_process) as c:
        kv = prefetch(c, manifest, 5, max_blocks=8)
        assert kv.prefix_hashes == tuple(hashes[:3]) and len(kv.block_ids) == 5
        offsets = dict(zip(kv.block_ids, kv.offsets, strict=True))
        assert read_blocks(c, list(kv.block_ids[:3]), offsets) == contents
        assert read_blocks(c, list(kv.block_ids[3:]), offsets) == [bytes(BLOCK)] * 2
        assert c.stats()["kv_bytes"] == 5 * BLOCK
    # (an offer: a max_blocks beyond what the wire allows is cut to it, not refused)
    for num_blocks, max_blocks, expected in ((4, 2, 2), (2, 8, 2), (4, 2 * messages.MAX_PREFIX_BLOCKS, 3)):
        with scoped(pool_process) as d:
            kv = prefetch(d, manifest, num_blocks, max_blocks)
            assert kv.prefix_hashes == tuple(hashes[:expected]) and len(kv.block_ids) == num_blocks
    with scoped(pool_process, "other") as e:  # another function's scope has none
        kv = prefetch(e, manifest, 2, max_blocks=8)
        assert kv.prefix_hashes == () and len(kv.block_ids) == 2
    with PoolClient(pool_process.socket_path) as unscoped:  # no function's scope: plain blocks
        kv = prefetch(unscoped, manifest, 2, max_blocks=8)
        assert kv.prefix_hashes == () and len(kv.block_ids) == 2


def test_an_acquire_brings_no_prefix_of_a_model_it_did_not_acquire(
    pool_process: PoolProcess, manifest: Manifest, store_root: Path
) -> None:
    """The prefix must be of the acquired model (as for kv_restore); otherwise the blocks come
    unfilled and the acquire succeeds."""
    other = write_entry(store_root, "n", random_tensors(2, [3000]))
    hashes = [os.urandom(16)]
    with scoped(pool_process) as a:
        a.acquire(other)
        ids, _ = fill(a, 1, seed=60)
        assert a.kv_publish("n", LAYOUT, hashes, ids) == 1
        assert a.kv_restore("n", LAYOUT, hashes, ids, first=True) == 1
    with scoped(pool_process) as b:
        _, kv = asyncio.run(b.acquire_async(manifest, 2, BLOCK, PrefixPrefetch("n", LAYOUT, 4)))
        assert kv is not None and kv.prefix_hashes == () and len(kv.block_ids) == 2


def test_prefix_prefetch_fields_are_checked() -> None:
    prefix = {"model_id": "m", "layout": LAYOUT, "max_blocks": 4}
    kv = {"num_blocks": 1, "block_bytes": 4096, "prefix": prefix}
    parsed = messages.parse({"op": "acquire", "manifest_bin": b"x", "kv": kv})
    assert isinstance(parsed, messages.Acquire) and parsed.kv is not None
    assert parsed.kv.prefix == messages.PrefixPrefetch("m", LAYOUT, 4)
    parsed = messages.parse({"op": "release", "keep_kv": True})
    assert isinstance(parsed, messages.Release) and parsed.keep_kv
    for bad, kind in (
        ({"op": "kv_alloc", **kv, "prefix": [1]}, ProtocolError),
        ({"op": "kv_alloc", **kv, "prefix": {**prefix, "max_blocks": 0}}, InvalidArgument),
        ({"op": "kv_alloc", **kv, "prefix": {**prefix, "layout": "a/b"}}, InvalidArgument),
        ({"op": "kv_alloc", **kv, "prefix": {"model_id": "m"}}, ProtocolError),
        (
            {
                "op": "kv_restore",
                "model_id": "m",
                "layout": LAYOUT,
                "hashes": [],
                "block_ids": [],
                "first": 1,
            },
            ProtocolError,
        ),
        ({"op": "release", "keep_kv": "yes"}, ProtocolError),
    ):
        with pytest.raises(kind):
            messages.parse(bad)


def test_remembered_prefixes_are_bounded_per_scope(pool_process: PoolProcess, manifest: Manifest) -> None:
    """A scope keeps its ``MAX_RECENT_PER_SCOPE`` most recent (model, layout) runs, and one
    scope remembering many (any hashes, any layouts) never pushes out another's: one function
    cannot fill the daemon's memory or wipe the other functions' prefetches."""
    hashes = [os.urandom(16) for _ in range(2)]
    with scoped(pool_process) as a:  # scope "f": a published, remembered run
        a.acquire(manifest)
        ids, _ = fill(a, 2, seed=70)
        assert a.kv_publish("m", LAYOUT, hashes, ids) == 2
        assert a.kv_restore("m", LAYOUT, hashes, ids, first=True) == 2

    def prefetched(client: PoolClient, layout: str) -> tuple[bytes, ...]:
        _, kv = asyncio.run(client.acquire_async(manifest, 2, BLOCK, PrefixPrefetch("m", layout, 8)))
        assert kv is not None
        return kv.prefix_hashes

    with scoped(pool_process, "evil") as e:
        e.acquire(manifest)
        ids, _ = fill(e, 1, seed=71)
        layouts = [f"bf16-bs16-{i}" for i in range(prefix_kv.MAX_RECENT_PER_SCOPE + 1)]
        for i, layout in enumerate(layouts):
            own = [bytes([i]) * 16]
            assert e.kv_publish("m", layout, own, ids) == 1
            assert e.kv_restore("m", layout, own, ids, first=True) == 1
    with scoped(pool_process, "evil") as e:
        assert prefetched(e, layouts[0]) == ()  # the oldest of its runs went
        assert prefetched(e, layouts[-1]) == (bytes([len(layouts) - 1]) * 16,)
    with scoped(pool_process) as f:
        assert prefetched(f, LAYOUT) == tuple(hashes)


def test_keep_kv_is_asked_only_of_a_daemon_that_says_it_keeps_them(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    """``hello`` names what the daemon does beyond the protocol's first form. A daemon from
    before ``keep_kv`` ignores the field and frees the blocks (the session's engine would then
    hand out blocks the pool gives to others): the client refuses to ask such a daemon, before
    anything is sent, and the blocks stay the session's until a plain release."""
    with scoped(pool_process) as c:
        assert {"keep_kv", "prefix_prefetch"} <= c.features and c.keeps_kv
        c.acquire(manifest)
        fill(c, 2, seed=80)
        c.release(keep_kv=True)
        assert c.stats()["kv_bytes"] == 2 * BLOCK and c.stats()["pinned_bytes"] == 0
        c.features = frozenset()  # as an older daemon's hello (no "features") leaves it
        with pytest.raises(ProtocolError, match="does not keep KV"):
            c.release(keep_kv=True)
        assert c.stats()["kv_bytes"] == 2 * BLOCK
        c.release()
        assert c.stats()["kv_bytes"] == 0
