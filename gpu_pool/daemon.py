"""The pool daemon: one per device, serving the pool protocol on a Unix socket.

Every connection is a session. Requests on one connection are answered in order; state
changes of all sessions are serialised by one asyncio lock (planning and bookkeeping take
microseconds to a millisecond). Byte copies of an acquire run in a worker thread *outside*
the lock, into regions reserved and pinned while it was held, so a slow load stalls no
other session and the event loop keeps accepting connections and noticing disconnects.
A connection that closes, for whatever reason including SIGKILL of its process, releases
its session's pins and KV blocks.
Malformed messages get a typed error reply; an oversized frame gets a reply and the
connection is closed (its framing can no longer be trusted); the daemon keeps serving.

Manifests are not taken on trust (:mod:`gpu_pool.trust`): before an acquire pins or loads
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
from collections import OrderedDict
from typing import Any

import xxhash

from gpu_pool.arena import BaseArena
from gpu_pool.config import PoolConfig
from gpu_pool.errors import ConfigError, LoadError, MessageTooLarge, PoolError, ProtocolError
from gpu_pool.manifest import Manifest
from gpu_pool.protocol import PROTOCOL_VERSION, decode_reply, decode_request, encode, error_reply, read_frame
from gpu_pool.reuse_store import AcquireResult, ReuseStore, StoreConfig
from gpu_pool.trust import StoreTrust

log = logging.getLogger("ember.pool")


def make_arena(config: PoolConfig) -> BaseArena:
    """The arena backend for ``config.device``."""
    if config.device == "cpu":
        from gpu_pool.arena_cpu import CpuArena

        return CpuArena(
            config.aligned_arena_bytes,
            shm_dir=config.shm_dir,
            prefault=config.prefault,
            num_threads=config.load_threads,
        )
    from gpu_pool.arena_cuda import CudaArena

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
        self.store = ReuseStore(self.arena, StoreConfig(eviction=config.eviction, packing=config.packing))
        self._lock = asyncio.Lock()
        self._loading: dict[str, asyncio.Future[bool]] = {}  # tensor key -> its load's outcome
        self._session_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._manifests = ManifestCache()
        self._trust = StoreTrust(config.store_roots)
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

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
        session_id = f"s{next(self._session_ids)}-{os.getpid()}"
        self.store.open_session(session_id)
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
                try:
                    request = decode_request(body)
                    request_id = request.get("id")
                    reply = await self._dispatch(session_id, request)
                    reply.update(v=PROTOCOL_VERSION, id=request_id, ok=True)
                except PoolError as exc:
                    reply = error_reply(exc, request_id)
                except Exception as exc:  # a bug: answer it, log it, keep serving
                    log.exception("internal error serving %s", session_id)
                    reply = error_reply(PoolError(f"internal error: {type(exc).__name__}: {exc}"), request_id)
                writer.write(encode(reply))
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the peer went away mid-reply; the session is released below
        finally:
            self._connections.pop(task, None)
            async with self._lock:
                self.store.close_session(session_id)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _acquire(self, session_id: str, manifest: Manifest) -> AcquireResult:
        """Plan under the lock, copy bytes without it, commit under it again.

        A slow load therefore stalls no other session. A session that needs a tensor another
        session is still loading waits for that load (and fails if it fails).
        """
        loop = asyncio.get_running_loop()
        async with self._lock:
            pending = self.store.begin_acquire(session_id, manifest)
            waits = [self._loading[k] for k in pending.waits_on]
            mine = {k: loop.create_future() for k in pending.missing}
            self._loading.update(mine)
        ok = False
        try:
            for other in waits:
                if not await asyncio.shield(other):
                    raise LoadError(
                        f"loading {manifest.model_id}: a concurrent load of a shared tensor failed"
                    )
            load_seconds = await asyncio.to_thread(self.store.load, pending)
            async with self._lock:
                result = self.store.complete_acquire(pending, load_seconds)
            ok = True
            return result
        finally:
            if not ok:
                async with self._lock:
                    self.store.abort_acquire(pending)
            for k, future in mine.items():
                self._loading.pop(k, None)
                future.set_result(ok)

    async def _trusted(self, manifest: Manifest) -> Manifest:
        """``manifest`` checked against the model store (see :mod:`gpu_pool.trust`), with its
        files resolved. A repeat of a manifest that passed costs a few ``stat`` calls on the
        event loop; anything that may read a store entry runs in a worker thread."""
        trusted = self._trust.cached(manifest)
        if trusted is None:
            trusted = await asyncio.to_thread(self._trust.check, manifest)
        return trusted

    def _manifest(self, request: dict[str, Any]) -> Manifest:
        encoded = request.get("manifest_bin")
        if encoded is not None:
            if not isinstance(encoded, bytes):
                raise ProtocolError("acquire: 'manifest_bin' must be msgpack bytes")
            return self._manifests.get(encoded)
        return Manifest.from_dict(request.get("manifest"))

    async def _dispatch(self, session_id: str, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "hello":
            return {
                "session_id": session_id,
                "device": self.arena.device,
                "arena": self.arena.handle(),
                "alignment": self.store.config.alignment,
                "protocol": PROTOCOL_VERSION,
            }
        if op == "stats":
            async with self._lock:
                return {"stats": self.store.stats()}
        if op == "acquire":
            manifest = await self._trusted(self._manifest(request))
            result = await self._acquire(session_id, manifest)
            return {
                "placements": result.placements,
                "bytes_loaded": result.bytes_loaded,
                "bytes_reused": result.bytes_reused,
                "bytes_moved": result.bytes_moved,
                "bytes_evicted": result.bytes_evicted,
                "load_seconds": result.load_seconds,
                "plan_seconds": result.plan_seconds,
            }
        if op == "release":
            async with self._lock:
                self.store.release(session_id)
            return {}
        if op == "kv_alloc":
            num_blocks = _int_field(request, "num_blocks")
            block_bytes = _int_field(request, "block_bytes")
            aligned = request.get("aligned", False)
            if not isinstance(aligned, bool):
                raise ProtocolError("kv_alloc: 'aligned' must be a boolean")
            async with self._lock:
                alloc = self.store.kv_alloc(session_id, num_blocks, block_bytes, aligned)
            return {
                "block_ids": list(alloc.block_ids),
                "offsets": list(alloc.offsets),
                "block_bytes": alloc.block_bytes,
                "bytes_evicted": alloc.bytes_evicted,
            }
        if op == "kv_free":
            ids = request.get("block_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ProtocolError("kv_free needs 'block_ids': a list of integers")
            async with self._lock:
                freed = self.store.kv_free(session_id, ids)
            return {"freed": freed}
        assert op == "evict", op
        model_id = request.get("model_id")
        if model_id is not None and not isinstance(model_id, str):
            raise ProtocolError("evict: 'model_id' must be a string or absent")
        async with self._lock:
            return {"bytes_evicted": self.store.evict(model_id)}


class ManifestCache:
    """Parsed manifests by the xxh3 of their encoding: a worker fleet sends the same few
    manifests over and over, and validating ~300 entries costs ~1 ms."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Manifest] = OrderedDict()

    def get(self, encoded: bytes) -> Manifest:
        key = xxhash.xxh3_128_hexdigest(encoded)
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        manifest = Manifest.from_dict(decode_reply(encoded))
        self._items[key] = manifest
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return manifest


def _int_field(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{request['op']} needs '{name}': an integer")
    return value


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
