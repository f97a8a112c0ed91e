"""The worker side of the pool protocol.

:class:`PoolClient` connects to a pool daemon's socket (one connection = one session),
maps the arena once, and turns placements into torch tensor views: no copies. A worker
that exits or dies releases its session because its socket closes.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from gpu_pool.errors import ERRORS_BY_CODE, PoolError, ProtocolError
from gpu_pool.manifest import DTYPE_ITEMSIZE, Manifest
from gpu_pool.protocol import PROTOCOL_VERSION, decode_reply, recv_frame, send_frame

if TYPE_CHECKING:
    import torch


class RemotePoolError(PoolError):
    """An error reply from the daemon; ``code`` is the daemon's error type."""

    def __init__(self, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.code = code
        self.error_details = details

    @property
    def kind(self) -> type[PoolError]:
        """The daemon-side error class (``PoolError`` for unknown codes)."""
        return ERRORS_BY_CODE.get(self.code, PoolError)

    def details(self) -> dict[str, Any]:
        return dict(self.error_details)


@dataclass(frozen=True, slots=True)
class AcquireReport:
    """What the last ``acquire`` cost, as the daemon measured it."""

    bytes_loaded: int
    bytes_reused: int
    bytes_moved: int
    bytes_evicted: int
    load_seconds: float
    plan_seconds: float


@dataclass(frozen=True, slots=True)
class KVBlocks:
    """KV blocks granted to this session: ids and arena offsets, all ``block_bytes`` long."""

    block_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    block_bytes: int


@dataclass(frozen=True)
class MappedArena:
    """An arena mapping that outlives the session that made it (see :func:`premap`)."""

    handle: dict[str, Any]
    arena: torch.Tensor


def premap(socket_path: str) -> MappedArena:
    """Map the pool's arena and fault its pages in, holding no session afterwards.

    A fresh mapping of a 270 MB model costs ~15 ms of page faults on its first pass; a
    pre-warmed worker pays them here, before an instance start needs them.
    """
    import torch

    with PoolClient(socket_path) as client:
        arena = client.arena()
        handle = client.arena_handle
    if arena.device.type == "cpu" and arena.numel() >= 8:
        page_words = 4096 // 8
        arena[: arena.numel() // 8 * 8].view(torch.int64)[::page_words].sum()  # one read per 4 KiB page
    return MappedArena(handle, arena)


class PoolClient:
    """A session with one pool daemon. Not thread-safe: use one per thread."""

    def __init__(self, socket_path: str, timeout: float = 120.0, mapped: MappedArena | None = None) -> None:
        """Connect and say hello. ``mapped``: an arena this process mapped earlier (a pre-warmed
        worker maps and pre-faults it before it has a function); reused if it is the same one."""
        self.socket_path = socket_path
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as exc:
            self._sock.close()
            raise ConnectionError(f"cannot reach the pool daemon at {socket_path}: {exc}") from None
        self._arena: torch.Tensor | None = None
        self._storage: torch.UntypedStorage | None = None
        self.last_acquire: AcquireReport | None = None
        info = self._call("hello", pid=os.getpid())
        self.session_id: str = info["session_id"]
        self.device: str = info["device"]
        self.arena_handle: dict[str, Any] = info["arena"]
        self.alignment: int = info["alignment"]
        if mapped is not None and mapped.handle == self.arena_handle:
            self._arena = mapped.arena
            self._storage = mapped.arena.untyped_storage()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the session; the daemon releases everything it held."""
        self._sock.close()

    # ----- operations ----------------------------------------------------------------------------

    def acquire(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Pin ``manifest``'s tensors (loading missing ones) and return views into the arena."""
        reply = self._call("acquire", manifest_bin=manifest.encoded())
        self.last_acquire = AcquireReport(
            reply["bytes_loaded"],
            reply["bytes_reused"],
            reply["bytes_moved"],
            reply["bytes_evicted"],
            reply["load_seconds"],
            reply["plan_seconds"],
        )
        placements: dict[str, int] = reply["placements"]
        return {e.name: self.view(placements[e.name], e.dtype, e.shape) for e in manifest.tensors}

    def release(self) -> None:
        """Unpin everything this session acquired and free its KV blocks; tensors stay resident."""
        self._call("release")

    def kv_alloc(self, num_blocks: int, block_bytes: int, aligned: bool = False) -> KVBlocks:
        """Allocate ``num_blocks`` KV blocks of at least ``block_bytes`` each (``aligned``: each
        at a multiple of the block size, so ``offset // block_bytes`` numbers it)."""
        reply = self._call("kv_alloc", num_blocks=num_blocks, block_bytes=block_bytes, aligned=aligned)
        return KVBlocks(tuple(reply["block_ids"]), tuple(reply["offsets"]), reply["block_bytes"])

    def kv_free(self, block_ids: list[int] | tuple[int, ...]) -> int:
        """Return KV blocks to the pool; returns how many were freed."""
        freed: int = self._call("kv_free", block_ids=list(block_ids))["freed"]
        return freed

    def stats(self) -> dict[str, Any]:
        """The pool's capacity, occupancy and reuse counters."""
        stats: dict[str, Any] = self._call("stats")["stats"]
        return stats

    def evict(self, model_id: str | None = None) -> int:
        """Admin: evict inactive tensors (of one model, or all); returns bytes freed."""
        freed: int = self._call("evict", model_id=model_id)["bytes_evicted"]
        return freed

    # ----- arena views ---------------------------------------------------------------------------

    def view(self, offset: int, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over the arena bytes starting at ``offset``."""
        import torch

        arena = self.arena()
        itemsize = DTYPE_ITEMSIZE[dtype]
        assert offset % itemsize == 0, "the pool aligns every region"
        shape = tuple(shape)
        t = torch.empty(0, dtype=getattr(torch, dtype), device=arena.device)
        assert self._storage is not None
        return t.set_(self._storage, offset // itemsize, shape, _contiguous_stride(shape))

    def arena(self) -> torch.Tensor:
        """The whole arena as a 1-D uint8 tensor (mapped on first use, then cached)."""
        if self._arena is None:
            self._arena = _attach(self.arena_handle)
            self._storage = self._arena.untyped_storage()
        return self._arena

    # ----- transport -----------------------------------------------------------------------------

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        try:
            send_frame(self._sock, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})
            reply = decode_reply(recv_frame(self._sock))
            if reply.get("id") != request_id:
                raise ProtocolError(f"reply id {reply.get('id')!r} does not match request {request_id}")
        except (OSError, ProtocolError):
            # A late reply would answer the next call: this session cannot be trusted any more.
            # Closing it makes the daemon release everything the session held.
            self._sock.close()
            raise
        if not reply.get("ok"):
            err = reply.get("error") or {}
            details = {k: v for k, v in err.items() if k not in ("type", "message")}
            raise RemotePoolError(str(err.get("type")), str(err.get("message")), details)
        return reply


def _attach(handle: dict[str, Any]) -> torch.Tensor:
    import torch

    if handle["kind"] == "shm":
        # from_file would silently create a missing file: check it is the daemon's arena.
        try:
            size = os.stat(handle["path"]).st_size
        except FileNotFoundError:
            raise ProtocolError(f"arena file {handle['path']} does not exist (pool restarted?)") from None
        if size != handle["size"]:
            raise ProtocolError(f"arena file {handle['path']} has {size} bytes, expected {handle['size']}")
        storage = cast(
            "torch.UntypedStorage",
            torch.UntypedStorage.from_file(handle["path"], shared=True, nbytes=handle["size"]),
        )
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    if handle["kind"] == "cuda_ipc":
        from gpu_pool.arena_cuda import attach_cuda

        return attach_cuda(handle)
    raise ProtocolError(f"unknown arena kind {handle['kind']!r}")


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
