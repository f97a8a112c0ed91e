"""The client side of a progressive acquire (TIDAL §5.2): which tensors' bytes are in.

:meth:`gpu_pool.client.PoolClient.acquire_progressive` returns placements at once and a
:class:`Readiness` over the pipe the daemon writes one byte per finished group of tensors to
(groups in manifest order, :mod:`gpu_pool.server.progressive`). :meth:`Readiness.wait` blocks
until the group holding a tensor index is in; a failure byte, or the pipe closing before every
group is in, raises :class:`~gpu_pool.errors.LoadError` (and does so again on every later
wait). Once everything is in the descriptor is closed and a check is one attribute read.
Thread-safe: an engine thread may wait while another thread polls.
"""

from __future__ import annotations

import bisect
import itertools
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import Any

from gpu_pool.errors import LoadError, ProtocolError, UnsupportedVersion
from gpu_pool.wire.messages import MAX_READY_GROUPS, READINESS_VERSION

__all__ = ["FAILED", "MAX_READY_GROUPS", "READY", "Readiness"]

READY = b"R"  # gpu_pool.server.progressive writes these
FAILED = b"E"


class Readiness:
    """Readiness of the groups of one progressive acquire's tensors."""

    def __init__(self, fd: int, ends: Sequence[int], model_id: str = "") -> None:
        """``fd``: the pipe's read end (owned: closed once done, failed or :meth:`close`);
        ``ends``: the groups' ends in manifest tensor indices."""
        self._fd: int | None = fd
        self.ends = tuple(ends)
        self.model_id = model_id
        self._ready = 0  # groups in
        self._error: str | None = None
        self._lock = threading.Lock()
        self.done = not self.ends  # True once every group is in (a plain attribute: free to read)
        self.started = time.perf_counter()
        self.finished: float | None = None  # perf_counter() when the last group came in

    @classmethod
    def from_wire(cls, info: Any, fd: int, tensors: int, model_id: str = "") -> Readiness:
        """The reply's ``readiness`` map checked (version, group ends) against a manifest of
        ``tensors`` tensors; closes ``fd`` when it refuses it."""
        try:
            if not isinstance(info, dict) or info.get("v") != READINESS_VERSION:
                version = info.get("v") if isinstance(info, dict) else None
                raise UnsupportedVersion(
                    f"readiness version {version!r} (this client speaks {READINESS_VERSION})"
                )
            ends = info.get("groups")
            if (
                not isinstance(ends, list)
                or not 0 < len(ends) <= MAX_READY_GROUPS
                or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends)
                or any(a >= b for a, b in itertools.pairwise(ends))
                or ends[0] <= 0
                or ends[-1] != tensors
            ):
                raise ProtocolError(f"readiness groups {str(ends)[:80]} do not cover {tensors} tensors")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, ends, model_id)

    @property
    def groups_ready(self) -> int:
        return len(self.ends) if self.done else self._ready

    def group_of(self, index: int) -> int:
        """The group holding manifest tensor ``index``."""
        return bisect.bisect_right(self.ends, index)

    def ready(self, index: int) -> bool:
        """Whether tensor ``index``'s bytes are in, without blocking (raises LoadError on failure)."""
        if self.done:
            return True
        with self._lock:
            self._read(block=False)
            return self._ready > self.group_of(index)

    def wait(self, index: int, timeout: float | None = None) -> None:
        """Block until tensor ``index``'s bytes are in; LoadError on failure, TimeoutError."""
        if self.done:
            return
        need = self.group_of(index) + 1
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._ready < need:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self.model_id}: tensor {index} not loaded within {timeout} s")
                self._read(block=True, timeout=left)

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every group is in."""
        if self.ends:
            self.wait(self.ends[-1] - 1, timeout)

    def close(self) -> None:
        """Stop reading (the load goes on in the daemon)."""
        with self._lock:
            self._close_fd()

    def _read(self, block: bool, timeout: float | None = None) -> None:
        if self._error is not None:
            raise LoadError(self._error)
        if self._fd is None:
            raise LoadError(f"loading {self.model_id}: readiness was closed before the load ended")
        if not block or timeout is not None:
            ready, _, _ = select.select([self._fd], [], [], 0.0 if not block else timeout)
            if not ready:
                return
        data = os.read(self._fd, MAX_READY_GROUPS)
        if data.strip(READY):
            self._fail(f"loading {self.model_id}: the pool reported a failed load")
        self._ready += len(data)
        if self._ready >= len(self.ends):
            self._ready = len(self.ends)
            self.finished = time.perf_counter()
            self._close_fd()
            self.done = True
        elif not data:
            self._fail(f"loading {self.model_id}: the pool closed readiness before the load ended")

    def _fail(self, message: str) -> None:
        self._error = message
        self._close_fd()
        raise LoadError(message)

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
