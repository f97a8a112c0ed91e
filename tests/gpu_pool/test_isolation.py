"""Issue 10: sessions cannot write the arena, read each other's KV blocks, evict without the
admin token, or hold KV past their quota; bad integers get typed errors; clients see a dead pool."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gpu_pool.client import PoolClient, RemotePoolError, premap
from gpu_pool.config import PoolConfig
from gpu_pool.errors import ConfigError, Forbidden, KVQuotaExceeded
from gpu_pool.manifest import Manifest
from gpu_pool.server.hardening import make_undumpable
from gpu_pool.spawn import PoolProcess as SpawnedPool
from tests.conftest import PoolProcess, random_tensors, write_entry

SIZES = [1000, 250_000, 4096]


@pytest.fixture
def manifest(store_root: Path) -> Manifest:
    return write_entry(store_root, "m", random_tensors(1, SIZES))


def run_client(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


WRITE_WEIGHT = """
    import sys
    from gpu_pool import store
    from gpu_pool.client import PoolClient
    c = PoolClient(sys.argv[1])
    t = c.acquire(store.read(sys.argv[2]))["t1"]
    print("acquired", flush=True)
    t[0] = (int(t[0]) + 1) % 256
    print("written", flush=True)
"""


@pytest.mark.slow
def test_a_worker_that_writes_shared_weights_faults_and_the_bytes_survive(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    entry = str(Path(manifest.tensors[0].file).parent)
    writer = run_client(WRITE_WEIGHT, pool_process.socket_path, entry)
    out, err = writer.communicate(timeout=120)
    assert out.splitlines() == ["acquired"], err  # it never got past the write
    assert writer.returncode == -signal.SIGSEGV
    with PoolClient(pool_process.socket_path) as observer:
        t1 = observer.acquire(manifest)["t1"]
        assert bytes(t1.numpy()) == bytes(random_tensors(1, SIZES)["t1"].numpy())
        assert observer.last_acquire is not None and observer.last_acquire.bytes_loaded == 0
    assert pool_process.alive()


def _arena_fd() -> int:
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the directory's own descriptor
            continue
        if target.startswith("/memfd:ember-pool-arena"):
            return int(name)
    raise AssertionError("no arena memfd in this process")


def test_the_arena_descriptor_cannot_be_reopened_for_writing(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    with PoolClient(pool_process.socket_path) as c:
        assert "path" not in c.arena_handle
        rw = os.open(f"/proc/self/fd/{_arena_fd()}", os.O_RDWR)  # received with hello, not yet mapped
        try:
            expected = bytes(c.acquire(manifest)["t1"].numpy())
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"poison", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(rw, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
        assert bytes(c.acquire(manifest)["t1"].numpy()) == expected


@pytest.mark.parametrize("undumpable", [True, False], ids=["undumpable", "control"])
def test_an_undumpable_process_hides_its_descriptors_from_its_own_uid(undumpable: bool) -> None:
    """What make_undumpable (called by the daemon's run()) buys: same-uid processes cannot
    open /proc/<pool>/fd/*. Both sides drop to uid 65534 (root would pass any check)."""
    r, w = os.pipe()
    target = os.fork()
    if target == 0:  # pragma: no cover (child)
        try:
            os.setgid(65534)
            os.setuid(65534)
            if undumpable:
                make_undumpable()
            else:  # setuid itself left the process undumpable: undo that for the control
                ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
            fd = os.memfd_create("secret")
            os.write(w, f"{fd}\n".encode())
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        fd = int(os.read(r, 64))
        probe = os.fork()
        if probe == 0:  # pragma: no cover (child)
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.close(os.open(f"/proc/{target}/fd/{fd}", os.O_RDONLY))
                code = 1
            except PermissionError:
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(probe, 0)
        assert os.waitstatus_to_exitcode(status) == (0 if undumpable else 1)
    finally:
        os.kill(target, signal.SIGKILL)
        os.waitpid(target, 0)
        os.close(r)
        os.close(w)


KV_WRITER = """
    import sys, torch
    from gpu_pool.client import PoolClient
    c = PoolClient(sys.argv[1])
    kv = c.kv_alloc(4, 4096)
    mem = c.kv_arena()
    pattern = bytes.fromhex(sys.argv[2]) * (4096 // 16)
    for off in kv.offsets:
        mem[off : off + 4096] = torch.frombuffer(bytearray(pattern), dtype=torch.uint8)
    print(" ".join(map(str, kv.offsets)), flush=True)
    sys.stdin.readline()
    print(all(bytes(mem[o : o + 4096].numpy()) == pattern for o in kv.offsets), flush=True)
"""


def test_a_sessions_kv_blocks_are_invisible_to_other_sessions(pool_process: PoolProcess) -> None:
    pattern = bytes(range(0x41, 0x51))
    a = run_client(KV_WRITER, pool_process.socket_path, pattern.hex())
    try:
        assert a.stdout is not None and a.stdin is not None
        offsets = [int(x) for x in a.stdout.readline().split()]
        assert len(offsets) == 4
        with PoolClient(pool_process.socket_path) as b:
            assert pattern not in bytes(b.arena().numpy())
            own = b.kv_arena()
            assert pattern not in bytes(own.numpy())
            mine = b.kv_alloc(2, 4096)
            assert not set(mine.offsets) & set(offsets)
            assert pattern not in bytes(own.numpy())
        a.stdin.write("\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "True"  # and A still has its bytes
    finally:
        a.kill()
        a.communicate()


def test_freed_kv_blocks_lose_their_pages(pool_process: PoolProcess) -> None:
    with PoolClient(pool_process.socket_path) as c:
        kv = c.kv_alloc(3, 8192, aligned=True)
        mem = c.kv_arena()
        for off in kv.offsets:
            mem[off : off + 8192] = 7
        assert c.kv_free(kv.block_ids[:2]) == 2
        assert [int(mem[o : o + 8192].count_nonzero()) for o in kv.offsets] == [0, 0, 8192]
        c.release()
        assert int(mem[kv.offsets[2] : kv.offsets[2] + 8192].count_nonzero()) == 0


def test_premapped_arena_is_reused_by_a_later_session(pool_process: PoolProcess) -> None:
    mapped = premap(pool_process.socket_path)
    with PoolClient(pool_process.socket_path, mapped=mapped) as c:
        assert c.arena() is mapped.arena
        assert c.arena_handle == mapped.handle and "arena_id" in c.arena_handle


def test_evict_and_grant_need_the_admin_token(pool_process: PoolProcess) -> None:
    with PoolClient(pool_process.socket_path) as plain:
        for call in (plain.evict, lambda: plain.grant(1 << 20)):
            with pytest.raises(RemotePoolError) as info:
                call()
            assert info.value.kind is Forbidden and info.value.code == "forbidden"
    with pytest.raises(RemotePoolError) as wrong:
        PoolClient(pool_process.socket_path, admin_token="x" * 43)
    assert wrong.value.kind is Forbidden
    with PoolClient(pool_process.socket_path, admin_token=pool_process.admin_token) as admin:
        assert admin.admin and admin.evict() == 0


def test_kv_quota_comes_from_single_use_tickets(tmp_path: Path) -> None:
    pool = SpawnedPool(
        str(tmp_path / "q.sock"), "8MiB", env={"EMBER_POOL_PREFAULT": "false"}, session_kv_quota=0
    )
    try:
        with PoolClient(pool.socket_path) as plain:
            with pytest.raises(RemotePoolError) as none:
                plain.kv_alloc(1, 4096)
            assert none.value.kind is KVQuotaExceeded
            assert none.value.details() == {"quota": 0, "used": 0, "requested": 4096}
        with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
            ticket = admin.grant(3 * 4096)
            admin.kv_alloc(1000, 4096)  # admins are unlimited
            with PoolClient(pool.socket_path, ticket=ticket) as holder:
                assert holder.kv_quota_bytes == 3 * 4096
                kv = holder.kv_alloc(2, 4096)
                with pytest.raises(RemotePoolError) as over:
                    holder.kv_alloc(2, 4096)
                assert over.value.details() == {"quota": 12288, "used": 8192, "requested": 8192}
                holder.kv_free(kv.block_ids[:1])
                holder.kv_alloc(2, 4096)
                with pytest.raises(RemotePoolError) as reused:
                    PoolClient(pool.socket_path, ticket=ticket)
                assert reused.value.kind is Forbidden
    finally:
        pool.stop()


def test_the_admin_token_is_in_neither_argv_nor_the_daemons_environment(pool_process: PoolProcess) -> None:
    pid = pool_process.proc.pid
    token = pool_process.admin_token.encode()
    assert token not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert token not in Path(f"/proc/{pid}/environ").read_bytes()  # readable here: we are root


def test_session_kv_quota_config() -> None:
    base: dict[str, Any] = {"device": "cpu", "arena_bytes": 1 << 20, "socket_path": "/tmp/x.sock"}
    assert PoolConfig(**base).default_session_kv_quota is None
    assert PoolConfig(**base, admin_token="t" * 16).default_session_kv_quota == 0
    env = {"EMBER_POOL_SESSION_KV_QUOTA": "unlimited", "EMBER_POOL_ADMIN_TOKEN": "t" * 16}
    assert PoolConfig.from_env(env, **base).default_session_kv_quota is None
    env["EMBER_POOL_SESSION_KV_QUOTA"] = "64MiB"
    assert PoolConfig.from_env(env, **base).default_session_kv_quota == 64 << 20
    for bad in ("-1", "lots"):
        with pytest.raises(ConfigError, match="EMBER_POOL_SESSION_KV_QUOTA"):
            PoolConfig.from_env({"EMBER_POOL_SESSION_KV_QUOTA": bad}, **base)
    with pytest.raises(ConfigError, match="admin token"):
        PoolConfig(**base, admin_token="short")
    assert "t" * 16 not in repr(PoolConfig(**base, admin_token="t" * 16))


U64 = 2**64 - 1


@pytest.mark.parametrize(
    ("fields", "error_type"),
    [
        ({"op": "kv_alloc", "num_blocks": U64, "block_bytes": U64}, "invalid_argument"),
        ({"op": "kv_alloc", "num_blocks": 2**32, "block_bytes": 2**32}, "invalid_argument"),
        ({"op": "kv_alloc", "num_blocks": 2**40, "block_bytes": 2**20}, "out_of_memory"),
        ({"op": "kv_alloc", "num_blocks": 1, "block_bytes": 2**62}, "out_of_memory"),
        ({"op": "kv_alloc", "num_blocks": -1, "block_bytes": 4096}, "invalid_argument"),
        ({"op": "kv_alloc", "num_blocks": 0, "block_bytes": 4096}, "invalid_argument"),
        ({"op": "kv_alloc", "num_blocks": 1, "block_bytes": -(2**63)}, "invalid_argument"),
        ({"op": "kv_free", "block_ids": [U64]}, "invalid_argument"),
        ({"op": "kv_free", "block_ids": [-1]}, "invalid_argument"),
        ({"op": "grant", "kv_quota_bytes": U64}, "invalid_argument"),
        ({"op": "evict", "model_id": 5}, "protocol_error"),
        ({"op": "hello", "pid": U64}, "invalid_argument"),
        ({"op": "hello", "ticket": "t" * 10_000}, "invalid_argument"),
    ],
)
def test_out_of_range_integers_get_typed_errors_on_a_live_connection(
    pool_process: PoolProcess, fields: dict[str, Any], error_type: str
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(pool_process.socket_path)
        for request_id, message in ((1, fields), (2, {"op": "stats"})):
            body = msgpack.packb({"v": 1, "id": request_id, **message})
            s.sendall(struct.pack(">I", len(body)) + body)
            reply = _read_reply(s)
            assert reply["id"] == request_id
            if request_id == 1:
                assert reply["ok"] is False and reply["error"]["type"] == error_type, reply
            else:
                assert reply["ok"] is True  # the same connection still serves
    assert pool_process.alive()


def _read_reply(s: socket.socket) -> dict[str, Any]:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = s.recv(1 << 16)
        assert chunk, "the daemon dropped the connection"
        data += chunk
    reply: dict[str, Any] = msgpack.unpackb(data[4:])
    return reply


@pytest.fixture
def killable_pool(tmp_path: Path) -> Iterator[PoolProcess]:
    pool = PoolProcess(tmp_path / "k.sock")
    try:
        yield pool
    finally:
        pool.stop()


def test_watch_tells_a_client_its_pool_died(killable_pool: PoolProcess) -> None:
    died = threading.Event()
    quiet = threading.Event()
    with PoolClient(killable_pool.socket_path) as closed_early:
        closed_early.watch(quiet.set)
    with PoolClient(killable_pool.socket_path) as c:
        c.watch(died.set)
        assert c.stats()["sessions"] == 1  # watching consumes no replies
        assert not died.wait(0.2)
        os.kill(killable_pool.proc.pid, signal.SIGKILL)
        assert died.wait(2.0)
    assert not quiet.is_set()


def test_a_restarted_daemon_is_not_the_one_a_session_was_opened_on(tmp_path: Path) -> None:
    """After its watch fires, a session asks whether its daemon still answers (it dropped the
    session) or died. A daemon restarted at the same path before the question is asked (a busy
    host delays the watch thread; the agent restarts pools at once) is a new one; the same
    daemon whose socket file's metadata changed is not."""
    first = PoolProcess(tmp_path / "r.sock")
    second: PoolProcess | None = None
    try:
        with PoolClient(first.socket_path) as c:
            assert c.daemon_answers()
            os.chmod(first.socket_path, 0o600)  # an operator's chmod or touch: the same daemon
            os.utime(first.socket_path)
            assert c.daemon_answers()
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait()
            assert not c.daemon_answers()  # its socket file is left, refusing connections
            second = PoolProcess(tmp_path / "r.sock")
            with PoolClient(second.socket_path) as fresh:  # the path answers again
                assert fresh.daemon_answers()
            assert not c.daemon_answers()
    finally:
        first.stop()
        if second is not None:
            second.stop()
