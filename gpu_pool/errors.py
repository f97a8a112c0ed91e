"""Typed errors of the pool. Each has a stable ``code`` used as the wire error type."""

from __future__ import annotations

from typing import Any


class PoolError(Exception):
    """Base of every error the pool raises or replies with."""

    code = "pool_error"

    def details(self) -> dict[str, Any]:
        """Extra machine-readable fields sent with the error reply."""
        return {}


class ConfigError(PoolError, ValueError):
    """A configuration value or environment variable is invalid."""

    code = "config_error"


class ProtocolError(PoolError):
    """A message could not be understood (framing, encoding, schema)."""

    code = "protocol_error"


class MessageTooLarge(ProtocolError):
    """A frame announced more bytes than the daemon accepts."""

    code = "message_too_large"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit

    def details(self) -> dict[str, Any]:
        return {"size": self.size, "limit": self.limit}


class UnsupportedVersion(ProtocolError):
    """The message's protocol version is not one this daemon speaks."""

    code = "unsupported_version"


class UnknownOp(ProtocolError):
    """The message names an operation that does not exist."""

    code = "unknown_op"


class InvalidArgument(ProtocolError):
    """A request field has the right type but a value out of its range (negative, zero where
    a positive count is needed, absurdly large, or a product that overflows the arena)."""

    code = "invalid_argument"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def details(self) -> dict[str, Any]:
        return {"field": self.field}


class Forbidden(PoolError):
    """The session may not do this: an admin-only op without an admin session, or a wrong
    admin token or ticket in ``hello``."""

    code = "forbidden"


class KVQuotaExceeded(PoolError):
    """A ``kv_alloc`` would take the session's KV bytes past its quota."""

    code = "kv_quota_exceeded"

    def __init__(self, quota: int, used: int, requested: int) -> None:
        super().__init__(
            f"KV quota exceeded: the session holds {used} bytes of KV blocks, asks for {requested} "
            f"more, and may hold {quota} (a ticket from the pool's admin grants more)"
        )
        self.quota = quota
        self.used = used
        self.requested = requested

    def details(self) -> dict[str, Any]:
        return {"quota": self.quota, "used": self.used, "requested": self.requested}


class ManifestError(PoolError, ValueError):
    """A manifest or store entry is inconsistent (sizes, dtypes, missing files)."""

    code = "manifest_error"


class UntrustedManifest(ManifestError):
    """A manifest names bytes the daemon may not load: a file outside its trusted model store
    roots, or a tensor that differs from what the store entry holding it says (a field such
    as the fingerprint, offset or byte count), or the daemon has no store roots at all."""

    code = "untrusted_manifest"

    def __init__(self, message: str, tensor: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.field = field

    def details(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "field": self.field}


class OutOfMemory(PoolError):
    """The arena cannot hold a request even after evicting everything evictable."""

    code = "out_of_memory"

    def __init__(self, what: str, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(
            f"{what} needs {needed_bytes} bytes but only {available_bytes} bytes can be made "
            f"available (free plus evictable, inactive tensors)"
        )
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes

    def details(self) -> dict[str, Any]:
        return {"needed_bytes": self.needed_bytes, "available_bytes": self.available_bytes}


class SessionError(PoolError):
    """An operation referred to KV blocks or pins the session does not own."""

    code = "session_error"


class LoadError(PoolError):
    """Copying tensor bytes from the model store into the arena failed."""

    code = "load_error"


class NotResident(PoolError):
    """An acquire that may not load (``access`` false: a standby's preparation) named tensors
    that are not resident."""

    code = "not_resident"


class BackendUnavailable(PoolError):
    """The requested device backend cannot run here (for example no CUDA)."""

    code = "backend_unavailable"


ERRORS_BY_CODE: dict[str, type[PoolError]] = {
    cls.code: cls
    for cls in (
        PoolError,
        ConfigError,
        ProtocolError,
        MessageTooLarge,
        UnsupportedVersion,
        UnknownOp,
        InvalidArgument,
        Forbidden,
        KVQuotaExceeded,
        ManifestError,
        UntrustedManifest,
        OutOfMemory,
        SessionError,
        LoadError,
        NotResident,
        BackendUnavailable,
    )
}
