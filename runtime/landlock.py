"""The Linux Landlock system calls, as :mod:`runtime.sandbox` uses them (ctypes, no dependency).

A :class:`Ruleset` handles some access rights, gets path rules that allow them beneath
directories, and is enforced on the calling thread (``landlock_restrict_self``; with
``all_threads``, from ABI 8, on every thread of the process). Each enforcement stacks a layer:
layers intersect, so a later one can only take rights away.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path

# Linux UAPI (include/uapi/linux/landlock.h); the syscall numbers are the same on every arch.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
READ_FILE, READ_DIR = 1 << 2, 1 << 3
READS = READ_FILE | READ_DIR
WRITE_FILE, TRUNCATE, REFER = 1 << 1, 1 << 14, 1 << 13  # TRUNCATE from ABI 3, REFER from 2
WRITE_DIR = sum(1 << bit for bit in range(4, 13))  # REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM
SCOPE_SIGNAL, SCOPE_ABI = 1 << 1, 6  # LANDLOCK_SCOPE_SIGNAL, from ABI 6
TSYNC_ABI = 8
_RESTRICT_SELF_TSYNC = 1 << 3  # LANDLOCK_RESTRICT_SELF_TSYNC: every thread of the process, from ABI 8
_PR_SET_NO_NEW_PRIVS = 38


class _RulesetAttr(ctypes.Structure):
    # The kernel accepts a prefix of the struct: 8 bytes (ABI 1: handled_access_fs) or, from
    # ABI 6, all 24 (scoped: what the domain may not reach outside itself).
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the UAPI: 12 bytes
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # the process's own symbols include libc's


def _syscall(libc: ctypes.CDLL, *args: object) -> int:
    result = int(libc.syscall(*args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def abi_version(libc: ctypes.CDLL | None = None) -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    libc = libc or _libc()
    try:
        return _syscall(
            libc,
            ctypes.c_long(_SYS_CREATE_RULESET),
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(_CREATE_RULESET_VERSION),
        )
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise


def write_rights(abi: int) -> int:
    """Every right that writes, creates, removes, renames or truncates, as far as ``abi`` knows them."""
    return WRITE_FILE | WRITE_DIR | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)


class Ruleset:
    """A Landlock ruleset being built; :meth:`restrict_self` enforces it, :meth:`close` frees it.

    ``OSError`` from the kernel propagates (the caller says what it was confining).
    """

    def __init__(self, handled: int, scoped: int = 0) -> None:
        self._libc = _libc()
        attr = _RulesetAttr(handled, 0, scoped)
        size = ctypes.sizeof(attr) if scoped else 8
        self._fd = _syscall(
            self._libc, ctypes.c_long(_SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), 0
        )

    def allow(self, path: Path, access: int, follow: bool) -> int:
        """Allow ``access`` beneath ``path``; 1 if a rule was added, 0 when ``path`` vanished or
        (unless ``follow``) is a symlink.

        Siblings are never followed: a symlink pointing into EMBER_HOME must not open it up, and
        reads through a symlink are checked where it leads anyway.
        """
        flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return 0
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                return 0
            # Directory rights (READ_DIR, MAKE_*, REMOVE_*, REFER): the kernel refuses them
            # (EINVAL) on any other file, which takes only READ_FILE, WRITE_FILE and TRUNCATE.
            if not stat.S_ISDIR(mode):
                access &= READ_FILE | WRITE_FILE | TRUNCATE
            rule = _PathBeneathAttr(access, fd)
            args = (
                ctypes.c_int(self._fd),
                ctypes.c_int(_RULE_PATH_BENEATH),
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            )
            _syscall(self._libc, ctypes.c_long(_SYS_ADD_RULE), *args)
            return 1
        finally:
            os.close(fd)

    def restrict_self(self, all_threads: bool = False) -> None:
        """Enforce the ruleset on this thread (and the threads and processes it starts from now
        on); with ``all_threads`` (ABI 8) on every thread of the process. Irreversible."""
        if self._libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # restrict_self requires it
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        flags = _RESTRICT_SELF_TSYNC if all_threads else 0
        _syscall(
            self._libc, ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(self._fd), ctypes.c_uint32(flags)
        )

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Ruleset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
