"""Per-session KV memory: the pages of a session's KV blocks, private to that session.

KV block *accounting* stays in the arena's region list (Tangram §3.3): a block is a region of
the arena, placed by the planner like before, and its ``offset`` is unchanged. On a CPU pool
the block's *pages* live elsewhere: in a sparse memfd of the arena's size that the daemon
creates for the session (at its first ``kv_map`` or ``kv_alloc``) and sends to that session
only (``SCM_RIGHTS``). The client maps it read-write and builds its KV tensors at the same
offsets. Another session's worker never has the descriptor, so it can neither read nor write
those blocks; the arena's own bytes under a KV region are never written.

Only written pages use memory. When blocks are freed (``kv_free``, ``release``) the daemon
punches their ranges out (``fallocate(PUNCH_HOLE)``), so the memory goes back at once and a
later block at the same offset starts as zeros; closing the session punches the whole file.
Cost: the arena's own pages under a KV region stay allocated (a sealed arena cannot be
punched), so on a CPU pool KV bytes in use count twice, once in the (pre-faulted) arena and
once in the session's file. The file is sealed against resizing; a session can still dirty
pages outside its blocks (up to the arena's size): bound a worker's memory with its cgroup,
not with the KV quota.
"""

from __future__ import annotations

import ctypes
import fcntl
import os

from gpu_pool.errors import PoolError

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_KV_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _Libc:
    """libc's ``fallocate`` (Python's os module only offers ``posix_fallocate``)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols include libc's
        self.fallocate = libc.fallocate
        self.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        self.fallocate.restype = ctypes.c_int


class SessionKV:
    """One session's KV memfd of ``size`` bytes (sparse)."""

    def __init__(self, session_id: str, size: int) -> None:
        self.size = size
        self._libc = _Libc()
        self.fd = os.memfd_create(f"ember-kv-{session_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _KV_SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        self._closed = False

    def punch(self, offset: int, nbytes: int) -> None:
        """Drop the pages of ``[offset, offset + nbytes)``: reads give zeros, memory is freed."""
        if nbytes <= 0:
            return
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) leaves the KV file of {self.size} bytes")
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(self.fd, mode, offset, nbytes) != 0:
            err = ctypes.get_errno()
            raise PoolError(f"punching KV range [{offset}, {offset + nbytes}) failed: {os.strerror(err)}")

    def close(self) -> None:
        """Free every page and the descriptor (a client mapping left behind reads zeros)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.punch(0, self.size)
        finally:
            os.close(self.fd)
