"""Redis refusing writes (OOM, MISCONF) becomes typed scheduler errors, never a raw ResponseError."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from scheduler.errors import StateNotWritable, StateOutOfMemory, StatePersistenceFailed, StateUnavailable
from scheduler.redis_server import EmbeddedRedis
from scheduler.state import ClusterState


@pytest.fixture
def admin(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


def writes(state: ClusterState) -> None:
    """One plain command and one Lua script that write."""
    state.put_function("f", {"x": 1})
    state.scale_up("f", 99, "cpu")


def test_out_of_memory_is_state_out_of_memory(state: ClusterState, admin: redis.Redis) -> None:
    writes(state)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        for write in (lambda: state.put_function("g", {}), lambda: state.scale_up("f", 99, "cpu")):
            with pytest.raises(StateOutOfMemory, match="state store cannot write") as info:
                write()
            assert isinstance(info.value, StateNotWritable) and info.value.code == "state_out_of_memory"
        assert state.get_record("f")["spec"] == {"x": 1}  # reads still work
    finally:
        admin.config_set("maxmemory", "0")
    writes(state)


def test_misconf_is_state_persistence_failed(state: ClusterState, admin: redis.Redis) -> None:
    writes(state)
    directory = admin.config_get("dir")["dir"]
    admin.config_set("save", "3600 1")
    admin.config_set("stop-writes-on-bgsave-error", "yes")
    admin.config_set("dir", "/proc")  # no file can be created there, not even by root
    try:
        admin.bgsave()
        deadline = time.monotonic() + 10
        while admin.info("persistence")["rdb_last_bgsave_status"] != "err":
            assert time.monotonic() < deadline, "BGSAVE did not fail"
            time.sleep(0.05)
        for write in (lambda: state.put_function("g", {}), lambda: state.scale_up("f", 99, "cpu")):
            with pytest.raises(StatePersistenceFailed, match="state store cannot write") as info:
                write()
            assert info.value.code == "state_persistence_failed"
        assert state.get_record("f")["spec"] == {"x": 1}
    finally:
        admin.config_set("dir", directory)
        admin.config_set("save", "")
    writes(state)  # a successful save is not needed once no save points are configured


def test_a_server_that_is_not_redis_is_state_unavailable() -> None:
    """Regression: EMBER_REDIS_URL naming an HTTP service raised redis' InvalidResponse out of
    every call (a traceback at ``ember worker`` start, a 500 from the extender)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    state = ClusterState.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        with pytest.raises(StateUnavailable, match="not Redis"):
            state.device_reports()
    finally:
        state.close()
        listener.close()
