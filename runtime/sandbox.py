"""Landlock confinement of a worker: handler code cannot read what ``ember serve`` keeps in ``EMBER_HOME``.

Workers run function code with the uid of ``ember serve`` (often root, and Python may live in
a 0700 home, so dropping to another uid is not an option). ``EMBER_HOME`` holds
``serve.json`` (the admin API key), the embedded Redis's files (``redis/``), every instance's
logs (``logs/``), ``serve.log`` and the pool sockets. A worker therefore restricts itself with
Linux Landlock (which binds root too) before any handler code can run:

* reads and writes are handled (``READ_FILE``, ``READ_DIR`` and every right that writes,
  creates, removes, renames or truncates); execs and sockets are left to the ordinary
  permission checks, so handlers still reach the pool;
* everything outside ``EMBER_HOME`` stays readable and writable; inside it ``models/``
  (weights, tokenizers) and ``functions/`` (handler modules) are read-only and ``tmp/`` (the
  workers' ``TMPDIR``) read-write: a handler cannot rewrite another function's module, the
  model store's files, ``serve.json`` or the Redis append-only file;
* from Landlock ABI 6, signals only within the worker (its own process and children): handler
  code cannot kill the pool, ``redis-server``, ``ember serve`` or other workers.

Landlock is an allow-list over directory trees, so "all but one subtree" is one rule per
existing sibling of each directory on the way from ``/`` to ``EMBER_HOME``. Consequences (see
the README's security section): those ancestors cannot be listed, entries created *later*
directly inside one of them (say a new ``/tmp/x``) are unreadable to the worker (``TMPDIR``
covers temporary files), a bind mount or hard link exposing ``EMBER_HOME`` elsewhere stays
readable, and ``stat`` (names, sizes) is not hidden, only contents and listings.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_ENV = "EMBER_WORKER_SANDBOX"  # "on" (default) or "off"
REQUIRE_ENV = "EMBER_REQUIRE_SANDBOX"  # "1": a worker without Landlock refuses to start
READABLE = ("models", "functions", "tmp")  # the parts of EMBER_HOME a worker may read
WRITABLE = ("tmp",)  # ... and of those, the ones it may write
MAX_RULES = 4096  # siblings of EMBER_HOME's ancestors (an unbounded /tmp must not stall starts)

# Linux UAPI (include/uapi/linux/landlock.h); the syscall numbers are the same on every arch.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_READ_FILE, _READ_DIR = 1 << 2, 1 << 3
_WRITE_FILE, _TRUNCATE, _REFER = 1 << 1, 1 << 14, 1 << 13  # TRUNCATE from ABI 3, REFER from 2
_WRITE_DIR = sum(1 << bit for bit in range(4, 13))  # REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM
_SCOPE_SIGNAL, _SCOPE_ABI = 1 << 1, 6  # LANDLOCK_SCOPE_SIGNAL, from ABI 6
_PR_SET_NO_NEW_PRIVS = 38


class SandboxError(RuntimeError):
    """The sandbox could not be applied although it was required (or it failed half-way)."""

    code = "sandbox_failed"


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Whether workers confine themselves, and whether a kernel without Landlock is fatal."""

    enabled: bool = True
    required: bool = False

    def __post_init__(self) -> None:
        if self.required and not self.enabled:
            raise ValueError(f"{REQUIRE_ENV}=1 contradicts {SANDBOX_ENV}=off")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SandboxConfig:
        """``EMBER_WORKER_SANDBOX`` (on/off) and ``EMBER_REQUIRE_SANDBOX`` (0/1); other values raise."""
        env = os.environ if env is None else env
        enabled = _choice(env, SANDBOX_ENV, {"on": True, "off": False}, "on")
        required = _choice(env, REQUIRE_ENV, {"1": True, "0": False}, "0")
        return cls(enabled, required)


@dataclass(frozen=True, slots=True)
class SandboxReport:
    """What :func:`apply` did: ``abi`` is the kernel's Landlock ABI (0: none), ``reason`` why not applied."""

    applied: bool
    abi: int
    rules: int = 0
    reason: str | None = None


def _choice(env: Mapping[str, str], name: str, values: dict[str, bool], default: str) -> bool:
    raw = env.get(name, default).strip().lower() or default
    if raw not in values:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(values)}")
    return values[raw]


def temp_dir(home: Path) -> Path:
    """The workers' ``TMPDIR`` (``EMBER_HOME/tmp``, 0700), created if missing."""
    path = Path(os.path.realpath(home)) / "tmp"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _readable_dirs(home: Path) -> list[Path]:
    # Created now if missing (0700, like the rest of EMBER_HOME): a rule needs an existing
    # directory, and a pre-warmed worker starts before the first deploy creates functions/.
    dirs = [Path(os.path.realpath(home)) / name for name in READABLE]
    for path in dirs:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return [Path(os.path.realpath(path)) for path in dirs]  # an operator's symlinked store is followed


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


def _syscall(libc: ctypes.CDLL, *args: object) -> int:
    result = int(libc.syscall(*args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def abi_version(libc: ctypes.CDLL | None = None) -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    libc = libc or ctypes.CDLL(None, use_errno=True)
    try:
        return _syscall(
            libc, ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1)
        )
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise


def readable_roots(home: Path) -> list[Path]:
    """Siblings of ``home``'s ancestors: what a sandboxed worker may read beneath outside ``home``."""
    target = Path(os.path.realpath(home))
    roots: list[Path] = []
    for ancestor in reversed(target.parents):  # "/" first
        on_path = target.parts[len(ancestor.parts)]
        try:
            names = sorted(os.listdir(ancestor))
        except OSError as exc:
            raise SandboxError(f"cannot list {ancestor} to confine the worker: {exc}") from exc
        roots += [ancestor / name for name in names if name != on_path]
        if len(roots) > MAX_RULES:
            raise SandboxError(f"more than {MAX_RULES} entries beside {target}'s ancestors")
    return roots


def apply(home: Path, config: SandboxConfig | None = None) -> SandboxReport:
    """Confine the calling process's reads (see module docstring); irreversible.

    Call it while the process has one thread: Landlock restricts only the calling thread and
    the threads it creates later, so an older thread would stay free. Without Landlock the
    worker logs a warning and runs unconfined, unless ``config.required`` (then it raises).
    """
    config = config or SandboxConfig()
    if not config.enabled:
        return SandboxReport(False, 0, reason=f"{SANDBOX_ENV}=off")
    libc = ctypes.CDLL(None, use_errno=True)
    abi = abi_version(libc)
    if abi == 0:
        reason = "this kernel has no Landlock (or it is disabled)"
        if config.required:
            raise SandboxError(f"{reason}, and {REQUIRE_ENV}=1")
        log.warning("worker runs unconfined: %s; handlers can read EMBER_HOME", reason)
        return SandboxReport(False, 0, reason=reason)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SandboxError(f"the sandbox must be applied before any thread starts ({threads} running)")
    inside, outside = _readable_dirs(home), readable_roots(home)
    writes = _WRITE_FILE | _WRITE_DIR | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    # From ABI 6 also no signals to processes outside the worker's domain: handler code (same
    # uid) must not kill the pool, redis-server, ember serve or another function's worker.
    scoped = _SCOPE_SIGNAL if abi >= _SCOPE_ABI else 0
    attr = _RulesetAttr(_READ_FILE | _READ_DIR | writes, 0, scoped)
    size = ctypes.sizeof(attr) if scoped else 8
    ruleset = _syscall(libc, ctypes.c_long(_SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), 0)
    try:
        rules = sum(
            _add_rule(libc, ruleset, path, follow=True, writes=writes if name in WRITABLE else 0)
            for name, path in zip(READABLE, inside, strict=True)
        )
        rules += sum(_add_rule(libc, ruleset, path, follow=False, writes=writes) for path in outside)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # restrict_self requires it
            raise SandboxError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        _syscall(libc, ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0))
    except OSError as exc:
        raise SandboxError(f"Landlock failed: {exc}") from exc
    finally:
        os.close(ruleset)
    log.info("worker confined by Landlock ABI %d: %d rules, %s unreadable but %s", abi, rules, home, READABLE)
    return SandboxReport(True, abi, rules)


def _add_rule(libc: ctypes.CDLL, ruleset: int, path: Path, follow: bool, writes: int = 0) -> int:
    """Allow reads (and ``writes``) beneath ``path``; 0 when it vanished or (unless ``follow``)
    is a symlink.

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
        if stat.S_ISDIR(mode):
            access = _READ_FILE | _READ_DIR | writes
        else:
            access = _READ_FILE | (writes & (_WRITE_FILE | _TRUNCATE))
        rule = _PathBeneathAttr(access, fd)
        args = (
            ctypes.c_int(ruleset),
            ctypes.c_int(_RULE_PATH_BENEATH),
            ctypes.byref(rule),
            ctypes.c_uint32(0),
        )
        _syscall(libc, ctypes.c_long(_SYS_ADD_RULE), *args)
        return 1
    finally:
        os.close(fd)
