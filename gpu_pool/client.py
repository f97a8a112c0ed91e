"""The worker side of the pool protocol.

:class:`PoolClient` connects to a pool daemon's socket (one connection = one session),
maps the arena once, and turns placements into torch tensor views: no copies. A worker
that exits or dies releases its session because its socket closes.

On a CPU pool the arena arrives as a sealed memfd with the ``hello`` reply and is mapped
read-only: weight views cannot be written (a write faults). KV blocks live in a memfd private
to the session, mapped read-write: :meth:`PoolClient.kv_arena` is the tensor to build KV
views on (``KVBlocks`` offsets index it), :meth:`PoolClient.kv_view` one block. On CUDA both
are the arena, as before. :meth:`PoolClient.watch` tells a worker when its pool has died.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from gpu_pool.acquire_report import AcquireReport
from gpu_pool.arena import mapping
from gpu_pool.errors import ERRORS_BY_CODE, KVQuotaExceeded, OutOfMemory, PoolError, ProtocolError
from gpu_pool.manifest import Manifest
from gpu_pool.readiness import Readiness
from gpu_pool.wire import fdpass
from gpu_pool.wire.messages import MAX_PREFIX_BLOCKS, PrefixPrefetch
from gpu_pool.wire.protocol import PROTOCOL_VERSION, decode_reply, recv_frame, send_frame

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ember.pool.client")

__all__ = [
    "AcquireReport",
    "KVBlocks",
    "MappedArena",
    "PoolClient",
    "PrefixPrefetch",
    "Readiness",
    "RemotePoolError",
    "premap",
]


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
class KVBlocks:
    """KV blocks granted to this session: ids and offsets, all ``block_bytes`` long. Offsets
    are arena offsets (the pool's accounting) and index :meth:`PoolClient.kv_arena`.
    ``prefix_hashes``: the first blocks hold published prefix KV with these chained hashes, in
    order (an acquire's prefix prefetch, :meth:`PoolClient.acquire_async`)."""

    block_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    block_bytes: int
    prefix_hashes: tuple[bytes, ...] = ()


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

    def __init__(
        self,
        socket_path: str,
        timeout: float = 120.0,
        mapped: MappedArena | None = None,
        admin_token: str | None = None,
        ticket: str | None = None,
    ) -> None:
        """Connect and say hello. ``mapped``: an arena this process mapped earlier (a pre-warmed
        worker maps and pre-faults it before it has a function); reused if it is the same one.
        ``admin_token``: the pool's admin token (an admin session may evict and grant);
        ``ticket``: a ticket from :meth:`grant` whose KV quota this session gets."""
        self.socket_path = socket_path
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
            self._daemon = _Listener(_listener_pid(self._sock), _socket_file(socket_path))
        except OSError as exc:
            self._sock.close()
            raise ConnectionError(f"cannot reach the pool daemon at {socket_path}: {exc}") from None
        self._arena: torch.Tensor | None = None
        self._storage: torch.UntypedStorage | None = None
        self._kv: torch.Tensor | None = None
        self._kv_storage: torch.UntypedStorage | None = None
        self._views: mapping.Views | None = None  # over the arena, made on the first view
        self._kv_views: mapping.Views | None = None
        self._fds: dict[str, int] = {}  # "arena" / "kv": received, not yet mapped
        self._watcher: tuple[threading.Thread, int] | None = None  # thread, stop pipe's write end
        self._in_flight = False  # a request awaits its reply (one at a time: replies come in order)
        self.last_acquire: AcquireReport | None = None
        credentials = {k: v for k, v in (("admin_token", admin_token), ("ticket", ticket)) if v is not None}
        try:
            info, fds = self._request("hello", pid=os.getpid(), **credentials)
        except BaseException:
            self._sock.close()
            raise
        self.session_id: str = info["session_id"]
        self.device: str = info["device"]
        self.arena_handle: dict[str, Any] = info["arena"]
        self.alignment: int = info["alignment"]
        self.admin: bool = bool(info.get("admin", False))
        self.kv_quota_bytes: int | None = info.get("kv_quota_bytes")
        features = info.get("features")  # (gpu_pool.wire.protocol.FEATURES; absent: an older daemon)
        self.features: frozenset[str] = frozenset(
            f for f in (features if isinstance(features, list) else ()) if isinstance(f, str)
        )
        if fds:
            self._fds["arena"] = fds[0]
        if mapped is not None and mapped.handle == self.arena_handle:
            self._arena = mapped.arena
            self._storage = mapped.arena.untyped_storage()
            self._close_fd("arena")

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the session; the daemon releases everything it held (KV pages read as zeros
        afterwards; weight views stay valid)."""
        self._stop_watch()
        self._sock.close()
        for name in list(self._fds):
            self._close_fd(name)

    def daemon_answers(self, timeout: float = 0.5) -> bool:
        """Whether the daemon this session was opened on still serves (after its watch fired:
        then it dropped this session and did not die). Blocks for up to ``timeout`` seconds.
        A killed daemon closes this session's socket before its listening one, so a connection
        made in between is taken into its backlog and reset a moment later; one still open
        after ``timeout`` was taken by a live daemon. A restarted daemon does not count, however
        quickly it came back: the connection names the process that listens (``SO_PEERCRED``),
        and where this pid namespace cannot name it (pid 0), the socket file is checked again
        after the wait (a restarted daemon binds a new one)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout)
                probe.connect(self.socket_path)
                if _listener_pid(probe) != self._daemon.pid:
                    return False
                ready, _, _ = select.select([probe], [], [], timeout)
                if ready and probe.recv(1) == b"":  # (a reset raises: dead)
                    return False
            return _socket_file(self.socket_path) == self._daemon.socket_file
        except OSError:
            return False

    @property
    def watched(self) -> bool:
        """Whether :meth:`watch` runs for this session."""
        return self._watcher is not None

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from a daemon thread, when the pool closes this session's
        connection (the daemon died, was stopped, or dropped the session); not after
        :meth:`close`. The thread polls the socket for hang-up only, so it consumes no replies
        and the client stays usable from its own thread."""
        if self._watcher is not None:
            raise RuntimeError("this client is already watched")
        stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
        thread = threading.Thread(
            target=mapping.watch_hangup,
            args=(self._sock.fileno(), stop_r, callback),
            name="ember-pool-watch",
            daemon=True,
        )
        self._watcher = (thread, stop_w)
        thread.start()

    def _stop_watch(self) -> None:
        # Before the socket closes: its descriptor number must not be reused under the poll.
        if self._watcher is None:
            return
        thread, stop_w = self._watcher
        self._watcher = None
        with contextlib.suppress(BrokenPipeError):  # the thread already ended (it saw a hang-up)
            os.write(stop_w, b"x")
        if thread is not threading.current_thread():
            thread.join(5.0)
        os.close(stop_w)

    def _close_fd(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    # ----- operations ----------------------------------------------------------------------------

    def acquire(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Pin ``manifest``'s tensors (loading missing ones) and return views into the arena."""
        return self.views(manifest, self.acquire_placements(manifest))

    def acquire_placements(self, manifest: Manifest, access: bool = True) -> dict[str, int]:
        """Pin ``manifest``'s tensors (loading missing ones) and return their arena offsets
        (bytes) by name: :meth:`acquire` without making views, for a caller that holds views
        of an earlier acquire and only needs to know whether they still point at the tensors.
        ``access`` false: this is not a request for the model (a standby's preparation), so the
        pool counts it in neither the model's request rate nor its reuse counters."""
        fields: dict[str, Any] = {"manifest_bin": manifest.encoded()}
        if not access:
            fields["access"] = False
        reply = self._call("acquire", **fields)
        self.last_acquire = AcquireReport.from_wire(reply.get("report"))
        placements: dict[str, int] = reply["placements"]
        return placements

    def acquire_with_kv(
        self, manifest: Manifest, num_blocks: int, block_bytes: int
    ) -> tuple[dict[str, int], KVBlocks | None]:
        """:meth:`acquire_placements`, and once the tensors are pinned ``kv_alloc(num_blocks,
        block_bytes, aligned=True)`` in the same request (a new instance's first KV blocks come
        with its weights: on a busy 2-core host a round trip to the pool took 1-3.5 ms of a
        cold start). The blocks are None when the pool could not grant them (no room, quota:
        the engine then allocates on demand); an acquire that fails raises and allocates nothing."""
        kv = {"num_blocks": num_blocks, "block_bytes": block_bytes, "aligned": True}
        reply, fds = self._request("acquire", manifest_bin=manifest.encoded(), kv=kv)
        return self._with_kv(reply, fds, asked=True)

    async def acquire_async(
        self,
        manifest: Manifest,
        num_blocks: int = 0,
        block_bytes: int = 0,
        prefix: PrefixPrefetch | None = None,
    ) -> tuple[dict[str, int], KVBlocks | None]:
        """:meth:`acquire_with_kv` (:meth:`acquire_placements` when ``num_blocks`` is 0) that
        leaves the event loop free while the daemon works (:meth:`_request_async`): a worker
        activating reads the requests sent ahead of the activation meanwhile. With ``prefix``
        (and blocks), the first blocks come filled with the prefix KV the session's scope most
        recently restored from a first block (``KVBlocks.prefix_hashes``)."""
        fields: dict[str, Any] = {"manifest_bin": manifest.encoded()}
        if num_blocks:
            fields["kv"] = {"num_blocks": num_blocks, "block_bytes": block_bytes, "aligned": True}
            if prefix is not None:
                fields["kv"]["prefix"] = _prefix_field(prefix)
        reply, fds = await self._request_async("acquire", **fields)
        return self._with_kv(reply, fds, asked=num_blocks > 0)

    @property
    def can_reacquire(self) -> bool:
        """Whether the daemon has :meth:`reacquire_async` (an older one lacks it)."""
        return "reacquire" in self.features

    async def reacquire_async(self, manifest: Manifest) -> dict[str, int] | None:
        """Acquire ``manifest`` again, the manifest of this session's last acquire, after its
        release (a standby's activation), without sending it or getting every placement back:
        None when every tensor is still where that acquire placed it (views made then point at
        them, now pinned), else the new placements (:mod:`gpu_pool.server.repin`). The daemon
        refuses it (``SessionError``) when the session's last acquire was of another model."""
        reply, fds = await self._request_async("reacquire", model_id=manifest.model_id)
        for fd in fds:  # (none is sent; a daemon's bug leaks nothing here)
            os.close(fd)
        self.last_acquire = AcquireReport.from_wire(reply.get("report"))
        if reply.get("unchanged") is True:
            return None
        placements: dict[str, int] = reply["placements"]
        return placements

    def _with_kv(
        self, reply: dict[str, Any], fds: list[int], asked: bool
    ) -> tuple[dict[str, int], KVBlocks | None]:
        """The placements and the blocks of an acquire's ``reply`` (``fds``: sent after it);
        ``asked``: whether the acquire asked for blocks (a refusal of them is logged)."""
        blocks = self._kv_blocks(reply.get("kv"), fds)
        self.last_acquire = AcquireReport.from_wire(reply.get("report"))
        placements: dict[str, int] = reply["placements"]
        if blocks is None and asked:
            failed = reply.get("kv_error") or {}
            if ERRORS_BY_CODE.get(str(failed.get("type"))) not in (OutOfMemory, KVQuotaExceeded):
                log.warning("the pool granted no KV blocks with the acquire: %s", failed.get("message"))
        return placements, blocks

    def acquire_progressive(
        self, manifest: Manifest, groups: list[int] | None = None
    ) -> tuple[dict[str, int], Readiness | None]:
        """:meth:`acquire_placements`, answered as soon as the tensors are placed and pinned
        (TIDAL §5.2): the placements and a :class:`Readiness` telling which groups of tensors
        (``groups``: their ends in manifest order; default one group per tensor) have their
        bytes in. None instead when nothing had to be loaded: every tensor is ready.
        ``last_acquire.load_seconds`` is 0 (the load has not ended when the reply comes)."""
        fields: dict[str, Any] = {"manifest_bin": manifest.encoded(), "progressive": True}
        if groups:
            fields["groups"] = list(groups)
        reply, fds = self._request("acquire", **fields)
        info = reply.get("readiness")
        if (info is None) != (not fds) or len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolError("a progressive acquire reply needs readiness and its pipe together")
        self.last_acquire = AcquireReport.from_wire(reply.get("report"))
        placements: dict[str, int] = reply["placements"]
        if info is None:
            return placements, None
        return placements, Readiness.from_wire(info, fds[0], len(manifest.tensors), manifest.model_id)

    def populate(self, manifest: Manifest, placements: dict[str, int]) -> str | None:
        """Map the arena pages of ``manifest``'s tensors at ``placements`` into this process's
        page tables now (no copy): a standby does it while it waits, so the first forward pass
        after its activation does not fault in the weights page by page (~4k faults, 6-10 ms
        of a 2-core host's cold start). CPU arenas only. Returns None, or why the kernel
        refused (the pages then fault in on first use)."""
        arena = self.arena()
        if arena.device.type != "cpu":
            return None
        spans = [(placements[e.name], e.nbytes) for e in manifest.tensors if e.name in placements]
        return mapping.populate_pages(arena.data_ptr(), mapping.page_ranges(spans))

    def populate_kv(self, blocks: KVBlocks) -> str | None:
        """Map ``blocks``' pages of this session's KV memory into this process's page tables,
        writable, now: pages no one wrote yet are allocated (zeroed), prefix KV the pool copied
        in is mapped as it is. A standby does it for the blocks it holds while it waits, so its
        first prefill does not fault them in one by one (~80 faults of ~3 us each, more where
        the host has not backed the guest's pages yet). CPU pools only. Returns None, or why the
        kernel refused (the pages then fault in on first use)."""
        kv = self.kv_arena()
        if kv.device.type != "cpu":
            return None
        spans = [(offset, blocks.block_bytes) for offset in blocks.offsets]
        return mapping.populate_pages(kv.data_ptr(), mapping.page_ranges(spans), write=True)

    def views(self, manifest: Manifest, placements: dict[str, int]) -> dict[str, torch.Tensor]:
        """Views into the arena of ``manifest``'s tensors at ``placements`` (from an acquire)."""
        return self._arena_views().many(manifest.tensors, placements)

    def release(self, keep_kv: bool = False) -> None:
        """Unpin everything this session acquired and free its KV blocks (``keep_kv``: all but
        those); tensors stay resident. ``keep_kv`` on a daemon that cannot (:attr:`keeps_kv`
        is False: it would free them, and this session's engine would hand out blocks the pool
        gives to others) raises :class:`ProtocolError` before anything is sent."""
        if keep_kv and not self.keeps_kv:
            raise ProtocolError("this pool daemon does not keep KV blocks over a release (an older one)")
        self._call("release", **({"keep_kv": True} if keep_kv else {}))

    @property
    def keeps_kv(self) -> bool:
        """Whether the daemon keeps a session's KV blocks over ``release(keep_kv=True)``."""
        return "keep_kv" in self.features

    def kv_alloc(
        self, num_blocks: int, block_bytes: int, aligned: bool = False, prefix: PrefixPrefetch | None = None
    ) -> KVBlocks:
        """Allocate ``num_blocks`` KV blocks of at least ``block_bytes`` each (``aligned``: each
        at a multiple of the block size, so ``offset // block_bytes`` numbers it). With
        ``prefix``, the first come filled with the prefix KV the session's scope most recently
        restored from a first block (``KVBlocks.prefix_hashes``)."""
        fields: dict[str, Any] = {"prefix": _prefix_field(prefix)} if prefix is not None else {}
        reply, fds = self._request(
            "kv_alloc", num_blocks=num_blocks, block_bytes=block_bytes, aligned=aligned, **fields
        )
        blocks = self._kv_blocks(reply, fds)
        if blocks is None:
            raise ProtocolError("a kv_alloc reply without its blocks")
        return blocks

    def _kv_blocks(self, granted: dict[str, Any] | None, fds: list[int]) -> KVBlocks | None:
        """The blocks of a ``kv_alloc`` answer (``kv_alloc``'s reply, or an acquire's ``kv``);
        the session's KV memory comes with its first blocks (kept, mapped on first use)."""
        for fd in fds[1:]:  # at most that one descriptor is expected: leak nothing else
            os.close(fd)
        if fds:
            self._close_fd("kv")
            self._fds["kv"] = fds[0]
        if granted is None:
            return None
        hashes = tuple(granted.get("prefix_hashes", ()))
        if not all(isinstance(h, bytes) for h in hashes) or len(hashes) > len(granted["block_ids"]):
            raise ProtocolError("an acquire's prefix hashes must be byte strings, one per block at most")
        return KVBlocks(
            tuple(granted["block_ids"]), tuple(granted["offsets"]), granted["block_bytes"], hashes
        )

    def kv_free(self, block_ids: list[int] | tuple[int, ...]) -> int:
        """Return KV blocks to the pool; returns how many were freed."""
        freed: int = self._call("kv_free", block_ids=list(block_ids))["freed"]
        return freed

    def kv_publish(
        self,
        model_id: str,
        layout: str,
        hashes: list[bytes],
        block_ids: list[int],
        recompute_s: float = 0.0,
    ) -> int:
        """Publish this session's (fully written) KV blocks ``block_ids`` as prefix KV of
        ``model_id`` in ``layout``, keyed by their chained ``hashes``: the daemon copies them into
        the arena, where later instances can restore them after this one ends. Hashes already
        published are only touched. ``recompute_s``: seconds a prefill of one block takes (its
        eviction cost). Returns how many blocks were copied."""
        reply = self._call(
            "kv_publish",
            model_id=model_id,
            layout=layout,
            hashes=list(hashes),
            block_ids=list(block_ids),
            recompute_s=float(recompute_s),
        )
        published: int = reply["published"]
        return published

    def kv_restore(
        self, model_id: str, layout: str, hashes: list[bytes], block_ids: list[int], first: bool = False
    ) -> int:
        """Fill this session's blocks ``block_ids`` with the published KV of the longest run of
        ``hashes`` from the first; returns how many blocks were filled. ``first``: the hashes
        are a prompt's from its first block on, which the pool remembers as its scope's most
        recent prefix (a new instance's :meth:`acquire_async` may come with it)."""
        fields: dict[str, Any] = {"first": True} if first else {}
        reply = self._call(
            "kv_restore",
            model_id=model_id,
            layout=layout,
            hashes=list(hashes),
            block_ids=list(block_ids),
            **fields,
        )
        restored: int = reply["restored"]
        return restored

    def stats(self) -> dict[str, Any]:
        """The pool's capacity, occupancy and reuse counters."""
        stats: dict[str, Any] = self._call("stats")["stats"]
        return stats

    def evict(self, model_id: str | None = None) -> int:
        """Admin: evict inactive tensors (of one model, or all); returns bytes freed. Needs a
        session opened with the pool's admin token (``forbidden`` otherwise)."""
        freed: int = self._call("evict", model_id=model_id)["bytes_evicted"]
        return freed

    def grant(self, kv_quota_bytes: int, prefix_scope: str | None = None) -> str:
        """Admin: a single-use ticket; the session whose hello presents it may hold
        ``kv_quota_bytes`` of KV blocks and shares published prefix KV only with sessions of the
        same ``prefix_scope`` (None: with every session that has no scoped ticket)."""
        fields: dict[str, Any] = {"kv_quota_bytes": kv_quota_bytes}
        if prefix_scope is not None:
            fields["prefix_scope"] = prefix_scope
        ticket: str = self._call("grant", **fields)["ticket"]
        return ticket

    # ----- arena views ---------------------------------------------------------------------------

    def view(self, offset: int, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over the arena bytes starting at ``offset``
        (read-only memory on a CPU pool: weights)."""
        return self._arena_views().view(offset, dtype, shape)

    def _arena_views(self) -> mapping.Views:
        if self._views is None:
            arena = self.arena()
            assert self._storage is not None
            self._views = mapping.Views(self._storage, arena.device)
        return self._views

    def kv_view(self, offset: int, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """Like :meth:`view`, over this session's KV memory (``KVBlocks`` offsets)."""
        kv = self.kv_arena()
        if self._kv_views is None:
            assert self._kv_storage is not None
            self._kv_views = mapping.Views(self._kv_storage, kv.device)
        return self._kv_views.view(offset, dtype, shape)

    def arena(self) -> torch.Tensor:
        """The whole arena as a 1-D uint8 tensor (mapped on first use, then cached)."""
        if self._arena is None:
            self._arena = mapping.attach(self.arena_handle, self._fds.get("arena"))
            self._storage = self._arena.untyped_storage()
            self._close_fd("arena")  # the mapping holds the file
        return self._arena

    def kv_arena(self) -> torch.Tensor:
        """This session's KV memory as a 1-D uint8 tensor of the arena's size, writable and
        seen by no other session; ``KVBlocks`` offsets index it. On CUDA, the arena."""
        if self._kv is not None:
            return self._kv
        if "kv" not in self._fds:
            reply, fds = self._request("kv_map")
            if not reply.get("private_kv"):
                self._kv = self.arena()
                self._kv_storage = self._storage
                return self._kv
            if fds:
                self._fds["kv"] = fds[0]
        if "kv" not in self._fds:
            raise ProtocolError("the pool did not send this session's KV memory")
        self._kv = mapping.map_memfd(self._fds["kv"], int(self.arena_handle["size"]), writable=True)
        self._kv_storage = self._kv.untyped_storage()
        self._close_fd("kv")
        return self._kv

    # ----- transport -----------------------------------------------------------------------------

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        reply, fds = self._request(op, **fields)
        for fd in fds:  # none expected: do not leak what an odd daemon sent
            os.close(fd)
        return reply

    def _request(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """One request; the reply and the descriptors sent after it (see gpu_pool.wire.fdpass)."""
        self._begin()
        request_id = next(self._ids)
        try:
            send_frame(self._sock, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})
            reply, fds = self._receive(request_id)
        except (OSError, ProtocolError):
            self._abandon()
            raise
        finally:
            self._in_flight = False
        return self._checked(reply, fds)

    def _begin(self) -> None:
        """Mark a request in flight; RuntimeError when one is already (another task's await of
        :meth:`_request_async`): its reply would be read as this one's, closing the session."""
        if self._in_flight:
            raise RuntimeError("this pool session has a request in flight: one request at a time")
        self._in_flight = True

    async def _request_async(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """:meth:`_request` that waits for the reply on the running event loop instead of in a
        blocking read: the request (a few KiB at most) is sent at once, and the reply is read
        when the socket turns readable (the daemon writes a reply whole, the descriptors right
        after it). Cancelled or past the session's timeout, the session is closed, as after
        any failed exchange."""
        loop = asyncio.get_running_loop()
        self._begin()
        request_id = next(self._ids)
        fd = self._sock.fileno()
        readable: asyncio.Future[None] = loop.create_future()
        try:
            send_frame(self._sock, {"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})
            loop.add_reader(fd, _set_once, readable)
            try:
                async with asyncio.timeout(self._sock.gettimeout()):
                    await readable
            finally:
                loop.remove_reader(fd)
            reply, fds = self._receive(request_id)
        except (OSError, ProtocolError, TimeoutError, asyncio.CancelledError):
            self._abandon()
            raise
        finally:
            self._in_flight = False
        return self._checked(reply, fds)

    def _receive(self, request_id: int) -> tuple[dict[str, Any], list[int]]:
        reply = decode_reply(recv_frame(self._sock))
        if reply.get("id") != request_id:
            raise ProtocolError(f"reply id {reply.get('id')!r} does not match request {request_id}")
        fds = fdpass.recv_fds(self._sock, reply["fds"]) if reply.get("fds") else []
        return reply, fds

    def _abandon(self) -> None:
        # A late reply would answer the next call: this session cannot be trusted any more.
        # Closing it makes the daemon release everything the session held.
        self._stop_watch()
        self._sock.close()

    @staticmethod
    def _checked(reply: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The reply and its descriptors, or the daemon's error raised."""
        if not reply.get("ok"):
            err = reply.get("error") or {}
            details = {k: v for k, v in err.items() if k not in ("type", "message")}
            raise RemotePoolError(str(err.get("type")), str(err.get("message")), details)
        return reply, fds


def _prefix_field(prefix: PrefixPrefetch) -> dict[str, Any]:
    """``prefix`` on the wire, its ``max_blocks`` within the wire's bound (a prefetch is an
    offer: asking for more than a pool may give must not fail the allocation it rides on)."""
    return {**asdict(prefix), "max_blocks": max(1, min(prefix.max_blocks, MAX_PREFIX_BLOCKS))}


def _set_once(future: asyncio.Future[None]) -> None:
    """A reader callback (level-triggered: it runs until removed) that resolves ``future`` once."""
    if not future.done():
        future.set_result(None)


class _Listener(NamedTuple):
    """The daemon a session was opened on: the pid that listens (0 where this pid namespace
    cannot name it) and its socket file."""

    pid: int
    socket_file: tuple[int, int]


def _listener_pid(sock: socket.socket) -> int:
    """The pid of the process whose listening socket ``sock`` connected to (``SO_PEERCRED``:
    recorded at ``listen()``; 0 when it is outside this pid namespace)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def _socket_file(path: str) -> tuple[int, int]:
    """Which socket file ``path`` names (device, inode): a daemon that binds it anew makes a
    new one. Not its change time: a ``chmod`` or ``touch`` moves that on the same file."""
    st = os.stat(path)
    return st.st_dev, st.st_ino
