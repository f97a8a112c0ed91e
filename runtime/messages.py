"""The agent's messages to its workers (``/_ember/assign``, ``/_ember/standby``, ``/_ember/preload``,
``/_ember/threads``) and the worker's replies to an assign and a standby.

Each message is a frozen dataclass with ``to_json`` (what the sender sends) and ``from_json``
(what the receiver accepts). ``from_json`` checks the body's size, that it is a JSON object with
exactly the message's fields, their types and bounds, and raises :class:`MessageError` (a
``ValueError``: the worker answers 400, the agent fails the launch) for anything else. The spec
travels as the function's spec document (as stored by the scheduler); runtime does not import
the scheduler. The assign reply's acquire report is :class:`gpu_pool.acquire_report.AcquireReport`
in its own versioned encoding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from gpu_pool.acquire_report import AcquireReport
from gpu_pool.errors import PoolError

MAX_MESSAGE_BYTES = 1 << 20  # a spec document is a few KiB; anything near this is not a message
MAX_TEXT = 4096  # characters of a path, id or ticket
MAX_THREADS = 4096  # intra-op threads of one instance
MAX_QUOTA_BYTES = 1 << 50  # far above any device's memory
MAX_TIMINGS = 64  # named steps in an assign reply's timings
MAX_TIMING_NAME = 64  # characters of a step's name
MAX_ADAPTERS = 16  # LoRA adapters of one function (scheduler.spec.MAX_ADAPTERS)


class MessageError(ValueError):
    """A malformed agent-to-worker message (the worker answers 400)."""

    code = "invalid_message"


def _object(raw: bytes | str, fields: frozenset[str], required: frozenset[str]) -> dict[str, Any]:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message is larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MessageError(f"message is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MessageError("message must be a JSON object")
    unknown = sorted(set(data) - fields)
    missing = sorted(required - set(data))
    if unknown or missing:
        raise MessageError(f"message fields: unknown {unknown}, missing {missing}")
    return data


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise MessageError(f"{what} must be a non-empty string of at most {MAX_TEXT} characters")
    return value


def _check_function(
    spec: Any, model_dir: Any, pool_socket: Any, pool_ticket: Any, kv_quota_bytes: Any
) -> None:
    """The fields an assign and a standby share: the function, its model and its pool session."""
    q = kv_quota_bytes
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or not 0 <= q <= MAX_QUOTA_BYTES):
        raise MessageError("kv_quota_bytes must be null or a non-negative integer of bytes")
    _text(model_dir, "model_dir")
    _text(pool_socket, "pool_socket")
    if pool_ticket is not None:
        _text(pool_ticket, "pool_ticket")
    body = spec.get("spec") if isinstance(spec, dict) else None
    if not isinstance(body, dict) or not isinstance(spec.get("metadata"), dict):
        raise MessageError("spec must be a function spec document (metadata, spec)")
    _text(body.get("handler"), "spec.spec.handler")
    tokens = body.get("maxTokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise MessageError("spec.spec.maxTokens must be a positive integer")


def _encode(message: Any) -> str:
    """A message dataclass as JSON. Its fields hold JSON values already: no ``asdict``, whose
    deep copy of a spec document cost ~0.1 ms on the cold path's assign."""
    return json.dumps({f.name: getattr(message, f.name) for f in dataclass_fields(message)})


def _timings(timings: Any) -> None:
    if not isinstance(timings, dict) or len(timings) > MAX_TIMINGS:
        raise MessageError(f"timings_ms must be an object of at most {MAX_TIMINGS} steps")
    for name, ms in timings.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TIMING_NAME:
            raise MessageError(f"timings_ms: step names have 1 to {MAX_TIMING_NAME} characters")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not (math.isfinite(ms) and ms >= 0):
            raise MessageError(f"timings_ms: {name!r} must be a finite, non-negative number")


class _FunctionMessage:
    """What an assign and a standby read of the function's spec document."""

    __slots__ = ()
    spec: dict[str, Any]

    @property
    def handler(self) -> str:
        """The function's handler: ``default`` or ``module.py:function``."""
        return str(self.spec["spec"]["handler"])

    @property
    def max_tokens(self) -> int:
        """The function's ``maxTokens`` (tokens per request)."""
        return int(self.spec["spec"]["maxTokens"])


@dataclass(frozen=True, slots=True)
class AssignMessage(_FunctionMessage):
    """``/_ember/assign``: become instance ``instance_id`` of the function ``spec``."""

    instance_id: str
    spec: dict[str, Any]  # the function's spec document (apiVersion, kind, metadata, spec)
    model_dir: str  # the model's directory in the model store
    pool_socket: str  # the device's pool daemon
    pool_ticket: str | None  # single-use pool ticket carrying the instance's KV quota
    deadline: float  # epoch seconds: the handler's initializer must finish by then
    # Intra-op threads the instance starts with (the agent's share of a CPU device's cores,
    # runtime.cpu_share); None: keep the worker's. Told here, the first request already runs
    # with them instead of waiting for a /_ember/threads call after the start.
    num_threads: int | None = None
    # The KV bytes the pool ticket lets the instance hold (None: no ticket, no quota): the
    # worker refuses a request whose choices together could never fit in it.
    kv_quota_bytes: int | None = None
    # The agent schedules the device token by token (runtime.mesh): step only with its grants.
    token_scheduling: bool = False
    # The function's LoRA adapters (spec.model.adapters), registered: name -> adapter directory.
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _text(self.instance_id, "instance_id")
        if not isinstance(self.token_scheduling, bool):
            raise MessageError("token_scheduling must be a boolean")
        if not isinstance(self.adapters, dict) or len(self.adapters) > MAX_ADAPTERS:
            raise MessageError(f"adapters must be an object of at most {MAX_ADAPTERS} name -> directory")
        for name, directory in self.adapters.items():
            _text(name, "an adapter's name")
            _text(directory, "an adapter's directory")
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS):
            raise MessageError(f"num_threads must be null or a positive integer (at most {MAX_THREADS})")
        _check_function(self.spec, self.model_dir, self.pool_socket, self.pool_ticket, self.kv_quota_bytes)
        if isinstance(self.deadline, bool) or not isinstance(self.deadline, int | float):
            raise MessageError("deadline must be a number of epoch seconds")
        if not math.isfinite(self.deadline) or self.deadline <= 0:
            raise MessageError("deadline must be a finite, positive number of epoch seconds")

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> AssignMessage:
        """The message in ``raw``; :class:`MessageError` if it is not one."""
        fields = frozenset(cls.__dataclass_fields__)
        data = _object(
            raw, fields, fields - {"num_threads", "kv_quota_bytes", "token_scheduling", "adapters"}
        )
        return cls(**data)


@dataclass(frozen=True, slots=True)
class StandbyMessage(_FunctionMessage):
    """``/_ember/standby``: prepare to become an instance of ``spec`` (everything an assign
    does that needs no instance: :mod:`runtime.assignment`). The assign that activates the
    standby must carry the same function, model, pool, ticket and quota."""

    spec: dict[str, Any]
    model_dir: str
    pool_socket: str
    pool_ticket: str | None  # the standby's pool session redeems it (the instance's KV quota)
    kv_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_function(self.spec, self.model_dir, self.pool_socket, self.pool_ticket, self.kv_quota_bytes)

    def activated_by(self, message: AssignMessage) -> bool:
        """Whether ``message`` assigns the function this standby prepared (same spec, model,
        pool session and quota)."""
        return (
            message.spec == self.spec
            and message.model_dir == self.model_dir
            and message.pool_socket == self.pool_socket
            and message.pool_ticket == self.pool_ticket
            and message.kv_quota_bytes == self.kv_quota_bytes
        )

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> StandbyMessage:
        """The message in ``raw``; :class:`MessageError` if it is not one."""
        fields = frozenset(cls.__dataclass_fields__)
        return cls(**_object(raw, fields, fields - {"kv_quota_bytes"}))


@dataclass(frozen=True, slots=True)
class StandbyReply:
    """The worker's answer to ``/_ember/standby``: prepared, its steps took ``timings_ms``."""

    timings_ms: dict[str, float]  # step name -> milliseconds

    def __post_init__(self) -> None:
        _timings(self.timings_ms)

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> StandbyReply:
        """The reply in ``raw``; :class:`MessageError` if it is not one."""
        return cls(**_object(raw, frozenset({"timings_ms"}), frozenset({"timings_ms"})))


@dataclass(frozen=True, slots=True)
class PreloadMessage:
    """``/_ember/preload``: load ``model_dir``'s template now (idle workers, before any assign)."""

    model_dir: str

    def __post_init__(self) -> None:
        _text(self.model_dir, "model_dir")

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PreloadMessage:
        """The message in ``raw``; :class:`MessageError` if it is not one."""
        return cls(**_object(raw, frozenset({"model_dir"}), frozenset({"model_dir"})))


@dataclass(frozen=True, slots=True)
class ThreadsMessage:
    """``/_ember/threads``: use ``num_threads`` intra-op threads (the agent shares a CPU's cores)."""

    num_threads: int

    def __post_init__(self) -> None:
        n = self.num_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
            raise MessageError(f"num_threads must be a positive integer (at most {MAX_THREADS})")

    def to_json(self) -> str:
        return _encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ThreadsMessage:
        """The message in ``raw``; :class:`MessageError` if it is not one."""
        return cls(**_object(raw, frozenset({"num_threads"}), frozenset({"num_threads"})))


@dataclass(frozen=True, slots=True)
class AssignReply:
    """The worker's answer to ``/_ember/assign``: it is instance ``instance_id`` now, its
    start's steps took ``timings_ms``, and the pool's acquire of its weights cost ``acquire``."""

    instance_id: str
    timings_ms: dict[str, float]  # step name -> milliseconds
    acquire: AcquireReport

    def __post_init__(self) -> None:
        _text(self.instance_id, "instance_id")
        _timings(self.timings_ms)
        if not isinstance(self.acquire, AcquireReport):
            raise MessageError("acquire must be an acquire report")

    def to_json(self) -> str:
        acquire = self.acquire.to_wire()
        return json.dumps(
            {"instance_id": self.instance_id, "timings_ms": self.timings_ms, "acquire": acquire}
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> AssignReply:
        """The reply in ``raw``; :class:`MessageError` if it is not one."""
        fields = frozenset(cls.__dataclass_fields__)
        data = _object(raw, fields, fields)
        try:
            acquire = AcquireReport.from_wire(data["acquire"])
        except PoolError as exc:
            raise MessageError(f"acquire: {exc}") from None
        return cls(data["instance_id"], data["timings_ms"], acquire)
