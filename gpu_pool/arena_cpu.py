"""CPU arena: one shared-memory file mapped by the pool daemon and by every client.

The daemon creates ``ember-pool-<pid>-<token>`` in a shared-memory directory (``/dev/shm``
by default), maps it ``MAP_SHARED`` and optionally pre-faults it (like ``cudaMalloc``,
the pool owns its memory from the start, so loads pay no first-touch faults). Clients map
the same file with ``torch.UntypedStorage.from_file(..., shared=True)``: zero copy, and the
mapping survives the client's exit because the daemon keeps the file. Loads read store
files with ``os.preadv`` straight into the mapping (the kernel copies from the page cache;
measured faster here than faulting in an mmap of the store), groups in parallel threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from gpu_pool.arena import BaseArena, CopyJob, read_exactly
from gpu_pool.errors import LoadError

_NAME = re.compile(r"^ember-pool-(\d+)-[0-9a-f]+$")


class CpuArena(BaseArena):
    """A shared-memory file of ``capacity`` bytes in ``shm_dir``."""

    def __init__(self, capacity: int, shm_dir: str = "/dev/shm", prefault: bool = True, num_threads: int = 2):
        if capacity <= 0:
            raise ValueError("arena capacity must be > 0")
        if num_threads <= 0:
            raise ValueError("num_threads must be > 0")
        directory = Path(shm_dir)
        if not directory.is_dir():
            raise ValueError(f"shared-memory directory {shm_dir} does not exist")
        remove_stale_arenas(directory)
        self.device = "cpu"
        self.capacity = capacity
        self.path = str(directory / f"ember-pool-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(fd, capacity, flags=flags)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self._base = self._array.ctypes.data
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="ember-load")
        self._closed = False

    def handle(self) -> dict[str, Any]:
        return {"kind": "shm", "path": self.path, "size": self.capacity}

    def move(self, dst: int, src: int, nbytes: int) -> None:
        self._check_range(src, nbytes)
        self._check_range(dst, nbytes)
        # memmove is overlap-safe; ctypes drops the GIL for the call.
        ctypes.memmove(self._base + dst, self._base + src, nbytes)

    def load(self, groups: Sequence[Sequence[CopyJob]]) -> None:
        for group in groups:
            for job in group:
                self._check_range(job.dst, job.nbytes)
        fds: dict[str, int] = {}
        try:
            for group in groups:
                for job in group:
                    if job.file not in fds:
                        try:
                            fd = os.open(job.file, os.O_RDONLY | os.O_NONBLOCK)
                        except OSError as exc:
                            raise LoadError(f"cannot open store file {job.file}: {exc.strerror}") from None
                        fds[job.file] = fd
                        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device would block the pool
                            raise LoadError(f"store file {job.file} is not a regular file")
            futures = [self._pool.submit(self._run_group, group, fds) for group in groups]
            # Wait for every group before the descriptors close, then raise the first failure.
            wait(futures)
            for f in futures:
                f.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run_group(self, group: Sequence[CopyJob], fds: dict[str, int]) -> None:
        view = memoryview(self._mmap)
        try:
            for job in group:
                read_exactly(fds[job.file], job, view[job.dst : job.dst + job.nbytes])
        finally:
            view.release()

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return self._mmap[offset : offset + nbytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        del self._array
        # BufferError: a view is still exported; the mapping then goes away with the process.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def remove_stale_arenas(directory: Path) -> list[str]:
    """Delete arena files left by pool daemons that died without cleaning up."""
    removed: list[str] = []
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            entry.unlink()
            removed.append(str(entry))
        except OSError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
