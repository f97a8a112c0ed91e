"""Secrets given to ``ember serve`` by environment variable, hidden from other processes once read.

``/proc/<pid>/environ`` shows a process's *initial* environment (the block the kernel copied
onto its stack at ``execve``), whatever ``os.environ`` says later. Handler code runs with the
uid of ``ember serve`` (root, often), and its Landlock sandbox confines file reads below
``EMBER_HOME`` only: it could read ``EMBER_API_KEY`` (the admin key) from the gateway's
``environ``, and from the pool daemon's (which inherited it). So once :class:`ServeConfig`
has read them, :func:`hide` removes these variables from ``os.environ`` (children do not
inherit them) and overwrites their values in that initial block with ``*``. Making the
process undumpable would not be enough: it does not stop root, nor a process in the same
user namespace with ``CAP_SYS_PTRACE``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

SECRETS = ("EMBER_API_KEY", "EMBER_REDIS_PASSWORD", "EMBER_REDIS_URL")  # the URL may carry a password
_ENV_START_FIELD = 50  # /proc/self/stat fields (1-based, proc(5)): env_start, then env_end


def hide(names: Iterable[str] = SECRETS) -> int:
    """Drop ``names`` from ``os.environ`` and blank their values in ``/proc/self/environ``;
    how many values were blanked there. Linux only (elsewhere: only ``os.environ``)."""
    wanted = [name.encode() + b"=" for name in names]
    for name in names:
        os.environ.pop(name, None)
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return 0
    start = int(fields[_ENV_START_FIELD - 3])  # fields[0] is field 3 (state)
    end = int(fields[_ENV_START_FIELD - 2])
    if end - start < len(block):
        return 0  # not the layout proc(5) describes: leave it alone rather than write blindly
    blanked, offset = 0, 0
    for entry in block.split(b"\0"):
        prefix = next((p for p in wanted if entry.startswith(p)), None)
        if prefix is not None and len(entry) > len(prefix):
            size = len(entry) - len(prefix)
            ctypes.memset(start + offset + len(prefix), ord("*"), size)  # the kernel's copy: writable stack
            blanked += 1
        offset += len(entry) + 1
    return blanked
