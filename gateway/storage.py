"""A full disk on the gateway's write paths: the server's storage is exhausted, not the client's
request at fault.

Deploys write under ``EMBER_HOME``: the model store (a registration writes the model's canonical
files, hundreds of MB) and uploaded handler modules. When the file system is full (``ENOSPC``)
or the uid's quota is spent (``EDQUOT``) the deploy is answered 507 with ``Retry-After``
(:mod:`gateway.errors`), and nothing half-written stays behind: both writers stage into a
temporary directory and rename it into place. Redis refusing writes for the same reason
(``MISCONF``) is :class:`scheduler.errors.StateNotWritable`, a 503.
"""

from __future__ import annotations

import errno

STORAGE_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
RETRY_AFTER_S = 30  # seconds: a full disk frees up when an operator acts, not within a second


class StorageFull(Exception):
    """No space (or quota) left to write what a deploy needs (HTTP 507)."""

    code = "insufficient_storage"
    retry_after_s = RETRY_AFTER_S


def storage_full(exc: BaseException, what: str) -> StorageFull | None:
    """A :class:`StorageFull` naming ``what`` could not be written when ``exc``, or an error it
    was raised from or while handling (a registration error that wraps its ``OSError``), is a
    full disk or a spent quota; else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in STORAGE_FULL_ERRNOS:
            return StorageFull(f"no space left on the server to store {what}: {cause.strerror}")
        cause = cause.__cause__ or cause.__context__
    return None
