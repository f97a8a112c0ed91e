"""Process hardening of the pool daemon."""

from __future__ import annotations

import ctypes
import os

from gpu_pool.errors import ConfigError


def make_undumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: processes of the same uid can no longer open
    ``/proc/<pool>/fd/*`` (the arena's writable path before sealing, every session's KV file),
    ``/proc/<pool>/mem`` or ``/proc/<pool>/environ``, nor ptrace it; no core dumps either.
    This does not stop root (CAP_SYS_PTRACE): isolation from root is not a goal."""
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols include libc's
    pr_set_dumpable = 4
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise ConfigError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")
