"""CPU arena: one sealed memfd, written only by the pool daemon, mapped read-only by clients.

The daemon creates an anonymous memory file (``memfd_create`` with ``MFD_ALLOW_SEALING``,
so nothing appears under ``/dev/shm`` and no other process can open it by name), maps it
``MAP_SHARED`` read-write *once* and optionally pre-faults it (like ``cudaMalloc``, the pool
owns its memory from the start, so loads pay no first-touch faults). Pre-faulting runs in a
background thread (``MADV_POPULATE_WRITE`` in 16 MiB steps, the GIL released) after the daemon
serves: on a VM, first-touching 1 GiB of fresh guest memory took 2.6-14 s, which a daemon
restart must not wait for. A load that writes pages the thread has not reached yet faults them
itself; populating never changes a page's contents. Then it seals the file
with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL``: the daemon keeps
writing through the mapping it already has, and from then on nobody (root included) can
``write()`` the file, punch holes in it, resize it, or map it writable and shared; the seals
themselves cannot be removed. Clients receive the descriptor over the pool socket
(``SCM_RIGHTS``, see :mod:`gpu_pool.wire.fdpass`) and map it ``PROT_READ``: zero copy, and a
worker that writes into another function's weights dies of SIGSEGV instead of poisoning them.

Loads read store files with ``os.preadv`` straight into the daemon's mapping, groups in
parallel threads: from the page cache where it holds the bytes (measured faster here than
faulting in an mmap of the store), else by direct I/O into the arena's pages
(:mod:`gpu_pool.arena.direct_read`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from gpu_pool.arena.base import BaseArena, CopyJob
from gpu_pool.arena.direct_read import StoreFile
from gpu_pool.arena.madvise import MADV_POPULATE_WRITE, madvise

# Linux 5.1+; Python's fcntl module does not export it (3.11).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
PREFAULT_STEP = 16 << 20  # bytes per madvise call: bounds how long close() waits for the thread


class CpuArena(BaseArena):
    """A sealed memfd of ``capacity`` bytes; only this object's mapping can write it."""

    def __init__(self, capacity: int, prefault: bool = True, num_threads: int = 2, direct_reads: bool = True):
        if capacity <= 0:
            raise ValueError("arena capacity must be > 0")
        if num_threads <= 0:
            raise ValueError("num_threads must be > 0")
        self.device = "cpu"
        self.capacity = capacity
        # Names the arena in handles (a pre-mapped arena is recognised by it); not a secret.
        self.arena_id = secrets.token_hex(16)
        self._fd = os.memfd_create("ember-pool-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, capacity)
            self._mmap = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED)
            # After this, the mapping above is the only writable path to these pages.
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
        except BaseException:
            os.close(self._fd)
            raise
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._base = self._array.ctypes.data
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="ember-load")
        self.direct_reads = direct_reads  # uncached store bytes by O_DIRECT (gpu_pool.arena.direct_read)
        self.bytes_read_direct = 0  # of all loads so far
        self._counter_lock = threading.Lock()  # loads of different acquires may run at once
        self._closed = False
        self._stop_prefault = threading.Event()
        self.prefaulted = threading.Event()  # set once every page is populated (or that stopped)
        self.prefault_error: str | None = None  # why populating stopped early (old kernel), if it did
        self._prefault_thread: threading.Thread | None = None
        if prefault:
            self._prefault_thread = threading.Thread(
                target=self._prefault, name="ember-prefault", daemon=True
            )
            self._prefault_thread.start()
        else:
            self.prefaulted.set()

    def _prefault(self) -> None:
        """Populate the mapping writable, a step at a time (see the module docstring)."""
        try:
            for start in range(0, self.capacity, PREFAULT_STEP):
                if self._stop_prefault.is_set():
                    return
                length = min(PREFAULT_STEP, self.capacity - start)
                refused = madvise(self._base + start, length, MADV_POPULATE_WRITE)  # GIL released
                if refused is not None:
                    self.prefault_error = refused  # EINVAL: kernel < 5.14
                    return
        finally:
            self.prefaulted.set()

    @property
    def populated(self) -> bool:
        return self.prefaulted.is_set()

    def handle(self) -> dict[str, Any]:
        return {"kind": "memfd", "arena_id": self.arena_id, "size": self.capacity}

    def share_fd(self) -> int | None:
        return self._fd

    def move(self, dst: int, src: int, nbytes: int) -> None:
        self._check_range(src, nbytes)
        self._check_range(dst, nbytes)
        # memmove is overlap-safe; ctypes drops the GIL for the call.
        ctypes.memmove(self._base + dst, self._base + src, nbytes)

    def load(self, groups: Sequence[Sequence[CopyJob]]) -> None:
        for group in groups:
            for job in group:
                self._check_range(job.dst, job.nbytes)
        files: dict[str, StoreFile] = {}
        try:
            for group in groups:
                for job in group:
                    if job.file not in files:
                        files[job.file] = StoreFile(job.file, self.direct_reads)
            futures = [self._pool.submit(self._run_group, group, files) for group in groups]
            # Wait for every group before the descriptors close, then raise the first failure.
            wait(futures)
            for f in futures:
                f.result()
        finally:
            for file in files.values():
                with self._counter_lock:
                    self.bytes_read_direct += file.bytes_direct
                file.close()

    def _run_group(self, group: Sequence[CopyJob], files: dict[str, StoreFile]) -> None:
        # Through the daemon's own (pre-seal, writable) mapping: the sealed file refuses writes.
        view = memoryview(self._mmap)
        try:
            for job in group:
                files[job.file].read(job, view[job.dst : job.dst + job.nbytes], self._base + job.dst)
        finally:
            view.release()

    def copy_from_fd(self, fd: int, fd_offset: int, dst: int, nbytes: int) -> None:
        self._check_range(dst, nbytes)
        with memoryview(self._mmap) as view:
            done = 0
            while done < nbytes:  # preadv may return short counts
                n = os.preadv(fd, [view[dst + done : dst + nbytes]], fd_offset + done)
                if n <= 0:
                    raise OSError(f"KV file ends before byte {fd_offset + nbytes}")
                done += n

    def copy_to_fd(self, fd: int, fd_offset: int, src: int, nbytes: int) -> None:
        self._check_range(src, nbytes)
        with memoryview(self._mmap) as view:
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, view[src + done : src + nbytes], fd_offset + done)

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return self._mmap[offset : offset + nbytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_prefault.set()
        if self._prefault_thread is not None:  # it must not touch the mapping once unmapped
            self._prefault_thread.join()
        self._pool.shutdown(wait=True)
        del self._array
        # BufferError: a view is still exported; the mapping then goes away with the process.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        # Clients that mapped the arena keep their pages; the memory goes when the last one unmaps.
        os.close(self._fd)
