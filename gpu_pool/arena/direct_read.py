"""Store reads that bypass the page cache for bytes it does not hold (``O_DIRECT``).

Why: a buffered read of a file that is not cached costs the CPU twice, once to fill
page-cache pages and once to copy them into the arena. Measured on this kind of VM (one
1.24 GB store file, its pages dropped): 0.50-0.56 CPU-seconds buffered against 0.07-0.08 read
directly, where the disk's DMA writes into the arena's pages. With 2 cores, that CPU time is
taken from the prefill that overlaps the load (TIDAL §5, :mod:`gpu_pool.server.progressive`):
a direct read is the CPU's counterpart of a GPU's copy engine.

Bytes the page cache holds are still copied from it (memory is faster than the disk, and a
direct read would ignore them): every piece asks ``cachestat(2)`` (Linux 6.5+; it has no side
effects, unlike an ``RWF_NOWAIT`` probe, which starts readahead) whether all its pages are
cached. Direct I/O needs the file offset, the length and the memory address aligned to the
device's logical block (:data:`DIRECT_ALIGN`): registration starts a store's data on a 4 KiB
boundary and the pool places tensors on 512-byte boundaries
(:data:`gpu_pool.planner.regions.DEFAULT_ALIGNMENT`), so a tensor's bytes qualify whenever the
sizes before it keep the file aligned. Unaligned heads and tails, jobs whose file and arena
offsets disagree modulo the block, kernels without ``cachestat`` and file systems without
``O_DIRECT`` (tmpfs) read buffered, as before. So do files on overlayfs (a container's root
file system): their page cache belongs to the file underneath, where ``cachestat`` on the
overlay's descriptor does not look, so every cached byte would be read again from the disk.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading

from gpu_pool.arena.base import CopyJob, read_exactly
from gpu_pool.errors import LoadError

DIRECT_ALIGN = 512  # bytes: the logical block of common disks (a 4Kn disk answers EINVAL: buffered)
PIECE_BYTES = 8 << 20  # bytes asked of cachestat at a time: a partly cached file mixes both reads
SYS_CACHESTAT = 451  # x86_64 and aarch64 (the generic table) alike
OVERLAYFS_SUPER_MAGIC = 0x794C7630  # statfs(2) f_type of overlayfs


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


class StoreFile:
    """One store file open for a load: a buffered descriptor and, where the file system
    allows, a direct one on the same open file (``/proc/self/fd``: never another file that
    replaced it under the same name)."""

    def __init__(self, path: str, direct: bool = True) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise LoadError(f"cannot open store file {path}: {exc.strerror}") from None
        self.direct_fd: int | None = None
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):  # a FIFO or device would block the pool
                raise LoadError(f"store file {path} is not a regular file")
            if direct and _fs_type(self.fd) != OVERLAYFS_SUPER_MAGIC:
                try:
                    self.direct_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_DIRECT)
                except OSError:  # EINVAL on tmpfs, no /proc: buffered reads only
                    self.direct_fd = None
        except BaseException:
            os.close(self.fd)
            raise
        self._direct = self.direct_fd is not None  # False once the device refused an alignment
        self._lock = threading.Lock()
        self._libc = ctypes.CDLL(None, use_errno=True)  # a ctypes call releases the GIL
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.bytes_direct = 0

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)

    def read(self, job: CopyJob, dst: memoryview, dst_address: int) -> None:
        """Fill ``dst`` (``job.nbytes`` long, at address ``dst_address``) with the job's bytes,
        directly where they are not cached and the alignment allows; :class:`LoadError` when
        the file is short or unreadable."""
        if not self._direct or (dst_address - job.src) % DIRECT_ALIGN:
            read_exactly(self.fd, job, dst)
            return
        for start in range(0, job.nbytes, PIECE_BYTES):
            n = min(PIECE_BYTES, job.nbytes - start)
            piece = CopyJob(job.file, job.src + start, job.dst + start, n)
            self._read_piece(piece, dst[start : start + n])

    def _read_piece(self, job: CopyJob, dst: memoryview) -> None:
        direct_fd = self.direct_fd
        if direct_fd is None or not self._direct or self._all_cached(job.src, job.nbytes):
            read_exactly(self.fd, job, dst)
            return
        # [head, tail) is the aligned interior, relative to the piece.
        head = -job.src % DIRECT_ALIGN
        tail = head + max(0, job.nbytes - head) // DIRECT_ALIGN * DIRECT_ALIGN
        if tail <= head:
            read_exactly(self.fd, job, dst)
            return
        if head:
            read_exactly(self.fd, CopyJob(job.file, job.src, job.dst, head), dst[:head])
        done = head
        while done < tail:
            try:
                n = os.preadv(direct_fd, [dst[done:tail]], job.src + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise LoadError(
                        f"reading store file {job.file} at byte {job.src + done} failed: {exc.strerror}"
                    ) from exc
                self._direct = False  # the device wants a larger block: buffered from now on
                break
            done += n
            if n == 0 or n % DIRECT_ALIGN:  # the file ends (the buffered read below says so)
                break
        with self._lock:
            self.bytes_direct += done - head
        if done < job.nbytes:
            rest = CopyJob(job.file, job.src + done, job.dst + done, job.nbytes - done)
            read_exactly(self.fd, rest, dst[done:])

    def _all_cached(self, offset: int, nbytes: int) -> bool:
        """Whether the page cache holds every page of the range (True where the kernel cannot
        tell: the buffered read that follows is what the pool always did)."""
        page = self._page
        first = offset // page * page
        span = _CachestatRange(first, offset + nbytes - first)
        result = _Cachestat()
        rc = self._libc.syscall(
            ctypes.c_long(SYS_CACHESTAT),
            ctypes.c_int(self.fd),
            ctypes.byref(span),
            ctypes.byref(result),
            ctypes.c_uint(0),
        )
        # ENOSYS before Linux 6.5 (or under seccomp); EPERM on newer kernels for a file the
        # daemon neither owns nor may write (cachestat would otherwise reveal other users' reads).
        if rc != 0:
            return True
        return bool(result.nr_cache * page >= span.len)


def _fs_type(fd: int) -> int | None:
    """``statfs(2)``'s ``f_type`` of the file system holding ``fd`` (None when unknown)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if ctypes.CDLL(None, use_errno=True).fstatfs(ctypes.c_int(fd), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value  # the first field, a long on 64-bit Linux
