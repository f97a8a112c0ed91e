"""Typed pool requests: one frozen dataclass per op, decoded and validated once.

The wire format is unchanged (protocol version 1, same field names): a request is a msgpack
map, :func:`gpu_pool.wire.protocol.decode_request` checks ``v`` and ``op``, and :func:`parse`
turns the map into the op's message class, checking every field's type and range. Integers
from the wire may be anything msgpack carries (up to ``2**64 - 1``, or negative): each has
explicit bounds, so no handler ever sees a value whose arithmetic could overflow a reply.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

from gpu_pool.errors import InvalidArgument, ProtocolError, UnknownOp

MAX_TOKEN_CHARS = 256  # admin tokens and tickets
MAX_MODEL_ID_CHARS = 1024
MAX_BLOCK_IDS = 1 << 20  # per kv_free
MAX_COUNT = (1 << 63) - 1  # any byte count or id: fits an int64 on every side
MAX_PREFIX_BLOCKS = 4096  # per kv_publish / kv_restore: 64k tokens of 16-token blocks
MAX_LAYOUT_CHARS = 256
PREFIX_HASH_BYTES = 16  # the engine's block hash (blake2b-128)
MAX_RECOMPUTE_S = 3600.0  # a publisher's stated recompute time per block
# Readiness groups of a progressive acquire: one byte each on a pipe whose buffer (64 KiB on
# Linux) must hold them all, so the daemon's writes never block on a client that does not read.
MAX_READY_GROUPS = 4096
READINESS_VERSION = 1  # the progressive acquire reply's ``readiness`` map


def _int(msg: dict[str, Any], op: str, name: str, lo: int, hi: int) -> int:
    value = msg.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{op} needs '{name}': an integer")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{op}: '{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _opt_str(msg: dict[str, Any], op: str, name: str, max_chars: int) -> str | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{op}: '{name}' must be a string or absent")
    if not 0 < len(value) <= max_chars:
        raise InvalidArgument(f"{op}: '{name}' must have 1 to {max_chars} characters", name)
    return value


class Request:
    """Base of the typed requests; ``op`` is the wire name."""

    op: ClassVar[str]

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Request:
        """The message of this op from a decoded request map (raises ProtocolError)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Hello(Request):
    """Open the session: optional admin token or KV ticket."""

    op: ClassVar[str] = "hello"
    pid: int | None
    admin_token: str | None
    ticket: str | None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Hello:
        pid = _int(msg, cls.op, "pid", 0, (1 << 31) - 1) if msg.get("pid") is not None else None
        token = _opt_str(msg, cls.op, "admin_token", MAX_TOKEN_CHARS)
        ticket = _opt_str(msg, cls.op, "ticket", MAX_TOKEN_CHARS)
        return cls(pid, token, ticket)


@dataclass(frozen=True, slots=True)
class Acquire(Request):
    """Pin a manifest's tensors (``manifest_bin``: its msgpack encoding; or ``manifest``);
    ``access`` false: not a request for the model (not counted in its rate or reuse counters).

    ``progressive`` (TIDAL §5.2): reply once the tensors are placed and pinned, before their
    bytes are in, with a readiness pipe; ``groups`` are the ends (exclusive, strictly
    increasing, the last one the manifest's tensor count) of the groups of manifest tensors,
    in manifest (access) order, whose readiness the pipe reports one byte each.

    ``kv`` (``num_blocks``, ``block_bytes``, ``aligned`` as :class:`KVAlloc` has them): once the
    tensors are pinned, a ``kv_alloc`` for the session in the same request, answered in the
    same reply (``kv``, or ``kv_error`` when only the blocks could not be had): a new instance's
    weights and first KV blocks in one round trip. Nothing is allocated when the acquire fails.
    Not with ``progressive``."""

    op: ClassVar[str] = "acquire"
    manifest_bin: bytes | None
    manifest: Any
    access: bool = True  # False: not a request for the model (a standby's preparation)
    progressive: bool = False
    groups: tuple[int, ...] = ()
    kv: KVAlloc | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Acquire:
        encoded = msg.get("manifest_bin")
        if encoded is not None and not isinstance(encoded, bytes):
            raise ProtocolError("acquire: 'manifest_bin' must be msgpack bytes")
        access = msg.get("access", True)
        if not isinstance(access, bool):
            raise ProtocolError("acquire: 'access' must be a boolean")
        progressive = msg.get("progressive", False)
        if not isinstance(progressive, bool):
            raise ProtocolError("acquire: 'progressive' must be a boolean")
        raw_groups = msg.get("groups", [])
        if not isinstance(raw_groups, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in raw_groups
        ):
            raise ProtocolError("acquire: 'groups' must be a list of integers")
        if len(raw_groups) > MAX_READY_GROUPS:
            raise InvalidArgument(f"acquire: at most {MAX_READY_GROUPS} groups", "groups")
        if raw_groups and not progressive:
            raise InvalidArgument("acquire: 'groups' needs 'progressive'", "groups")
        if any(not 0 < g <= MAX_COUNT for g in raw_groups) or any(
            a >= b for a, b in itertools.pairwise(raw_groups)
        ):
            raise InvalidArgument("acquire: 'groups' must be strictly increasing positive ends", "groups")
        raw_kv = msg.get("kv")
        if raw_kv is not None and not isinstance(raw_kv, dict):
            raise ProtocolError("acquire: 'kv' must be a map")
        if raw_kv is not None and progressive:
            raise InvalidArgument("acquire: 'kv' cannot come with 'progressive'", "kv")
        kv = None if raw_kv is None else KVAlloc.parse(raw_kv)
        return cls(encoded, msg.get("manifest"), access, progressive, tuple(raw_groups), kv)


@dataclass(frozen=True, slots=True)
class PrefixPrefetch:
    """The prefix KV a ``kv_alloc``'s blocks come filled with: ``model_id``'s in ``layout``, at
    most ``max_blocks`` blocks of it."""

    model_id: str
    layout: str
    max_blocks: int

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> PrefixPrefetch:
        model_id = _opt_str(msg, "kv_alloc", "model_id", MAX_MODEL_ID_CHARS)
        layout = _opt_str(msg, "kv_alloc", "layout", MAX_LAYOUT_CHARS)
        if model_id is None or layout is None:
            raise ProtocolError("kv_alloc: 'prefix' needs 'model_id' and 'layout': strings")
        if "/" in layout:
            raise InvalidArgument("kv_alloc: 'layout' must not contain '/'", "layout")
        return cls(model_id, layout, _int(msg, "kv_alloc", "max_blocks", 1, MAX_PREFIX_BLOCKS))


@dataclass(frozen=True, slots=True)
class KVAlloc(Request):
    """Allocate ``num_blocks`` blocks of ``block_bytes`` (bounded by the arena by the daemon).

    ``prefix`` (:class:`PrefixPrefetch`) fills the first blocks with the published prefix KV the
    session's scope most recently asked for from a first block (:class:`KVRestore`): the
    reply's ``prefix_hashes`` are their hashes, one per block from the first. A new instance's
    first request then finds its prompt's prefix without a ``kv_restore`` round trip."""

    op: ClassVar[str] = "kv_alloc"
    num_blocks: int
    block_bytes: int
    aligned: bool
    prefix: PrefixPrefetch | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> KVAlloc:
        num_blocks = _int(msg, cls.op, "num_blocks", 1, MAX_COUNT)
        block_bytes = _int(msg, cls.op, "block_bytes", 1, MAX_COUNT)
        aligned = msg.get("aligned", False)
        if not isinstance(aligned, bool):
            raise ProtocolError("kv_alloc: 'aligned' must be a boolean")
        raw_prefix = msg.get("prefix")
        if raw_prefix is not None and not isinstance(raw_prefix, dict):
            raise ProtocolError("kv_alloc: 'prefix' must be a map")
        prefix = None if raw_prefix is None else PrefixPrefetch.parse(raw_prefix)
        return cls(num_blocks, block_bytes, aligned, prefix)


@dataclass(frozen=True, slots=True)
class KVFree(Request):
    """Free the session's blocks ``block_ids``."""

    op: ClassVar[str] = "kv_free"
    block_ids: tuple[int, ...]

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> KVFree:
        return cls(_block_ids(msg, cls.op, MAX_BLOCK_IDS))


def _block_ids(msg: dict[str, Any], op: str, limit: int) -> tuple[int, ...]:
    ids = msg.get("block_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ProtocolError(f"{op} needs 'block_ids': a list of integers")
    if len(ids) > limit:
        raise InvalidArgument(f"{op}: at most {limit} block ids per request", "block_ids")
    if any(not 0 <= i <= MAX_COUNT for i in ids):
        raise InvalidArgument(f"{op}: block ids are between 0 and {MAX_COUNT}", "block_ids")
    return tuple(ids)


def _prefix_fields(msg: dict[str, Any], op: str) -> tuple[str, str, tuple[bytes, ...], tuple[int, ...]]:
    """``model_id``, ``layout``, ``hashes`` and as many ``block_ids`` of a prefix op."""
    model_id = _opt_str(msg, op, "model_id", MAX_MODEL_ID_CHARS)
    layout = _opt_str(msg, op, "layout", MAX_LAYOUT_CHARS)
    if model_id is None or layout is None:
        raise ProtocolError(f"{op} needs 'model_id' and 'layout': strings")
    if "/" in layout:
        raise InvalidArgument(f"{op}: 'layout' must not contain '/'", "layout")
    hashes = msg.get("hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, bytes) for h in hashes):
        raise ProtocolError(f"{op} needs 'hashes': a list of byte strings")
    if any(len(h) != PREFIX_HASH_BYTES for h in hashes):
        raise InvalidArgument(f"{op}: every hash has {PREFIX_HASH_BYTES} bytes", "hashes")
    ids = _block_ids(msg, op, MAX_PREFIX_BLOCKS)
    if len(hashes) != len(ids):
        raise InvalidArgument(
            f"{op}: one block id per hash ({len(hashes)} hashes, {len(ids)} ids)", "block_ids"
        )
    return model_id, layout, tuple(hashes), ids


@dataclass(frozen=True, slots=True)
class KVPublish(Request):
    """Copy the session's blocks ``block_ids`` (full prompt blocks whose chained hashes are
    ``hashes``) into the arena as published prefix KV of ``model_id`` in ``layout``."""

    op: ClassVar[str] = "kv_publish"
    model_id: str
    layout: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    recompute_s: float  # stated seconds to recompute one block (its eviction cost, capped)

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> KVPublish:
        model_id, layout, hashes, ids = _prefix_fields(msg, cls.op)
        cost = msg.get("recompute_s", 0.0)
        if not isinstance(cost, (int, float)) or isinstance(cost, bool):
            raise ProtocolError("kv_publish: 'recompute_s' must be a number")
        if not 0.0 <= cost <= MAX_RECOMPUTE_S:  # NaN fails too
            raise InvalidArgument(
                f"kv_publish: 'recompute_s' must be in [0, {MAX_RECOMPUTE_S}]", "recompute_s"
            )
        return cls(model_id, layout, hashes, ids, float(cost))


@dataclass(frozen=True, slots=True)
class KVRestore(Request):
    """Copy the longest published run of ``hashes`` (from the first) into ``block_ids``.
    ``first``: the hashes are a prompt's from its first block on; the pool remembers them as
    the scope's most recent prefix (what :class:`PrefixPrefetch` fills a new instance with)."""

    op: ClassVar[str] = "kv_restore"
    model_id: str
    layout: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first: bool = False

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> KVRestore:
        first = msg.get("first", False)
        if not isinstance(first, bool):
            raise ProtocolError("kv_restore: 'first' must be a boolean")
        return cls(*_prefix_fields(msg, cls.op), first)


@dataclass(frozen=True, slots=True)
class Evict(Request):
    """Admin: evict inactive tensors of ``model_id`` (or all)."""

    op: ClassVar[str] = "evict"
    model_id: str | None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Evict:
        return cls(_opt_str(msg, cls.op, "model_id", MAX_MODEL_ID_CHARS))


@dataclass(frozen=True, slots=True)
class Grant(Request):
    """Admin: a single-use ticket giving the session that presents it ``kv_quota_bytes`` and,
    optionally, the scope its published prefix KV is shared in (default: the pool-wide one)."""

    op: ClassVar[str] = "grant"
    kv_quota_bytes: int
    prefix_scope: str | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Grant:
        scope = _opt_str(msg, cls.op, "prefix_scope", MAX_MODEL_ID_CHARS)
        return cls(_int(msg, cls.op, "kv_quota_bytes", 0, MAX_COUNT), scope)


@dataclass(frozen=True, slots=True)
class _NoFields(Request):
    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Request:
        return cls()


@dataclass(frozen=True, slots=True)
class Release(Request):
    """Unpin everything and free the session's KV blocks (``keep_kv``: all but those: a standby
    holds its first blocks through the wait, see ``runtime.assignment``)."""

    op: ClassVar[str] = "release"
    keep_kv: bool = False

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Release:
        keep_kv = msg.get("keep_kv", False)
        if not isinstance(keep_kv, bool):
            raise ProtocolError("release: 'keep_kv' must be a boolean")
        return cls(keep_kv)


@dataclass(frozen=True, slots=True)
class Reacquire(Request):
    """Acquire again the manifest of the session's last acquire, which was of ``model_id``,
    after its release, without sending it (a standby's activation, ``gpu_pool.server.repin``):
    the reply says ``unchanged`` when every tensor is still where that acquire placed it, else
    it carries the ``placements``, as an acquire's does."""

    op: ClassVar[str] = "reacquire"
    model_id: str

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Reacquire:
        model_id = _opt_str(msg, cls.op, "model_id", MAX_MODEL_ID_CHARS)
        if model_id is None:
            raise ProtocolError("reacquire needs 'model_id': the model of the session's last acquire")
        return cls(model_id)


@dataclass(frozen=True, slots=True)
class Stats(_NoFields):
    """The pool's occupancy and counters."""

    op: ClassVar[str] = "stats"


@dataclass(frozen=True, slots=True)
class KVMap(_NoFields):
    """Send the session's KV memfd (created if needed) so the client can map it early."""

    op: ClassVar[str] = "kv_map"


MESSAGES: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        Hello,
        Acquire,
        Reacquire,
        Release,
        KVAlloc,
        KVFree,
        Stats,
        Evict,
        Grant,
        KVMap,
        KVPublish,
        KVRestore,
    )
}


def parse(msg: dict[str, Any]) -> Request:
    """The typed request of a decoded map whose ``op`` the protocol layer accepted."""
    cls = MESSAGES.get(msg.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise UnknownOp(f"unknown op {msg.get('op')!r}")
    return cls.parse(msg)
