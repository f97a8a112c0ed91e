"""The pool daemon: one per device, serving the pool protocol on a Unix socket.

Every connection is a session. Requests on one connection are answered in order; state
changes of all sessions are serialised by one asyncio lock (planning and bookkeeping take
microseconds to a millisecond). Byte copies of an acquire run in a worker thread *outside*
the lock, into regions reserved and pinned while it was held, so a slow load stalls no
other session and the event loop keeps accepting connections and noticing disconnects.
A connection that closes, for whatever reason including SIGKILL of its process, releases
its session's pins and KV blocks.
A progressive acquire (TIDAL §5.2, :mod:`gpu_pool.server.progressive`) replies once the
tensors are placed and pinned, with a readiness pipe, and copies group by group in manifest
(access) order in a task of its session: the session's next acquire waits for it, and its
``release`` or disconnect cancels it (between groups) and aborts it before the pins go.
Malformed messages get a typed error reply; an oversized frame gets a reply and the
connection is closed (its framing can no longer be trusted); the daemon keeps serving.

Isolation (issue 10): on a CPU pool the arena is a sealed memfd that only the daemon's own
mapping can write (:mod:`gpu_pool.arena.cpu`); each session gets it with the ``hello`` reply
over ``SCM_RIGHTS`` (:mod:`gpu_pool.wire.fdpass`) and maps it read-only. KV blocks are accounted in
the arena's region list but their pages live in a memfd private to the session
(:mod:`gpu_pool.arena.kv_memory`). ``evict`` and ``grant`` need an admin session, and KV blocks are
bounded by a per-session quota (:mod:`gpu_pool.server.access`). Requests are typed messages
(:mod:`gpu_pool.wire.messages`): every field is type- and range-checked before a handler runs, so
bad values get a typed error reply, never a dropped connection. The daemon process is not
dumpable, so other processes of its uid cannot reach its descriptors through ``/proc``.

Manifests are not taken on trust (:mod:`gpu_pool.store.trust`): before an acquire pins or loads
anything, every tensor's file must resolve inside one of the configured store roots
(``--store DIR`` / ``EMBER_POOL_STORE``) and every static tensor must match, field for field,
the store entry that holds it; otherwise the reply is an ``untrusted_manifest`` error naming
the tensor and the field. A daemon started without store roots still serves ``hello``,
``stats`` and KV blocks (a KV-only pool is legitimate) but refuses every acquire that names a
tensor, saying how to configure a store; it warns about that once at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from gpu_pool.acquire_report import AcquireReport
from gpu_pool.arena.base import BaseArena, CopyJob
from gpu_pool.arena.direct_read import DIRECT_ALIGN
from gpu_pool.arena.kv_memory import SessionKV
from gpu_pool.config import PoolConfig
from gpu_pool.errors import (
    ConfigError,
    InvalidArgument,
    LoadError,
    MessageTooLarge,
    OutOfMemory,
    PoolError,
    SessionError,
)
from gpu_pool.manifest import Manifest
from gpu_pool.planner.regions import DEFAULT_ALIGNMENT, align_up
from gpu_pool.server import progressive
from gpu_pool.server.access import AccessControl, Session
from gpu_pool.server.hardening import make_undumpable
from gpu_pool.server.kv_copy import KVCopier
from gpu_pool.server.manifest_cache import ManifestCache
from gpu_pool.server.reuse_store import AcquireResult, KVBlock, PendingAcquire, ReuseStore, StoreConfig
from gpu_pool.store.trust import StoreTrust
from gpu_pool.wire import fdpass, messages
from gpu_pool.wire.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    decode_request,
    encode,
    encode_reply,
    error_reply,
    read_frame,
)

log = logging.getLogger("ember.pool")
Reply = tuple[dict[str, Any], list[int]]  # reply fields, descriptors sent after it (SCM_RIGHTS)
_MAX_REPLANS = 3  # an acquire whose shared tensors' loads by other sessions failed plans again


def make_arena(config: PoolConfig) -> BaseArena:
    """The arena backend for ``config.device``."""
    if config.device == "cpu":
        from gpu_pool.arena.cpu import CpuArena

        return CpuArena(
            config.aligned_arena_bytes,
            prefault=config.prefault,
            num_threads=config.load_threads,
            direct_reads=config.direct_reads,
        )
    from gpu_pool.arena.cuda import CudaArena

    index = int(config.device.split(":", 1)[1])
    return CudaArena(
        index,
        config.aligned_arena_bytes,
        host_cache_bytes=config.host_cache_bytes,
        num_threads=config.load_threads,
    )


class PoolDaemon:
    """Serves one :class:`ReuseStore` over a Unix socket."""

    def __init__(self, config: PoolConfig, arena: BaseArena | None = None) -> None:
        self.config = config
        self.arena = arena or make_arena(config)
        self.store = ReuseStore(
            self.arena,
            StoreConfig(
                # CPU: the disk's logical block, so that tensor bytes can be read into their
                # places by direct I/O (gpu_pool.arena.direct_read).
                alignment=DIRECT_ALIGN if config.device == "cpu" else DEFAULT_ALIGNMENT,
                eviction=config.eviction,
                packing=config.packing,
                prefix_bytes=config.prefix_bytes,
                importance=config.importance,
            ),
        )
        self._lock = asyncio.Lock()
        self._loading: dict[str, asyncio.Future[bool]] = {}  # tensor key -> its load's outcome
        self._session_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._manifests = ManifestCache()
        self._trust = StoreTrust(config.store_roots)
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._access = AccessControl(config.admin_token, config.default_session_kv_quota, config.max_tickets)
        # CPU pools give each session its own KV pages; on CUDA, KV blocks stay in the arena.
        self._private_kv = self.arena.share_fd() is not None
        self._kv_copier = KVCopier(self.arena, self._private_kv)
        # Progressive acquires (gpu_pool.server.progressive): session -> its load task, cancel flag.
        self._progressive: dict[str, tuple[asyncio.Task[None], threading.Event]] = {}
        self._transient_fds: set[int] = set()  # descriptors to close once their reply is sent

    async def start(self) -> None:
        """Bind the socket (replacing a stale one) and start accepting."""
        path = self.config.socket_path
        if os.path.exists(path):
            if _socket_is_live(path):
                raise ConfigError(f"socket {path}: another pool daemon is already serving there")
            os.unlink(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=path)
        os.chmod(path, 0o600)

    async def serve_forever(self) -> None:
        """Start, announce readiness on stdout (one JSON line), serve until stopped."""
        try:
            await self.start()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stopped.set)
            ready = {
                "event": "ready",
                "socket": self.config.socket_path,
                "device": self.arena.device,
                "capacity_bytes": self.arena.capacity,
                "pid": os.getpid(),
                "store_roots": list(self._trust.roots),
            }
            if not self._trust.roots:
                log.warning(
                    "no model store configured (--store DIR or EMBER_POOL_STORE): every acquire "
                    "that names a tensor will be refused"
                )
            print(json.dumps(ready), flush=True)
            await self._stopped.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop accepting, close the arena and remove our socket (never another daemon's)."""
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        # Closing the transports ends each handler at its next read, which releases its session.
        for writer in self._connections.values():
            writer.close()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        self.arena.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = self._access.new_session(f"s{next(self._session_ids)}-{os.getpid()}")
        self.store.open_session(session.session_id)
        fdpass.prepare(writer)
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while True:
                try:
                    body = await read_frame(reader, self.config.max_message_bytes)
                except asyncio.IncompleteReadError:
                    break
                except MessageTooLarge as exc:
                    writer.write(encode(error_reply(exc)))
                    await writer.drain()
                    break
                request_id: Any = None
                fds: list[int] = []
                try:
                    raw = decode_request(body)
                    request_id = raw.get("id")
                    reply, fds = await self._dispatch(session, messages.parse(raw))
                    reply.update(v=PROTOCOL_VERSION, id=request_id, ok=True)
                    if fds:
                        reply["fds"] = len(fds)
                    frame = encode(reply)
                except PoolError as exc:
                    self._close_transient(fds)
                    fds = []
                    frame = encode_reply(error_reply(exc, request_id))
                except Exception as exc:  # a bug (or an unencodable reply): answer it, log it, keep serving
                    log.exception("internal error serving %s", session.session_id)
                    self._close_transient(fds)
                    fds = []
                    failure = PoolError(f"internal error: {type(exc).__name__}: {exc}")
                    frame = encode_reply(error_reply(failure, request_id))
                try:
                    writer.write(frame)
                    if fds:
                        await fdpass.send_fds(writer, fds)
                        session.kv_sent = session.kv_sent or (session.kv is not None and session.kv.fd in fds)
                    else:
                        await writer.drain()
                finally:
                    self._close_transient(fds)
        except (ConnectionError, OSError):
            pass  # the peer went away mid-reply; the session is released below
        finally:
            self._connections.pop(task, None)
            await self._finish_progressive(session.session_id, cancel=True)
            async with self._lock:
                self.store.close_session(session.session_id)
            if session.kv is not None:
                session.kv.close()  # punches every page out
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _acquire(self, session_id: str, manifest: Manifest, access: bool = True) -> AcquireResult:
        """Plan under the lock, copy bytes without it, commit under it again.

        A slow load therefore stalls no other session. A session that needs a tensor another
        session is still loading waits for that load (and fails if it fails).
        """
        pending, mine = await self._begin(session_id, manifest, access)
        ok = False
        try:
            # A resident model has nothing to copy: no thread hop (0.3-1 ms on the cold path).
            load_seconds = await asyncio.to_thread(self.store.load, pending) if pending.jobs else 0.0
            async with self._lock:
                result = self.store.complete_acquire(pending, load_seconds)
            ok = True
            return result
        finally:
            await self._settle(pending, mine, ok)

    async def _begin(
        self, session_id: str, manifest: Manifest, access: bool
    ) -> tuple[PendingAcquire, dict[str, asyncio.Future[bool]]]:
        """Plan and pin under the lock, then wait for other sessions' loads of shared tensors;
        returns the pending acquire and the futures of the loads it owns."""
        loop = asyncio.get_running_loop()
        for _ in range(_MAX_REPLANS + 1):
            async with self._lock:
                pending = self.store.begin_acquire(session_id, manifest, access)
                waits = [self._loading[k] for k in pending.waits_on]
                mine = {k: loop.create_future() for k in pending.missing}
                self._loading.update(mine)
            try:
                for other in waits:
                    if not await asyncio.shield(other):
                        break
                else:
                    return pending, mine
            except BaseException:
                await self._settle(pending, mine, False)
                raise
            # The other session's load failed or was cancelled (its client went away in the
            # middle of a progressive load): what it was loading is not resident, so planning
            # again makes this acquire load it itself. Bounded: a load that keeps failing fails.
            await self._settle(pending, mine, False)
        raise LoadError(f"loading {manifest.model_id}: a concurrent load of a shared tensor failed")

    async def _settle(self, pending: PendingAcquire, mine: dict[str, asyncio.Future[bool]], ok: bool) -> None:
        """End an acquire: abort it unless ``ok``, and tell waiting sessions how its loads went."""
        if not ok:
            async with self._lock:
                self.store.abort_acquire(pending)
        for k, future in mine.items():
            self._loading.pop(k, None)
            future.set_result(ok)

    async def _acquire_progressive(
        self, session: Session, manifest: Manifest, request: messages.Acquire
    ) -> Reply:
        """Reply with placements and a readiness pipe once planned; copy in the background."""
        ends = progressive.group_ends(len(manifest.tensors), request.groups)  # before pinning anything
        pending, mine = await self._begin(session.session_id, manifest, request.access)
        if not pending.jobs:  # all resident: a plain reply, no pipe
            ok = False
            try:
                async with self._lock:
                    result = self.store.complete_acquire(pending, 0.0)
                ok = True
            finally:
                await self._settle(pending, mine, ok)
            return {"placements": result.placements, "report": result.to_wire()}, []
        groups = progressive.plan_groups(pending, ends)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        cancel = threading.Event()
        task = asyncio.create_task(self._load_progressively(pending, mine, groups, write_fd, cancel))
        self._progressive[session.session_id] = (task, cancel)
        self._transient_fds.add(read_fd)
        unique = pending.unique
        report = AcquireReport(
            bytes_loaded=sum(unique[k].nbytes for k in pending.missing),
            bytes_reused=sum(unique[k].nbytes for k in pending.resident),
            bytes_moved=pending.bytes_moved,
            bytes_evicted=pending.bytes_evicted,
            load_seconds=0.0,  # still loading: the readiness pipe tells when it ends
            plan_seconds=pending.plan_seconds,
            move_seconds=pending.move_seconds,
        )
        placements = {e.name: self.store.tensors[pending.keys[e.name]].offset for e in manifest.tensors}
        readiness = {"v": messages.READINESS_VERSION, "groups": list(ends)}
        return {"placements": placements, "report": report.to_wire(), "readiness": readiness}, [read_fd]

    async def _load_progressively(
        self,
        pending: PendingAcquire,
        mine: dict[str, asyncio.Future[bool]],
        groups: list[list[CopyJob]],
        write_fd: int,
        cancel: threading.Event,
    ) -> None:
        ok = False
        try:
            seconds = await asyncio.to_thread(
                progressive.copy_groups, self.store, pending, groups, write_fd, cancel
            )
            async with self._lock:
                self.store.complete_acquire(pending, seconds)
            ok = True
            progressive.signal(write_fd, progressive.READY)  # the last group: committed
        except progressive.LoadCancelled:
            pass
        except Exception:
            log.exception("progressive load of %s failed", pending.manifest.model_id)
        finally:
            if not ok:
                progressive.signal(write_fd, progressive.FAILED)
            os.close(write_fd)
            await self._settle(pending, mine, ok)

    async def _finish_progressive(self, session_id: str, cancel: bool) -> None:
        """Wait for the session's progressive load (cancelled first when ``cancel``): nothing
        may unpin its regions while a worker thread still copies into them."""
        entry = self._progressive.pop(session_id, None)
        if entry is None:
            return
        task, flag = entry
        if cancel:
            flag.set()
        await asyncio.gather(task, return_exceptions=True)

    def _close_transient(self, fds: list[int]) -> None:
        """Close the descriptors among ``fds`` that were made for one reply (a readiness pipe's
        read end): sent or not, the daemon keeps no copy."""
        for fd in fds:
            if fd in self._transient_fds:
                self._transient_fds.discard(fd)
                os.close(fd)

    async def _trusted(self, manifest: Manifest) -> Manifest:
        """``manifest`` checked against the model store (see :mod:`gpu_pool.store.trust`), with its
        files resolved. A repeat of a manifest that passed costs a few ``stat`` calls on the
        event loop; anything that may read a store entry runs in a worker thread."""
        trusted = self._trust.cached(manifest)
        if trusted is None:
            trusted = await asyncio.to_thread(self._trust.check, manifest)
        return trusted

    # ----- handlers (one per typed request; see gpu_pool.wire.messages) -------------------------------

    async def _dispatch(self, session: Session, request: messages.Request) -> Reply:
        handler: Callable[[Session, Any], Awaitable[Reply]] = getattr(self, f"_on_{request.op}")
        return await handler(session, request)

    async def _on_hello(self, session: Session, request: messages.Hello) -> Reply:
        self._access.authenticate(session, request.admin_token, request.ticket)
        reply = {
            "session_id": session.session_id,
            "device": self.arena.device,
            "arena": self.arena.handle(),
            "alignment": self.store.config.alignment,
            "protocol": PROTOCOL_VERSION,
            "features": list(FEATURES),
            "admin": session.admin,
            "kv_quota_bytes": session.kv_quota,
        }
        fd = self.arena.share_fd()
        return reply, [] if fd is None else [fd]

    async def _on_stats(self, session: Session, request: messages.Stats) -> Reply:
        async with self._lock:
            return {"stats": self.store.stats()}, []

    async def _on_acquire(self, session: Session, request: messages.Acquire) -> Reply:
        await self._finish_progressive(session.session_id, cancel=False)  # one load per session
        if request.manifest_bin is not None:
            parsed = self._manifests.get(request.manifest_bin)
        else:
            parsed = Manifest.from_dict(request.manifest)
        trusted = await self._trusted(parsed)
        if request.progressive:
            progressive = await self._acquire_progressive(session, trusted, request)
            session.acquired = parsed
            return progressive
        result = await self._acquire(session.session_id, trusted, request.access)
        session.acquired = parsed
        reply: dict[str, Any] = {"placements": result.placements, "report": result.to_wire()}
        if request.kv is None:
            return reply, []
        try:  # the weights are pinned either way; the blocks are the session's if granted
            reply["kv"], fds = await self._on_kv_alloc(session, request.kv)
        except PoolError as exc:  # no room, quota, ...: the caller allocates later, on demand
            reply["kv_error"] = {"type": exc.code, "message": str(exc)}
            return reply, []
        return reply, fds

    async def _on_reacquire(self, session: Session, request: messages.Reacquire) -> Reply:
        parsed = session.acquired
        if parsed is None or parsed.model_id != request.model_id:
            raise SessionError(f"reacquire: this session's last acquire was not of {request.model_id!r}")
        # Checked again like any acquire (a few stat calls): a model removed from the store or
        # replaced there is refused, resident or not.
        trusted = await self._trusted(parsed)
        await self._finish_progressive(session.session_id, cancel=False)
        async with self._lock:
            repinned = self.store.reacquire(session.session_id, trusted)
        if repinned is not None:
            return {"unchanged": True, "report": repinned.to_wire()}, []
        # Evicted, moved or reloaded since, or acquired since the release: the usual way.
        result = await self._acquire(session.session_id, trusted)
        return {"placements": result.placements, "report": result.to_wire()}, []

    async def _on_release(self, session: Session, request: messages.Release) -> Reply:
        await self._finish_progressive(session.session_id, cancel=True)
        async with self._lock:
            blocks = [] if request.keep_kv else self._kv_ranges(self.store.sessions[session.session_id].kv)
            self.store.release(session.session_id, request.keep_kv)
            self._punch(session, blocks)
        return {}, []

    async def _on_kv_map(self, session: Session, request: messages.KVMap) -> Reply:
        return {"private_kv": self._private_kv}, self._kv_fds(session)

    async def _on_kv_alloc(self, session: Session, request: messages.KVAlloc) -> Reply:
        size = align_up(request.block_bytes, self.store.config.alignment)
        needed = request.num_blocks * size
        if needed > messages.MAX_COUNT:
            raise InvalidArgument(
                f"kv_alloc: {request.num_blocks} blocks of {request.block_bytes} bytes overflow a byte count",
                "num_blocks",
            )
        if needed > self.arena.capacity:
            raise OutOfMemory("kv_alloc", needed, self.arena.capacity)
        async with self._lock:
            used = sum(b.size for b in self._kv_ranges(self.store.sessions[session.session_id].kv))
            self._access.check_kv_quota(session, used, needed)
            fds = self._kv_fds(session)  # before allocating: a failure here leaks no blocks
            alloc = self.store.kv_alloc(session.session_id, request.num_blocks, size, request.aligned)
            granted: dict[str, Any] = {
                "block_ids": list(alloc.block_ids),
                "offsets": list(alloc.offsets),
                "block_bytes": alloc.block_bytes,
                "bytes_evicted": alloc.bytes_evicted,
            }
            if request.prefix is not None:
                granted["prefix_hashes"] = await self._fill_prefix(
                    session, granted["block_ids"], request.prefix
                )
        return granted, fds

    async def _on_kv_free(self, session: Session, request: messages.KVFree) -> Reply:
        async with self._lock:
            owned = self.store.sessions[session.session_id].kv
            blocks = self._kv_ranges(b for b in request.block_ids if b in owned)
            freed = self.store.kv_free(session.session_id, request.block_ids)
            self._punch(session, blocks)
        return {"freed": freed}, []

    async def _on_evict(self, session: Session, request: messages.Evict) -> Reply:
        self._access.require_admin(session, "evict")
        async with self._lock:
            return {"bytes_evicted": self.store.evict(request.model_id)}, []

    async def _on_grant(self, session: Session, request: messages.Grant) -> Reply:
        return {"ticket": self._access.grant(session, request.kv_quota_bytes, request.prefix_scope)}, []

    # ----- prefix KV shared across instances (gpu_pool.server.prefix_kv) ------------------------------

    async def _on_kv_publish(self, session: Session, request: messages.KVPublish) -> Reply:
        self._access.require_prefix_scope(session, "kv_publish")
        async with self._lock:  # held over the copies: nothing may move or evict those regions
            state = self.store.sessions[session.session_id]
            copies, touched = self.store.prefix.publish(
                state, session.prefix_scope, request.model_id, request.layout,
                list(request.hashes), list(request.block_ids), request.recompute_s,
            )  # fmt: skip
            try:
                await self._kv_copier.copy(session.kv, copies, True)
            except BaseException:
                self.store.prefix.forget([c.key for c in copies])  # no block with half its bytes
                raise
        return {"published": len(copies), "touched": touched}, []

    async def _on_kv_restore(self, session: Session, request: messages.KVRestore) -> Reply:
        self._access.require_prefix_scope(session, "kv_restore")
        async with self._lock:
            state = self.store.sessions[session.session_id]
            copies = self.store.prefix.restore(
                state, session.prefix_scope, request.model_id, request.layout,
                list(request.hashes), list(request.block_ids),
            )  # fmt: skip
            if request.first:  # a checked caller (restore raised otherwise)
                self.store.prefix.remember(
                    session.prefix_scope, request.model_id, request.layout, list(request.hashes)
                )
            await self._kv_copier.copy(session.kv, copies, False)
        return {"restored": len(copies)}, []

    async def _fill_prefix(
        self, session: Session, block_ids: list[int], prefix: messages.PrefixPrefetch
    ) -> list[bytes]:
        """Fill the first of the session's new ``block_ids`` with its scope's most recent prefix
        (``messages.KVAlloc``); the hashes of those filled. Under the lock, over the copies (as
        kv_restore: nothing may move those regions). An offer: nothing without a scope, a
        published prefix of a model the session acquired, or when the copy fails (the blocks
        are granted still, unfilled)."""
        try:
            self._access.require_prefix_scope(session, "kv_alloc")
        except PoolError:
            return []
        index, scope = self.store.prefix, session.prefix_scope
        hashes = index.recent(scope, prefix.model_id, prefix.layout, min(prefix.max_blocks, len(block_ids)))
        if not hashes:
            return []
        state = self.store.sessions[session.session_id]
        try:  # (Forbidden: a model this session has not acquired)
            copies = index.restore(
                state, scope, prefix.model_id, prefix.layout, list(hashes), block_ids[: len(hashes)]
            )
            await self._kv_copier.copy(session.kv, copies, False)
        except (PoolError, OSError) as exc:
            log.warning("kv_alloc: no prefix KV in the blocks: %s", exc)
            return []
        return list(hashes[: len(copies)])

    # ----- per-session KV pages (gpu_pool.arena.kv_memory) ----------------------------------------------

    def _kv_fds(self, session: Session) -> list[int]:
        """The session's KV descriptor if the client does not have it yet (created on first use)."""
        if not self._private_kv:
            return []
        if session.kv is None:
            session.kv = SessionKV(session.session_id, self.arena.capacity)
        return [] if session.kv_sent else [session.kv.fd]

    def _kv_ranges(self, block_ids: Iterable[int]) -> list[KVBlock]:
        return [self.store.kv_blocks[b] for b in block_ids if b in self.store.kv_blocks]

    @staticmethod
    def _punch(session: Session, blocks: list[KVBlock]) -> None:
        """Give freed blocks' pages back (their accounting already left the region list)."""
        if session.kv is not None:
            for block in blocks:
                session.kv.punch(block.offset, block.size)


def _socket_is_live(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def run(config: PoolConfig) -> int:
    """Run a daemon until SIGTERM/SIGINT; the ``ember pool`` entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    make_undumpable()
    os.environ.pop("EMBER_POOL_ADMIN_TOKEN", None)  # nothing we start should inherit it
    try:
        daemon = PoolDaemon(config)
    except PoolError as exc:
        print(f"ember pool: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(daemon.serve_forever())
    except PoolError as exc:
        print(f"ember pool: {exc}", file=sys.stderr)
        return 2
    return 0
