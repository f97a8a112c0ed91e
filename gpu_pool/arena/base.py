"""Arena backends: the one contiguous block of device memory a pool owns.

:class:`BaseArena` is what the daemon's executor needs from a device: an attach handle
for clients, an overlap-safe in-arena move, grouped loads from model-store files, and a
read-back for verification. Backends: :mod:`gpu_pool.arena.cpu` (a sealed memfd that
clients map read-only) and :mod:`gpu_pool.arena.cuda` (CuPy memory shared over CUDA IPC).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpu_pool.errors import LoadError


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Copy ``nbytes`` from byte ``src`` of store file ``file`` to arena offset ``dst``."""

    file: str
    src: int
    dst: int
    nbytes: int


class BaseArena(ABC):
    """One device's arena. Offsets are bytes from the arena's start."""

    device: str
    capacity: int
    # Store bytes loaded by direct I/O so far (gpu_pool.arena.direct_read; CPU arenas only).
    bytes_read_direct: int = 0

    @property
    def populated(self) -> bool:
        """Whether every page of the arena is backed (a CPU arena pre-faults in the background
        after the daemon serves: until then loads and that thread compete for the cores)."""
        return True

    # Nominal in-arena copy bandwidth (bytes/s): what the planner prices a move at. Host
    # memcpy here measures ~10 GB/s; a GPU backend overrides it (HBM copies are ~100x that).
    move_bandwidth: float = 10e9

    @abstractmethod
    def handle(self) -> dict[str, Any]:
        """What a client needs to map the arena (sent in the ``hello`` reply, msgpack-safe)."""

    def share_fd(self) -> int | None:
        """A descriptor sent with the ``hello`` reply (``SCM_RIGHTS``) that the client maps
        read-only, or None when the handle alone suffices (CUDA IPC)."""
        return None

    @abstractmethod
    def move(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` inside the arena; the ranges may overlap."""

    @abstractmethod
    def load(self, groups: Sequence[Sequence[CopyJob]]) -> None:
        """Run copy groups from store files into the arena, groups in parallel; returns when done."""

    def copy_from_fd(self, fd: int, fd_offset: int, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` of file ``fd`` at ``fd_offset`` into the arena at ``dst`` (a session's KV
        memory into a published prefix block; only backends with private KV files need it)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV outside the arena")

    def copy_to_fd(self, fd: int, fd_offset: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` of the arena at ``src`` into file ``fd`` at ``fd_offset``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV outside the arena")

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """The arena's bytes ``[offset, offset + nbytes)`` (for verification and tests)."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory (clients that mapped it keep their mapping where the OS allows)."""

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise ValueError(f"range [{offset}, {offset + nbytes}) leaves the arena of {self.capacity} bytes")


def read_exactly(fd: int, job: CopyJob, dst: memoryview) -> None:
    """Fill ``dst`` (``job.nbytes`` long) with the job's bytes of its store file, or raise LoadError.

    preadv may return fewer bytes than asked (signals, requests over 2 GiB), hence the loop.
    """
    done = 0
    while done < job.nbytes:
        try:
            n = os.preadv(fd, [dst[done:]], job.src + done)
        except OSError as exc:
            raise LoadError(
                f"reading store file {job.file} at byte {job.src + done} failed: {exc.strerror}"
            ) from exc
        if n == 0:
            raise LoadError(
                f"store file {job.file} ends before byte {job.src + job.nbytes} "
                f"(truncated or replaced since registration)"
            )
        done += n
