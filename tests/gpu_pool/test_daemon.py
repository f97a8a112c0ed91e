"""Process tests: a real daemon process, real client processes, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgpack
import pytest
import torch

from gpu_pool.acquire_report import REPORT_VERSION, AcquireReport
from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.errors import OutOfMemory, SessionError
from gpu_pool.manifest import Manifest
from tests.conftest import CountingSocket, PoolProcess, random_tensors, wait_until, write_entry

pytestmark = pytest.mark.slow


@pytest.fixture
def manifest(store_root: Path) -> Manifest:
    return write_entry(store_root, "m", random_tensors(1, [1000, 250_000, 7, 4096]))


def run_client(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


ACQUIRE_AND_WAIT = """
    import json, sys
    from gpu_pool import store
    from gpu_pool.client import PoolClient
    c = PoolClient(sys.argv[1])
    tensors = c.acquire(store.read(sys.argv[2]))
    kv = c.kv_alloc(3, 4096)
    t = tensors["t1"]
    report = c.last_acquire
    print(json.dumps({"ptr_offset": t.data_ptr() - c.arena().data_ptr(), "first": int(t[0]),
                      "loaded": report.bytes_loaded, "reused": report.bytes_reused}), flush=True)
    cmd = sys.stdin.readline().strip()
    if cmd.startswith("write"):
        t[0] = int(cmd.split()[1]); print("written", flush=True); sys.stdin.readline()
    elif cmd == "read":
        print(int(t[0]), flush=True); sys.stdin.readline()
"""


def test_two_client_processes_share_the_same_memory(pool_process: PoolProcess, manifest: Manifest) -> None:
    entry = str(Path(manifest.tensors[0].file).parent)
    a = run_client(ACQUIRE_AND_WAIT, pool_process.socket_path, entry)
    b = run_client(ACQUIRE_AND_WAIT, pool_process.socket_path, entry)
    try:
        assert a.stdout is not None and b.stdout is not None and a.stdin is not None and b.stdin is not None
        info_a = json.loads(a.stdout.readline())
        info_b = json.loads(b.stdout.readline())
        # Same arena offset, loaded once, reused by the second.
        assert info_a["ptr_offset"] == info_b["ptr_offset"]
        assert sorted([info_a["loaded"], info_b["loaded"]]) == [0, manifest.nbytes]
        assert sorted([info_a["reused"], info_b["reused"]]) == [0, manifest.nbytes]
        expected = int(random_tensors(1, [1000, 250_000, 7, 4096])["t1"][0])
        assert info_a["first"] == info_b["first"] == expected
        # Zero copy: both views are the same bytes of the one arena (writing them is refused:
        # see test_isolation.py).
        b.stdin.write("read\n")
        b.stdin.flush()
        assert int(b.stdout.readline()) == expected
    finally:
        for p in (a, b):
            p.kill()
            p.communicate()


def test_acquire_reply_sends_placements_beside_a_versioned_report(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    with PoolClient(pool_process.socket_path) as c:
        reply = c._call("acquire", manifest_bin=manifest.encoded())
        assert set(reply) - {"v", "id", "ok"} == {"placements", "report"}
        assert set(reply["placements"]) == {e.name for e in manifest.tensors}
        report = AcquireReport.from_wire(reply["report"])
        assert reply["report"]["v"] == REPORT_VERSION and report.bytes_loaded == manifest.nbytes
    with PoolClient(pool_process.socket_path) as again:
        again.acquire(manifest)
        assert again.last_acquire == AcquireReport(
            0, manifest.nbytes, 0, 0, 0.0, again.last_acquire.plan_seconds, 0.0
        )


def test_sigkill_of_a_client_frees_pins_and_kv_within_a_second(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    entry = str(Path(manifest.tensors[0].file).parent)
    victim = run_client(ACQUIRE_AND_WAIT, pool_process.socket_path, entry)
    try:
        assert victim.stdout is not None
        json.loads(victim.stdout.readline())
        with PoolClient(pool_process.socket_path) as observer:
            stats = observer.stats()
            assert stats["pinned_bytes"] > 0 and stats["kv_bytes"] > 0 and stats["sessions"] == 2
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()

            def released() -> bool:
                s = observer.stats()
                return s["pinned_bytes"] == 0 and s["kv_bytes"] == 0 and s["sessions"] == 1

            assert wait_until(released, timeout=1.0) < 1.0
            # The tensors stay resident for the next instance.
            assert observer.stats()["models"]["m"]["resident_bytes"] == manifest.nbytes
    finally:
        victim.kill()
        victim.communicate()


def _raw_exchange(sock_path: str, payload: bytes) -> dict[str, object] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock_path)
        s.sendall(payload)
        header = s.recv(4)
        if len(header) < 4:
            return None
        (n,) = struct.unpack(">I", header)
        body = b""
        while len(body) < n:
            chunk = s.recv(n - len(body))
            if not chunk:
                break
            body += chunk
        reply: dict[str, object] = msgpack.unpackb(body)
        return reply


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("payload", "error_type"),
    [
        (frame(b"\xc1\xc1 definitely not msgpack"), "protocol_error"),
        (frame(msgpack.packb([1, 2, 3])), "protocol_error"),
        (frame(msgpack.packb({"v": 99, "op": "hello", "id": 1})), "unsupported_version"),
        (frame(msgpack.packb({"v": 1, "op": "format_disk", "id": 1})), "unknown_op"),
        (frame(msgpack.packb({"v": 1, "op": "kv_alloc", "id": 1, "num_blocks": "many"})), "protocol_error"),
        (
            frame(msgpack.packb({"v": 1, "op": "acquire", "id": 1, "manifest": {"version": 1}})),
            "manifest_error",
        ),
        (struct.pack(">I", 0xFFFFFFF0) + b"junk", "message_too_large"),
    ],
    ids=["garbage", "not-a-map", "bad-version", "unknown-op", "bad-field", "bad-manifest", "oversized"],
)
def test_malformed_messages_get_typed_errors_and_the_daemon_keeps_serving(
    pool_process: PoolProcess, payload: bytes, error_type: str
) -> None:
    reply = _raw_exchange(pool_process.socket_path, payload)
    assert reply is not None and reply["ok"] is False
    assert isinstance(reply["error"], dict) and reply["error"]["type"] == error_type
    with PoolClient(pool_process.socket_path) as c:
        assert c.stats()["capacity_bytes"] > 0
    assert pool_process.alive()


def test_random_garbage_and_abrupt_disconnects_do_not_stop_the_daemon(pool_process: PoolProcess) -> None:
    rng = torch.Generator().manual_seed(3)
    for i in range(30):
        junk = bytes(
            torch.randint(0, 256, (int(torch.randint(1, 200, (1,), generator=rng)),), generator=rng).tolist()
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(pool_process.socket_path)
            s.sendall(junk if i % 2 else frame(junk))
    with PoolClient(pool_process.socket_path) as c:
        wait_until(lambda: c.stats()["sessions"] == 1, timeout=2.0)
    assert pool_process.alive()


def test_request_that_cannot_fit_names_bytes_needed_and_available(
    pool_process: PoolProcess, store_root: Path
) -> None:
    huge = write_entry(store_root, "huge", random_tensors(2, [20 << 20]))
    with PoolClient(pool_process.socket_path) as c:
        with pytest.raises(RemotePoolError) as info:
            c.acquire(huge)
        assert info.value.kind is OutOfMemory
        details = info.value.details()
        assert details["needed_bytes"] >= 20 << 20
        assert details["available_bytes"] <= 16 << 20
        assert str(details["needed_bytes"]) in str(info.value)
        with pytest.raises(RemotePoolError) as kv_info:
            c.kv_alloc(1000, 1 << 20)
        assert kv_info.value.kind is OutOfMemory
        with pytest.raises(RemotePoolError) as own:
            c.kv_free([12345])
        assert own.value.kind is SessionError
        assert c.stats()["capacity_bytes"] == 16 << 20


def test_many_concurrent_sessions(pool_process: PoolProcess, store_root: Path) -> None:
    manifests = [write_entry(store_root, f"m{i}", random_tensors(10 + i, [300_000, 5000])) for i in range(4)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with PoolClient(pool_process.socket_path) as c:
                for r in range(5):
                    m = manifests[(k + r) % len(manifests)]
                    tensors = c.acquire(m)
                    expected = random_tensors(10 + manifests.index(m), [300_000, 5000])
                    assert torch.equal(tensors["t0"], expected["t0"])
                    kv = c.kv_alloc(2, 10_000)
                    c.kv_free(list(kv.block_ids[:1]))
                    c.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with PoolClient(pool_process.socket_path) as c:
        s = c.stats()
        assert s["pinned_bytes"] == 0 and s["kv_bytes"] == 0 and s["sessions"] == 1
        assert s["bytes_loaded"] == sum(m.nbytes for m in manifests)
        assert isinstance(s["arena_populated"], bool) and 0 <= s["bytes_read_direct"] <= s["bytes_loaded"]


def test_sigterm_removes_socket_and_leaves_no_arena_file(tmp_path: Path) -> None:
    pool = PoolProcess(tmp_path / "p.sock")
    with PoolClient(pool.socket_path) as c:
        assert c.arena_handle["kind"] == "memfd" and "path" not in c.arena_handle
    pool.proc.send_signal(signal.SIGTERM)
    assert pool.proc.wait(10) == 0
    pool.stop()
    assert not os.path.exists(pool.socket_path)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ember-pool-{pool.proc.pid}-")]


def test_second_daemon_on_a_live_socket_is_refused(pool_process: PoolProcess) -> None:
    cmd = [sys.executable, "-m", "gpu_pool", "--device", "cpu", "--arena", "4MiB"]
    cmd += ["--socket", pool_process.socket_path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "already serving" in out.stderr
    assert pool_process.alive()


def test_client_refuses_an_arena_of_the_wrong_size(pool_process: PoolProcess) -> None:
    from gpu_pool.errors import ProtocolError

    with PoolClient(pool_process.socket_path) as c:
        c.arena_handle = {**c.arena_handle, "size": c.arena_handle["size"] + 4096}
        with pytest.raises(ProtocolError, match="expected"):
            c.arena()


def test_acquire_with_kv_pins_and_allocates_in_one_round_trip(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    """A new instance's weights and first KV blocks in one exchange (runtime.assignment)."""
    with PoolClient(pool_process.socket_path) as c:
        counted = CountingSocket(c._sock)
        c._sock = counted  # type: ignore[assignment]
        placements, kv = c.acquire_with_kv(manifest, 3, 4096)
        assert counted.writes == 1
        assert set(placements) == {e.name for e in manifest.tensors}
        assert c.last_acquire is not None and c.last_acquire.bytes_loaded == manifest.nbytes
        assert kv is not None and len(kv.block_ids) == 3 and kv.block_bytes >= 4096
        assert all(offset % kv.block_bytes == 0 for offset in kv.offsets)  # aligned: numbered
        block = c.kv_view(kv.offsets[1], "uint8", (kv.block_bytes,))  # its KV memory came with it
        block.fill_(9)
        assert int(block.sum()) == 9 * kv.block_bytes
        views = c.views(manifest, placements)
        assert torch.equal(views["t1"], c.acquire(manifest)["t1"])
        stats = c.stats()
        assert stats["kv_bytes"] == 3 * kv.block_bytes and stats["pinned_bytes"] >= manifest.nbytes


def test_acquire_with_kv_without_room_for_the_blocks_still_acquires(
    pool_process: PoolProcess, manifest: Manifest
) -> None:
    with PoolClient(pool_process.socket_path) as c:
        placements, kv = c.acquire_with_kv(manifest, 1 << 20, 4096)  # 4 GiB of blocks: no room
        assert kv is None and set(placements) == {e.name for e in manifest.tensors}
        assert c.stats()["kv_bytes"] == 0


def test_a_failed_acquire_with_kv_allocates_no_blocks(
    pool_process: PoolProcess, manifest: Manifest, tmp_path: Path
) -> None:
    """The blocks come only once the tensors are pinned: an acquire that fails takes nothing
    (no block, so nothing evicted for one), and the session goes on."""
    untrusted = write_entry(tmp_path / "elsewhere", "x", random_tensors(2, [64]))
    with PoolClient(pool_process.socket_path) as c:
        with pytest.raises(RemotePoolError) as failed:
            c.acquire_with_kv(untrusted, 2, 4096)
        assert failed.value.code == "untrusted_manifest"
        assert c.stats()["kv_bytes"] == 0
        placements, kv = c.acquire_with_kv(manifest, 2, 4096)
        assert set(placements) == {e.name for e in manifest.tensors} and kv is not None


def test_an_async_acquire_leaves_the_event_loop_free_and_fails_like_a_blocking_one(
    pool_process: PoolProcess, manifest: Manifest, tmp_path: Path
) -> None:
    """``acquire_async`` (a worker's activation): other tasks run while the daemon works; an
    error reply raises as from ``acquire_with_kv`` and the session goes on; a cancelled one
    (a reply that would answer the next call) closes the session."""
    untrusted = write_entry(tmp_path / "elsewhere", "x", random_tensors(2, [64]))

    async def scenario() -> None:
        with PoolClient(pool_process.socket_path) as c:
            ticks = 0

            async def ticking() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(ticking())
            placements, kv = await c.acquire_async(manifest, 2, 4096)  # loads: a thread in the daemon
            ticker.cancel()
            assert ticks > 1, "the event loop was blocked for the whole acquire"
            assert set(placements) == {e.name for e in manifest.tensors} and kv is not None
            assert len(kv.block_ids) == 2 and kv.prefix_hashes == ()
            with pytest.raises(RemotePoolError) as failed:
                await c.acquire_async(untrusted, 2, 4096)
            assert failed.value.code == "untrusted_manifest"
            assert (await c.acquire_async(manifest))[1] is None  # no blocks asked for
            # One request at a time: a second one while the first awaits its reply is refused
            # at once (it would read the first's reply and close the session), sync or async.
            first = asyncio.create_task(c.acquire_async(manifest))
            await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="in flight"):
                await c.acquire_async(manifest)
            with pytest.raises(RuntimeError, match="in flight"):
                c.stats()
            assert set((await first)[0]) == {e.name for e in manifest.tensors}
            assert c.stats()["pinned_bytes"] > 0  # the session goes on
            pending = asyncio.create_task(c.acquire_async(manifest))
            await asyncio.sleep(0)  # sent, its reply not read yet
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            with pytest.raises(OSError):
                c.stats()

    asyncio.run(scenario())


def test_acquire_checks_its_kv_request(pool_process: PoolProcess, manifest: Manifest) -> None:
    with PoolClient(pool_process.socket_path) as c:
        for kv, error in (
            ({"num_blocks": 0, "block_bytes": 4096}, "invalid_argument"),
            ([3, 4096], "protocol_error"),
        ):
            with pytest.raises(RemotePoolError) as bad:
                c._call("acquire", manifest_bin=manifest.encoded(), kv=kv)
            assert bad.value.code == error, bad.value
        with pytest.raises(RemotePoolError) as progressive:
            c._call(
                "acquire",
                manifest_bin=manifest.encoded(),
                progressive=True,
                kv={"num_blocks": 1, "block_bytes": 64},
            )
        assert progressive.value.code == "invalid_argument"
        assert c.stats()["kv_bytes"] == 0 and c.stats()["pinned_bytes"] == 0
