"""The daemon loads only bytes its trusted model store vouches for (gpu_pool.store.trust).

Process tests run a real daemon and real clients over its socket; the cache tests drive
:class:`StoreTrust` in-process against real store entries on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_pool import store
from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.config import PoolConfig
from gpu_pool.errors import ConfigError, ManifestError, UntrustedManifest
from gpu_pool.manifest import Manifest, TensorEntry
from gpu_pool.spawn import PoolProcess as SpawnedPool
from gpu_pool.store.trust import RACY_WINDOW_NS, StoreTrust
from tests.conftest import PoolProcess, random_tensors, write_entry

SIZES = [1000, 250_000, 7, 4096]


def edited(manifest: Manifest, tensor: str, **changes: object) -> Manifest:
    """``manifest`` with the fields of tensor ``tensor`` changed."""
    tensors = tuple(dataclasses.replace(t, **changes) if t.name == tensor else t for t in manifest.tensors)
    return Manifest(manifest.model_id, tensors, manifest.latency_sensitivity)


def refusal(client: PoolClient, manifest: Manifest) -> RemotePoolError:
    with pytest.raises(RemotePoolError) as info:
        client.acquire(manifest)
    assert info.value.kind is UntrustedManifest and issubclass(info.value.kind, ManifestError)
    return info.value


def assert_nothing_pinned_or_loaded(client: PoolClient) -> None:
    s = client.stats()
    assert s["resident_bytes"] == 0 and s["pinned_bytes"] == 0 and s["bytes_loaded"] == 0
    assert s["models"] == {}


def set_mtime(entry: Path, mtime_ns: int) -> None:
    os.utime(entry / store.MANIFEST_FILE, ns=(mtime_ns, mtime_ns))


# ----- the daemon, in its own process -------------------------------------------------------------


@pytest.mark.slow
def test_a_claimed_fingerprint_for_other_bytes_is_refused_and_the_daemon_keeps_serving(
    pool_process: PoolProcess, store_root: Path
) -> None:
    a = write_entry(store_root, "a", random_tensors(1, SIZES))
    b = write_entry(store_root, "b", random_tensors(2, SIZES))
    # Poisoning: b's bytes under a's fingerprint would hand b's t1 to every later user of a.
    poisoned = edited(b, "t1", fingerprint=a["t1"].fingerprint)
    flipped = edited(
        a, "t0", fingerprint=("0" if a["t0"].fingerprint[0] != "0" else "1") + a["t0"].fingerprint[1:]
    )
    with PoolClient(pool_process.socket_path) as c:
        for bad in (poisoned, flipped):
            err = refusal(c, bad)
            assert err.details()["field"] == "fingerprint"
            assert err.details()["tensor"] in ("t0", "t1") and err.details()["tensor"] in str(err)
            assert "fingerprint" in str(err) and str(store_root) in str(err)
        assert_nothing_pinned_or_loaded(c)
        # The same session goes on: correct manifests load, with their own bytes.
        got_a = c.acquire(a)
        got_b = c.acquire(b)
        assert torch.equal(got_a["t1"], random_tensors(1, SIZES)["t1"])
        assert torch.equal(got_b["t1"], random_tensors(2, SIZES)["t1"])
        assert c.stats()["bytes_loaded"] == a.nbytes + b.nbytes
    assert pool_process.alive()


@pytest.mark.slow
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("where", ["system-file", "symlinked-entry", "dotdot", "symlinked-file"])
def test_files_outside_the_store_roots_are_refused(
    pool_process: PoolProcess, store_root: Path, tmp_path: Path, where: str, static: bool
) -> None:
    outside = write_entry(tmp_path / "outside", "x", random_tensors(3, SIZES))
    if where == "system-file":
        victim = Path(sys.executable).resolve()  # any file the daemon can read
        size = 4096
        manifest = Manifest("sneaky", (TensorEntry("t0", "uint8", (size,), size, "0" * 32, str(victim), 0),))
    elif where == "symlinked-entry":
        (store_root / "link").symlink_to(tmp_path / "outside" / "x", target_is_directory=True)
        manifest = store.read(store_root / "link")  # its files lie under the root, by name
    elif where == "dotdot":
        manifest = store.read(store_root / ".." / "outside" / "x")
    else:  # an entry inside the root whose data file is a symlink to bytes outside it
        (store_root / "y").mkdir()
        shutil.copy(tmp_path / "outside" / "x" / store.MANIFEST_FILE, store_root / "y" / store.MANIFEST_FILE)
        (store_root / "y" / store.TENSORS_FILE).symlink_to(tmp_path / "outside" / "x" / store.TENSORS_FILE)
        manifest = store.read(store_root / "y")
    assert manifest.tensors[0].file.startswith(str(store_root)) or where == "system-file"
    manifest = Manifest(
        manifest.model_id, tuple(dataclasses.replace(t, static=static) for t in manifest.tensors)
    )
    with PoolClient(pool_process.socket_path) as c:
        err = refusal(c, manifest)
        assert err.details() == {"tensor": "t0", "field": "file"}
        assert "outside the pool's trusted store" in str(err) and str(store_root.resolve()) in str(err)
        assert_nothing_pinned_or_loaded(c)
    assert outside.nbytes > 0 and pool_process.alive()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("offset", {"offset": "+8"}),
        ("nbytes", {"shape": (500,), "nbytes": 500}),
        ("dtype", {"dtype": "int8"}),
        ("shape", {"shape": (10, 100)}),
        ("name", {"name": "t9"}),
        ("file", {"file": "MANIFEST"}),
    ],
)
def test_a_tensor_that_differs_from_its_store_entry_is_refused(
    pool_process: PoolProcess, store_root: Path, field: str, changes: dict[str, object]
) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    if changes.get("file") == "MANIFEST":  # inside the root and the entry, but not its data file
        changes = {"file": str(store_root / "m" / store.MANIFEST_FILE)}
    if changes.get("offset") == "+8":
        changes = {"offset": m["t0"].offset + 8}
    bad = edited(m, "t0", **changes)
    with PoolClient(pool_process.socket_path) as c:
        err = refusal(c, bad)
        assert err.details() == {"tensor": changes.get("name", "t0"), "field": field}
        assert field in str(err)
        assert_nothing_pinned_or_loaded(c)
        assert torch.equal(c.acquire(m)["t0"], random_tensors(1, SIZES)["t0"])


@pytest.mark.slow
def test_static_tensors_must_come_from_a_valid_store_entry(
    pool_process: PoolProcess, store_root: Path
) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    loose = store_root / "loose.bin"  # inside the root, but in no entry
    shutil.copy(m["t0"].file, loose)
    (store_root / "broken").mkdir()
    shutil.copy(m["t0"].file, store_root / "broken" / store.TENSORS_FILE)
    (store_root / "broken" / store.MANIFEST_FILE).write_text("{not json")
    with PoolClient(pool_process.socket_path) as c:
        for file, needle in (
            (loose, "not part of a model store entry"),
            (store_root / "broken" / store.TENSORS_FILE, "not a valid model store entry"),
        ):
            err = refusal(c, edited(m, "t0", file=str(file)))
            assert err.details() == {"tensor": "t0", "field": "file"} and needle in str(err)
        assert_nothing_pinned_or_loaded(c)
        # A dynamic tensor needs only a file inside the roots.
        dynamic = Manifest("adapter", (dataclasses.replace(m["t0"], file=str(loose), static=False),))
        assert torch.equal(c.acquire(dynamic)["t0"], random_tensors(1, SIZES)["t0"])


@pytest.mark.slow
def test_a_correct_manifest_is_shared_zero_copy_including_through_a_symlink_inside_the_root(
    pool_process: PoolProcess, store_root: Path
) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    (store_root / "alias").symlink_to(store_root / "m", target_is_directory=True)
    alias = store.read(store_root / "alias")
    with PoolClient(pool_process.socket_path) as a, PoolClient(pool_process.socket_path) as b:
        ta = a.acquire(m)
        tb = b.acquire(alias)
        assert a.last_acquire is not None and b.last_acquire is not None
        assert (a.last_acquire.bytes_loaded, b.last_acquire.bytes_loaded) == (m.nbytes, 0)
        assert b.last_acquire.bytes_reused == m.nbytes
        offset_a = ta["t1"].data_ptr() - a.arena().data_ptr()
        assert offset_a == tb["t1"].data_ptr() - b.arena().data_ptr()
        expected = int(random_tensors(1, SIZES)["t1"][0])
        assert int(ta["t1"][0]) == int(tb["t1"][0]) == expected  # views are read-only: see test_isolation
        for _ in range(3):  # repeats take the remembered path and still answer the same
            assert b.acquire(alias)["t1"].data_ptr() - b.arena().data_ptr() == offset_a


@pytest.mark.slow
def test_dynamic_tensors_are_private_and_need_only_a_file_inside_the_store(
    pool_process: PoolProcess, store_root: Path
) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    made_up = "ab" * 16  # a dynamic tensor's fingerprint is only its session-private key
    adapter = Manifest("adapter", (dataclasses.replace(m["t0"], fingerprint=made_up, static=False),))
    with PoolClient(pool_process.socket_path) as owner, PoolClient(pool_process.socket_path) as other:
        assert torch.equal(owner.acquire(adapter)["t0"], random_tensors(1, SIZES)["t0"])
        # Nobody can use that key to pass other bytes off as shared.
        err = refusal(other, Manifest("claim", (dataclasses.replace(m["t0"], fingerprint=made_up),)))
        assert err.details() == {"tensor": "t0", "field": "fingerprint"}


@pytest.mark.slow
def test_a_rewritten_store_entry_is_checked_again(pool_process: PoolProcess, store_root: Path) -> None:
    old = write_entry(store_root, "m", random_tensors(1, SIZES))
    set_mtime(store_root / "m", time.time_ns() - 3600 * 10**9)  # old enough to be cached
    with PoolClient(pool_process.socket_path) as c:
        for _ in range(2):
            c.acquire(old)
            c.release()
        # Rewritten whole (the way store.write makes entries): new files, same names and sizes,
        # and on ext4 often the very inode numbers the old files had.
        shutil.rmtree(store_root / "m")
        new = write_entry(store_root, "m", random_tensors(2, SIZES))
        assert [t.fingerprint for t in new.tensors] != [t.fingerprint for t in old.tensors]
        assert refusal(c, old).details()["field"] == "fingerprint"
        got = c.acquire(new)
        assert all(torch.equal(got[n], t) for n, t in random_tensors(2, SIZES).items())
        c.release()
        # Rewritten in place within the racy window, keeping inode, size and mtime: only
        # re-reading can tell, and a fresh entry is re-read every time.
        manifest_file = store_root / "m" / store.MANIFEST_FILE
        future = time.time_ns() + 3600 * 10**9  # a clock-skewed mtime counts as fresh, too
        set_mtime(store_root / "m", future)
        c.acquire(new)
        c.release()
        before = os.stat(manifest_file)
        data = json.loads(manifest_file.read_text())
        data["tensors"][0]["fingerprint"] = old["t0"].fingerprint
        with open(manifest_file, "r+") as f:
            text = json.dumps(data, indent=1)
            assert len(text) == before.st_size
            f.write(text)
        set_mtime(store_root / "m", future)
        after = os.stat(manifest_file)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        )
        assert refusal(c, new).details() == {"tensor": "t0", "field": "fingerprint"}


@pytest.mark.slow
def test_a_pool_without_store_roots_refuses_acquires_and_says_how_to_configure_one(
    tmp_path: Path, store_root: Path
) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    pool = PoolProcess(tmp_path / "bare.sock")
    try:
        assert pool.ready["store_roots"] == []
        with PoolClient(pool.socket_path) as c:
            err = refusal(c, m)
            assert err.details() == {"tensor": None, "field": "store"}
            assert "--store" in str(err) and "EMBER_POOL_STORE" in str(err)
            assert len(c.kv_alloc(2, 4096).block_ids) == 2  # a KV-only pool still works
            assert c.stats()["bytes_loaded"] == 0
    finally:
        pool.stop()


@pytest.mark.slow
def test_store_roots_come_from_flags_or_the_environment(tmp_path: Path, store_root: Path) -> None:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    other = tmp_path / "other"
    other.mkdir()
    sock = str(tmp_path / "env.sock")
    env = {"EMBER_POOL_PREFAULT": "false", "EMBER_POOL_STORE": f"{other}{os.pathsep}{store_root}"}
    pool = SpawnedPool(sock, "16MiB", env=env)
    try:
        assert pool.ready["store_roots"] == [str(other.resolve()), str(store_root.resolve())]
        with PoolClient(sock) as c:
            assert torch.equal(c.acquire(m)["t3"], random_tensors(1, SIZES)["t3"])
    finally:
        pool.stop()
    cmd = [sys.executable, "-m", "gpu_pool", "--device", "cpu", "--arena", "4MiB", "--socket", sock]
    out = subprocess.run(
        [*cmd, "--store", str(store_root), "--store", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "missing" in out.stderr and "does not exist" in out.stderr


# ----- configuration ----------------------------------------------------------------------------------


ENV = {"EMBER_POOL_DEVICE": "cpu", "EMBER_POOL_ARENA": "64MiB", "EMBER_POOL_SOCKET": "/tmp/x.sock"}


def test_ember_pool_store_is_split_on_pathsep_and_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = PoolConfig.from_env({**ENV, "EMBER_POOL_STORE": f"a{os.pathsep}{tmp_path / 'b'}{os.pathsep}a"})
    assert cfg.store_roots == (str(tmp_path / "a"), str(tmp_path / "b"))  # duplicates dropped
    assert PoolConfig.from_env(ENV).store_roots == ()
    # Flags override the environment.
    flagged = PoolConfig.from_env({**ENV, "EMBER_POOL_STORE": "a"}, store_roots=(str(tmp_path / "b"),))
    assert flagged.store_roots == (str(tmp_path / "b"),)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("missing", "does not exist"),
        ("file.txt", "is not a directory"),
        ("", "empty entry"),
        (f"a{os.pathsep}{os.pathsep}a", "empty entry"),
        (f"a{os.pathsep}", "empty entry"),
    ],
)
def test_a_bad_ember_pool_store_fails_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, needle: str
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "file.txt").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="EMBER_POOL_STORE") as info:
        PoolConfig.from_env({**ENV, "EMBER_POOL_STORE": value})
    assert needle in str(info.value)


def test_store_roots_must_be_a_tuple_of_paths() -> None:
    with pytest.raises(ConfigError, match="tuple"):
        PoolConfig("cpu", 64 << 20, "/tmp/x.sock", store_roots="/tmp")


# ----- the checker's caches, in-process -----------------------------------------------------------


@pytest.fixture
def old_entry(store_root: Path) -> Iterator[Manifest]:
    m = write_entry(store_root, "m", random_tensors(1, SIZES))
    set_mtime(store_root / "m", time.time_ns() - 2 * RACY_WINDOW_NS)
    yield m


def test_a_manifest_that_passed_is_remembered_until_a_file_changes(
    store_root: Path, old_entry: Manifest
) -> None:
    trust = StoreTrust([str(store_root)])
    assert trust.cached(old_entry) is None
    trusted = trust.check(old_entry)
    assert trusted is old_entry  # its paths were already the resolved ones
    assert trust.cached(old_entry) is trusted
    # An equal manifest that is another object is checked (and passes) on its own.
    twin = store.read(store_root / "m")
    assert trust.cached(twin) is None and trust.check(twin) == old_entry
    set_mtime(store_root / "m", time.time_ns() - 3 * RACY_WINDOW_NS)
    assert trust.cached(old_entry) is None
    assert trust.check(old_entry) is old_entry


def test_paths_through_symlinks_are_replaced_by_the_checked_ones(
    store_root: Path, old_entry: Manifest
) -> None:
    (store_root / "alias").symlink_to(store_root / "m", target_is_directory=True)
    alias = store.read(store_root / "alias")
    trusted = StoreTrust([str(store_root)]).check(alias)
    assert [t.file for t in trusted.tensors] == [os.path.realpath(t.file) for t in old_entry.tensors]
    assert [t.fingerprint for t in trusted.tensors] == [t.fingerprint for t in alias.tensors]


def test_a_fresh_entry_is_not_remembered(store_root: Path) -> None:
    m = write_entry(store_root, "fresh", random_tensors(1, SIZES))
    trust = StoreTrust([str(store_root)])
    assert trust.check(m) is m
    assert trust.cached(m) is None  # within the racy window: checked in full every time
    later = StoreTrust([str(store_root)], clock=lambda: time.time_ns() + 2 * RACY_WINDOW_NS)
    later.check(m)
    assert later.cached(m) is m
