"""Model store format, manifests, fingerprints, config parsing and copy grouping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpu_pool import store
from gpu_pool.arena.base import CopyJob
from gpu_pool.arena.cpu import ARENA_SEALS, CpuArena
from gpu_pool.arena.loader import coalesce, group_copies
from gpu_pool.config import PoolConfig, parse_size
from gpu_pool.errors import ConfigError, LoadError, ManifestError
from gpu_pool.manifest import Manifest
from gpu_pool.planner.eviction import DecayedCountRateEstimator
from gpu_pool.store.fingerprint import fingerprint


def test_write_records_offsets_and_fingerprints(tmp_path: Path) -> None:
    tensors = {
        "emb": torch.randn(64, 32),
        "bias": torch.randn(5).to(torch.bfloat16),
        "ids": torch.arange(10, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    m = store.write(tmp_path / "model", tensors)
    assert m.model_id == "model"
    assert [e.name for e in m.tensors] == list(tensors)  # caller's order is the load order
    raw = (tmp_path / "model" / store.TENSORS_FILE).read_bytes()
    for e in m.tensors:
        t = tensors[e.name]
        assert e.shape == tuple(t.shape) and e.nbytes == t.numel() * t.element_size()
        assert raw[e.offset : e.offset + e.nbytes] == t.contiguous().view(torch.uint8).numpy().tobytes()
        assert e.fingerprint == fingerprint(e.dtype, e.shape, raw[e.offset : e.offset + e.nbytes])
    assert store.read(tmp_path / "model") == m
    assert store.verify(m) == []
    assert all(e.static for e in m.tensors)


def test_a_dynamic_entry_marks_every_tensor_dynamic(tmp_path: Path) -> None:
    """A LoRA adapter's entry: the pool keys its tensors per session, never shares them."""
    m = store.write(tmp_path / "lora", {"a": torch.randn(2, 8), "b": torch.randn(8, 2)}, static=False)
    assert not any(e.static for e in m.tensors)
    assert store.read(tmp_path / "lora") == m


def test_metadata_is_kept_beside_the_manifest(tmp_path: Path) -> None:
    meta = {"quantization": {"method": "q4", "quantized": {"w": "carried Q4_1"}}}
    m = store.write(tmp_path / "q", {"w": torch.zeros(4, dtype=torch.uint8)}, metadata=meta)
    assert store.read_metadata(tmp_path / "q") == meta
    assert store.read(tmp_path / "q") == m  # the manifest itself is unchanged by it
    store.write(tmp_path / "plain", {"w": torch.zeros(4)})
    assert store.read_metadata(tmp_path / "plain") == {}
    (tmp_path / "q" / store.MANIFEST_FILE).write_text('{"metadata": [1]}')
    with pytest.raises(ManifestError, match="metadata"):
        store.read_metadata(tmp_path / "q")


def test_fingerprint_covers_dtype_and_shape() -> None:
    data = bytes(range(16))
    assert fingerprint("float32", (4,), data) != fingerprint("int32", (4,), data)
    assert fingerprint("float32", (2, 2), data) != fingerprint("float32", (4,), data)
    assert fingerprint("float32", (4,), data) == fingerprint("float32", [4], data)


def test_identical_tensors_in_two_models_share_a_fingerprint(tmp_path: Path) -> None:
    shared = torch.randn(100)
    a = store.write(tmp_path / "a", {"x": shared, "y": torch.randn(3)})
    b = store.write(tmp_path / "b", {"z": shared.clone()})
    assert a["x"].fingerprint == b["z"].fingerprint
    assert a["y"].fingerprint != b["z"].fingerprint


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    store.write(tmp_path / "m", {"x": torch.ones(3)})
    with pytest.raises(ManifestError, match="already exists"):
        store.write(tmp_path / "m", {"x": torch.ones(3)})

    with pytest.raises(Exception):  # noqa: B017 - any failure mid-write
        store.write(tmp_path / "broken", {"x": torch.ones(3), "y": object()})  # type: ignore[dict-item]
    assert not (tmp_path / "broken").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_verify_detects_corruption(tmp_path: Path) -> None:
    m = store.write(tmp_path / "m", {"x": torch.arange(100, dtype=torch.float32)})
    path = Path(m["x"].file)
    data = bytearray(path.read_bytes())
    data[m["x"].offset] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.verify(m) == ["x"]


def test_manifest_round_trip_and_validation(tmp_path: Path) -> None:
    m = store.write(tmp_path / "m", {"x": torch.ones(2, 3)})
    assert Manifest.from_dict(m.to_dict()) == m
    bad = m.to_dict()
    bad["tensors"][0]["nbytes"] = 5
    with pytest.raises(ManifestError, match="nbytes"):
        Manifest.from_dict(bad)
    bad = m.to_dict()
    del bad["tensors"][0]["fingerprint"]
    with pytest.raises(ManifestError, match="fingerprint"):
        Manifest.from_dict(bad)
    with pytest.raises(ManifestError, match="version"):
        Manifest.from_dict({**m.to_dict(), "version": 7})
    with pytest.raises(ManifestError):
        Manifest.from_dict("nope")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
        ("64 kib", 64 << 10),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4 parsecs", "-1GiB", "GiB", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--arena"):
        parse_size(text, "--arena")


def test_pool_config_from_env_fails_loudly() -> None:
    env = {"EMBER_POOL_DEVICE": "cpu", "EMBER_POOL_ARENA": "64MiB", "EMBER_POOL_SOCKET": "/tmp/x.sock"}
    cfg = PoolConfig.from_env(env)
    assert cfg.arena_bytes == 64 << 20 and cfg.device == "cpu"
    assert PoolConfig.from_env(env, device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="EMBER_POOL_DEVICE"):
        PoolConfig.from_env({k: v for k, v in env.items() if k != "EMBER_POOL_DEVICE"})
    with pytest.raises(ConfigError, match="device"):
        PoolConfig.from_env({**env, "EMBER_POOL_DEVICE": "tpu"})
    with pytest.raises(ConfigError, match="EMBER_POOL_PREFAULT"):
        PoolConfig.from_env({**env, "EMBER_POOL_PREFAULT": "maybe"})
    with pytest.raises(ConfigError, match="EMBER_POOL_EVICTION"):
        PoolConfig.from_env({**env, "EMBER_POOL_EVICTION": "fifo"})


jobs_st = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.integers(0, 1 << 24),
        st.integers(0, 1 << 24),
        st.integers(0, 20 << 20),
    ),
    max_size=30,
).map(lambda xs: [CopyJob(f, s, d, n) for f, s, d, n in xs])


@given(jobs_st)
def test_grouping_preserves_every_byte(jobs: list[CopyJob]) -> None:
    def expand(js: list[CopyJob]) -> set[tuple[str, int, int]]:
        # (file, src byte, dst byte) triples, sampled at both ends and the middle of each job
        out = set()
        for j in js:
            for k in {0, j.nbytes // 2, j.nbytes - 1} if j.nbytes else set():
                out.add((j.file, j.src + k, j.dst + k))
        return out

    groups = group_copies(jobs, min_group=8 << 20, max_chunk=16 << 20)
    flat = [j for g in groups for j in g]
    assert sum(j.nbytes for j in flat) == sum(j.nbytes for j in jobs)
    assert all(j.nbytes <= 16 << 20 for j in flat)
    assert expand([j for j in jobs if j.nbytes]) <= expand(flat) | expand(coalesce(jobs))
    # every group but the last batch holds at least min_group bytes
    assert all(sum(j.nbytes for j in g) >= 8 << 20 for g in groups[:-1] if len(g) > 1)


def test_coalesce_merges_adjacent_copies() -> None:
    jobs = [CopyJob("f", 0, 100, 10), CopyJob("f", 10, 110, 5), CopyJob("f", 15, 200, 5)]
    assert coalesce(jobs) == [CopyJob("f", 0, 100, 15), CopyJob("f", 15, 200, 5)]


def test_cpu_arena_load_move_and_errors(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    payload = bytes(range(256)) * 64
    src.write_bytes(payload)
    arena = CpuArena(1 << 20, prefault=False)
    try:
        arena.load(group_copies([CopyJob(str(src), 0, 4096, len(payload))]))
        assert arena.read(4096, len(payload)) == payload
        arena.move(4096 + 100, 4096, 1000)  # overlapping, forward
        assert arena.read(4196, 1000) == payload[:1000]
        arena.move(0, 4196, 1000)  # backward
        assert arena.read(0, 1000) == payload[:1000]
        with pytest.raises(LoadError, match="ends before"):
            arena.load([[CopyJob(str(src), len(payload) - 10, 0, 100)]])
        with pytest.raises(LoadError, match="cannot open"):
            arena.load([[CopyJob(str(tmp_path / "missing"), 0, 0, 10)]])
        with pytest.raises(ValueError, match="leaves the arena"):
            arena.move(0, (1 << 20) - 10, 100)
    finally:
        arena.close()


def test_cpu_arena_prefaults_in_the_background_without_changing_loaded_bytes(tmp_path: Path) -> None:
    """A pool daemon is ready before its arena is populated (a restart waited 2.6-14 s for a
    1 GiB MAP_POPULATE); populating runs alongside loads and never changes what they wrote."""
    import os

    src = tmp_path / "src.bin"
    payload = os.urandom(4 << 20)
    src.write_bytes(payload)
    capacity = 64 << 20
    arena = CpuArena(capacity, prefault=True)
    try:
        arena.load(group_copies([CopyJob(str(src), 0, capacity - len(payload), len(payload))]))
        assert arena.prefaulted.wait(30) and arena.populated  # what the pool's stats report
        assert arena.prefault_error is None
        assert arena.read(capacity - len(payload), len(payload)) == payload
        # Every page of the memfd is allocated now (fstat's st_blocks counts 512-byte blocks).
        assert os.fstat(arena.share_fd() or -1).st_blocks * 512 >= capacity
    finally:
        arena.close()


def test_cpu_arena_close_stops_prefaulting() -> None:
    arena = CpuArena(1 << 30, prefault=True)
    arena.close()  # joins the populating thread before unmapping (no fault after munmap)
    assert arena.prefaulted.is_set()


def test_cpu_arena_is_a_sealed_memfd_that_only_its_own_mapping_writes(tmp_path: Path) -> None:
    """Issue 10: the arena was a /dev/shm file any same-uid process could open read-write."""
    import fcntl
    import mmap
    import os

    src = tmp_path / "src.bin"
    src.write_bytes(b"\x5a" * 8192)
    arena = CpuArena(1 << 20, prefault=False)
    try:
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ember-pool-{os.getpid()}-")]
        fd = arena.share_fd()
        assert fd is not None and "path" not in arena.handle()
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & ARENA_SEALS == ARENA_SEALS
        arena.load([[CopyJob(str(src), 0, 4096, 8192)]])  # the daemon's own mapping still writes
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            for target in (fd, reopened):
                with pytest.raises(PermissionError):
                    os.pwrite(target, b"evil", 4096)
                with pytest.raises(PermissionError):
                    mmap.mmap(target, 1 << 20, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.ftruncate(target, 0)
        finally:
            os.close(reopened)
        assert arena.read(4096, 8192) == b"\x5a" * 8192
    finally:
        arena.close()


def test_decayed_count_rate_tracks_steady_arrivals_and_fades() -> None:
    est = DecayedCountRateEstimator(time_constant_s=100.0)
    assert est.rate("m", 0.0) == 0.0
    for i in range(2000):
        est.observe("m", i * 2.0)  # one request every 2 s
    assert est.rate("m", 4000.0) == pytest.approx(0.5, rel=0.05)
    assert est.rate("m", 4000.0 + 1000.0) < 0.5 * 1e-4
    assert 0.0 < est.miss_probability("m", 4000.0, 60.0) < 1.0
    with pytest.raises(ValueError):
        DecayedCountRateEstimator(time_constant_s=0)


def test_store_entry_can_be_moved(tmp_path: Path) -> None:
    m = store.write(tmp_path / "a" / "m", {"x": torch.arange(6, dtype=torch.float32)})
    (tmp_path / "a").rename(tmp_path / "b")
    moved = store.read(tmp_path / "b" / "m")
    assert moved["x"].file == str(tmp_path / "b" / "m" / store.TENSORS_FILE)
    assert moved["x"].fingerprint == m["x"].fingerprint and store.verify(moved) == []


def test_cpu_arena_refuses_non_regular_store_files(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    arena = CpuArena(1 << 20, prefault=False)
    try:
        with pytest.raises(LoadError, match="not a regular file"):
            arena.load([[CopyJob(str(fifo), 0, 0, 10)]])
    finally:
        arena.close()


def test_the_file_lays_tensors_out_in_the_order_given(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {
        "z.first": torch.arange(6, dtype=torch.float32),
        "a.second": torch.arange(4, dtype=torch.bfloat16),
        "m.third": torch.arange(10, dtype=torch.int8),
    }
    manifest = store.write(tmp_path / "ordered", tensors)
    offsets = [e.offset for e in manifest.tensors]
    assert [e.name for e in manifest.tensors] == list(tensors) and offsets == sorted(offsets)
    loaded = load_file(str(tmp_path / "ordered" / store.TENSORS_FILE))
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    # The data starts on a 4 KiB boundary, where direct I/O can read it (gpu_pool.arena.direct_read).
    assert offsets[0] % store.DATA_ALIGN == 0
    # A float32 after an odd number of bytes would be unaligned: the library's layout instead.
    odd = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.ones(2, dtype=torch.float32)}
    manifest = store.write(tmp_path / "odd", odd)
    assert store.verify(manifest) == []
    assert manifest["b"].offset < manifest["a"].offset
