"""Resource limits and capabilities of a worker process, set by the worker itself at start.

A worker runs handler code with the uid of ``ember serve`` (often root). Before anything else
(one thread, no handler code yet) it applies :class:`WorkerLimits`:

* ``RLIMIT_CORE`` 0: a crashing worker leaves no core file holding weights, prompts or keys;
* ``RLIMIT_NOFILE`` (``EMBER_WORKER_MAX_OPEN_FILES``, default 4096): a handler leaking
  descriptors exhausts its own table, not the uid's;
* ``RLIMIT_DATA`` (``EMBER_WORKER_MAX_DATA``, a size or ``unlimited``, the default): a ceiling on
  the worker's private writable memory (heap, anonymous maps, thread stacks; *not* the pool's
  shared arena or file-backed weights). ``RLIMIT_AS`` is not used: it counts address space, and
  torch and CUDA reserve far more than they touch. Beyond the ceiling allocations fail
  (``MemoryError`` in Python) instead of the kernel's OOM killer picking a process;
* capabilities (``EMBER_WORKER_DROP_CAPS``, on by default): every capability is dropped from
  the effective, permitted, inheritable, ambient and (with ``CAP_SETPCAP``, i.e. as root)
  bounding sets, and ``no_new_privs`` is set, so nothing the worker executes regains any.
  A worker of a root ``ember serve`` stays uid 0 (its Python may live in a 0700 ``/root``),
  so files owned by root stay accessible as their mode bits allow, but it can no longer
  override permissions (``CAP_DAC_OVERRIDE``: other users' files, mode-0000 files), ptrace or
  read the memory of processes with more capabilities (the pool, ``ember serve``), signal other
  uids' processes (``CAP_KILL``), mount, load modules, change uid, or raise its limits again.

``RLIMIT_NPROC`` is not set: it counts every process of the uid (for root: the whole
machine's), not the worker's. Without ``CAP_SYS_NICE`` a worker cannot leave ``SCHED_IDLE``
(where it pre-warms) by itself: the agent moves it back to ``SCHED_OTHER`` when it assigns it
(a standby: when it is ready).
"""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

OPEN_FILES_ENV = "EMBER_WORKER_MAX_OPEN_FILES"
DATA_ENV = "EMBER_WORKER_MAX_DATA"
CAPS_ENV = "EMBER_WORKER_DROP_CAPS"
DEFAULT_OPEN_FILES, MIN_OPEN_FILES, MAX_OPEN_FILES = 4096, 64, 1 << 20
MIN_DATA_BYTES = 512 << 20  # torch alone maps ~200 MiB of private writable memory at import

# Linux UAPI (linux/capability.h, linux/prctl.h).
_CAP_VERSION_3 = 0x20080522
_CAP_SETPCAP = 8
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_PR_SET_NO_NEW_PRIVS = 38


class LimitsError(RuntimeError):
    """A limit or the capability drop could not be applied (the worker refuses to start)."""

    code = "worker_limits_failed"


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What a worker limits itself to (see module docstring); ``max_data_bytes`` None: no ceiling."""

    max_open_files: int = DEFAULT_OPEN_FILES
    max_data_bytes: int | None = None
    drop_capabilities: bool = True

    def __post_init__(self) -> None:
        n = self.max_open_files
        if isinstance(n, bool) or not isinstance(n, int) or not MIN_OPEN_FILES <= n <= MAX_OPEN_FILES:
            raise ValueError(f"{OPEN_FILES_ENV} must be an integer in [{MIN_OPEN_FILES}, {MAX_OPEN_FILES}]")
        data = self.max_data_bytes
        bad_type = isinstance(data, bool) or not isinstance(data, int)
        if data is not None and (bad_type or data < MIN_DATA_BYTES):
            raise ValueError(f"{DATA_ENV} must be 'unlimited' or at least {MIN_DATA_BYTES >> 20} MiB")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerLimits:
        """``EMBER_WORKER_MAX_OPEN_FILES`` (integer), ``EMBER_WORKER_MAX_DATA`` (``8GiB``,
        ``unlimited``), ``EMBER_WORKER_DROP_CAPS`` (on/off); bad values raise ``ValueError``."""
        from gpu_pool.config import parse_quota

        env = os.environ if env is None else env
        raw_files = env.get(OPEN_FILES_ENV, "").strip() or str(DEFAULT_OPEN_FILES)
        try:
            files = int(raw_files)
        except ValueError:
            raise ValueError(f"{OPEN_FILES_ENV}={raw_files!r} is not an integer") from None
        data = parse_quota(env.get(DATA_ENV, "").strip() or "unlimited", DATA_ENV)
        caps = env.get(CAPS_ENV, "").strip().lower() or "on"
        if caps not in ("on", "off"):
            raise ValueError(f"{CAPS_ENV}={caps!r}: expected one of on, off")
        return cls(files, data, caps == "on")

    def args(self) -> list[str]:
        """The worker's command-line flags for these limits (``python -m runtime``)."""
        data = "unlimited" if self.max_data_bytes is None else str(self.max_data_bytes)
        flags = ["--max-open-files", str(self.max_open_files), "--max-data", data]
        return flags if self.drop_capabilities else [*flags, "--keep-capabilities"]


@dataclass(frozen=True, slots=True)
class LimitsReport:
    """What :func:`apply_limits` set (for the worker's log)."""

    open_files: int
    data_bytes: int | None
    capabilities_dropped: bool
    bounding_set_dropped: bool  # False without CAP_SETPCAP (a non-root serve: no_new_privs covers execs)


def apply_limits(limits: WorkerLimits) -> LimitsReport:
    """Apply ``limits`` to this process; call while it has one thread (capabilities are
    per-thread) and before any handler code. Irreversible once capabilities are dropped."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise LimitsError(f"limits must be applied before any thread starts ({threads} running)")
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        open_files = _lower(resource.RLIMIT_NOFILE, limits.max_open_files)
        data = None
        if limits.max_data_bytes is not None:
            data = _lower(resource.RLIMIT_DATA, limits.max_data_bytes)
    except (OSError, ValueError) as exc:
        raise LimitsError(f"setrlimit: {exc}") from exc
    bounding = drop_capabilities() if limits.drop_capabilities else False
    return LimitsReport(open_files, data, limits.drop_capabilities, bounding)


def _lower(which: int, value: int) -> int:
    """Set soft and hard limit to ``value``, or to the current hard limit if that is lower."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))
    return value


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def drop_capabilities() -> bool:
    """Drop every capability of this thread (see module docstring) and set ``no_new_privs``;
    returns whether the bounding set was emptied too (it needs ``CAP_SETPCAP``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    bounding = _has_capability(_CAP_SETPCAP)
    if bounding:  # before capset: dropping from the bounding set needs CAP_SETPCAP
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise LimitsError(f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(ctypes.get_errno())}")
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        raise LimitsError(f"prctl(PR_CAP_AMBIENT_CLEAR_ALL): {os.strerror(ctypes.get_errno())}")
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()  # all zero: no capability
    if libc.capset(ctypes.byref(header), data) != 0:
        raise LimitsError(f"capset: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise LimitsError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    return bounding


def _has_capability(cap: int) -> bool:
    """Whether ``cap`` is in this thread's effective set (``/proc/thread-self/status``)."""
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False
