"""Pool daemon configuration: a frozen dataclass filled from CLI flags and ``EMBER_POOL_*``.

Sizes accept suffixes (``512MiB``, ``4GiB``, ``1.5GB``, plain bytes). Every bad value fails
loudly with the name of the setting. ``store_roots`` (``--store DIR``, repeatable, or
``EMBER_POOL_STORE=DIR[:DIR...]``) are the model store directories the daemon trusts: it loads
tensor bytes only from store entries under them (see :mod:`gpu_pool.store.trust`).
``admin_token`` (``--admin-token-file`` / ``EMBER_POOL_ADMIN_TOKEN``) and ``session_kv_quota``
(``--session-kv-quota`` / ``EMBER_POOL_SESSION_KV_QUOTA``: a size or ``unlimited``) configure
admin sessions and KV quotas (see :mod:`gpu_pool.server.access`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from gpu_pool.errors import ConfigError
from gpu_pool.planner.allocator import PackingPolicy
from gpu_pool.planner.eviction import EvictionPolicy
from gpu_pool.planner.importance import ImportancePolicy
from gpu_pool.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text`` such as ``4GiB``; raises :class:`ConfigError` naming ``what``."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}: cannot parse {text!r} as a size (examples: 4GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_quota(text: str, what: str) -> int | None:
    """A KV quota: a size, or ``unlimited`` (None)."""
    if text.strip().lower() == "unlimited":
        return None
    return parse_size(text, what)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Everything one pool daemon needs."""

    device: str
    arena_bytes: int
    socket_path: str
    prefault: bool = True
    eviction: EvictionPolicy = EvictionPolicy.MCE
    packing: PackingPolicy = PackingPolicy.PGP
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    load_threads: int = 2
    # CPU only: store bytes the page cache does not hold are read by O_DIRECT, off the cores
    # that compute (gpu_pool.arena.direct_read); False: every read buffered.
    direct_reads: bool = True
    host_cache_bytes: int = 1 << 30  # CUDA only: pinned host cache budget
    # Trusted model store roots (absolute). Empty: the daemon serves KV blocks and stats but
    # refuses every acquire that names a tensor, since it has nowhere trusted to load from.
    store_roots: tuple[str, ...] = ()
    # A hello presenting it makes an admin session (evict, grant). None: no admin sessions.
    admin_token: str | None = field(default=None, repr=False)
    # KV bytes a session without a ticket may hold: an int, None (unlimited) or "auto"
    # (unlimited without an admin token, since nobody could grant more; 0 with one).
    session_kv_quota: int | Literal["auto"] | None = "auto"
    max_tickets: int = 4096  # outstanding (granted, unused) tickets
    # Published prefix KV (gpu_pool.server.prefix_kv) kept at most; None: a quarter of the arena.
    prefix_bytes: int | None = None
    # MCE's p_m from a model-importance policy (mCache's IAM or a baseline); None: Poisson rate.
    importance: ImportancePolicy | None = None

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ConfigError(f"device: expected 'cpu' or 'cuda:N', got {self.device!r}")
        if self.arena_bytes < 1 << 20:
            raise ConfigError(f"arena: must be at least 1 MiB, got {self.arena_bytes} bytes")
        if not self.socket_path:
            raise ConfigError("socket: a Unix socket path is required")
        if self.max_message_bytes < 1 << 10:
            raise ConfigError("max_message_bytes must be at least 1 KiB")
        if self.load_threads < 1:
            raise ConfigError("load_threads must be >= 1")
        if self.host_cache_bytes < 0:
            raise ConfigError("host_cache_bytes must be >= 0")
        object.__setattr__(self, "store_roots", _store_roots(self.store_roots))
        if self.admin_token is not None and (
            not isinstance(self.admin_token, str) or not 16 <= len(self.admin_token) <= 256
        ):
            raise ConfigError("admin token: expected 16 to 256 characters")
        quota = self.session_kv_quota
        if quota != "auto" and quota is not None and (not isinstance(quota, int) or quota < 0):
            raise ConfigError(f"session_kv_quota: expected bytes >= 0, 'unlimited' or 'auto', got {quota!r}")
        if self.max_tickets < 1:
            raise ConfigError("max_tickets must be >= 1")
        if self.prefix_bytes is not None and (
            not isinstance(self.prefix_bytes, int) or self.prefix_bytes < 0
        ):
            raise ConfigError(f"prefix_bytes: expected bytes >= 0, got {self.prefix_bytes!r}")

    @property
    def default_session_kv_quota(self) -> int | None:
        """KV bytes of a session without a ticket (None: unlimited)."""
        if self.session_kv_quota == "auto":
            return None if self.admin_token is None else 0
        return self.session_kv_quota

    @property
    def aligned_arena_bytes(self) -> int:
        """Arena size rounded down to 2 MiB (huge-page and CUDA-granularity friendly), or to a
        page under 2 MiB (a multiple of every placement alignment)."""
        return self.arena_bytes // (2 << 20) * (2 << 20) or self.arena_bytes // 4096 * 4096

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> PoolConfig:
        """Build from ``EMBER_POOL_*`` variables, then explicit (non-None) overrides."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if "EMBER_POOL_DEVICE" in env:
            values["device"] = env["EMBER_POOL_DEVICE"]
        if "EMBER_POOL_ARENA" in env:
            values["arena_bytes"] = parse_size(env["EMBER_POOL_ARENA"], "EMBER_POOL_ARENA")
        if "EMBER_POOL_SOCKET" in env:
            values["socket_path"] = env["EMBER_POOL_SOCKET"]
        if "EMBER_POOL_PREFAULT" in env:
            values["prefault"] = _parse_bool(env["EMBER_POOL_PREFAULT"], "EMBER_POOL_PREFAULT")
        if "EMBER_POOL_EVICTION" in env:
            values["eviction"] = _parse_enum(
                EvictionPolicy, env["EMBER_POOL_EVICTION"], "EMBER_POOL_EVICTION"
            )
        if "EMBER_POOL_PACKING" in env:
            values["packing"] = _parse_enum(PackingPolicy, env["EMBER_POOL_PACKING"], "EMBER_POOL_PACKING")
        if "EMBER_POOL_LOAD_THREADS" in env:
            values["load_threads"] = _parse_int(env["EMBER_POOL_LOAD_THREADS"], "EMBER_POOL_LOAD_THREADS")
        if "EMBER_POOL_DIRECT_READS" in env:
            values["direct_reads"] = _parse_bool(env["EMBER_POOL_DIRECT_READS"], "EMBER_POOL_DIRECT_READS")
        if "EMBER_POOL_HOST_CACHE" in env:
            values["host_cache_bytes"] = parse_size(env["EMBER_POOL_HOST_CACHE"], "EMBER_POOL_HOST_CACHE")
        if "EMBER_POOL_STORE" in env:
            values["store_roots"] = _parse_paths(env["EMBER_POOL_STORE"], "EMBER_POOL_STORE")
        if "EMBER_POOL_ADMIN_TOKEN" in env:
            values["admin_token"] = env["EMBER_POOL_ADMIN_TOKEN"]
        if "EMBER_POOL_SESSION_KV_QUOTA" in env:
            values["session_kv_quota"] = parse_quota(
                env["EMBER_POOL_SESSION_KV_QUOTA"], "EMBER_POOL_SESSION_KV_QUOTA"
            )
        if "EMBER_POOL_IMPORTANCE" in env:
            values["importance"] = _parse_enum(
                ImportancePolicy, env["EMBER_POOL_IMPORTANCE"], "EMBER_POOL_IMPORTANCE"
            )
        if "EMBER_POOL_PREFIX_BYTES" in env:
            values["prefix_bytes"] = parse_size(env["EMBER_POOL_PREFIX_BYTES"], "EMBER_POOL_PREFIX_BYTES")
        values.update({k: v for k, v in overrides.items() if v is not None})
        quota = values.get("session_kv_quota")
        if isinstance(quota, str) and quota != "auto":  # from a flag: parse like the variable
            values["session_kv_quota"] = parse_quota(quota, "--session-kv-quota")
        for required in ("device", "arena_bytes", "socket_path"):
            if required not in values:
                flag = {"device": "--device", "arena_bytes": "--arena", "socket_path": "--socket"}[required]
                env_name = {"device": "DEVICE", "arena_bytes": "ARENA", "socket_path": "SOCKET"}[required]
                raise ConfigError(f"{flag} (or EMBER_POOL_{env_name}) is required")
        try:
            return cls(**values)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(str(exc)) from None


def _store_roots(roots: object) -> tuple[str, ...]:
    """``roots`` as absolute paths of existing directories, duplicates dropped, order kept."""
    # A bare string would otherwise be taken apart into one-character "roots".
    if isinstance(roots, (str, bytes)) or not isinstance(roots, (tuple, list)):
        raise ConfigError(f"store_roots: expected a tuple of directories, got {roots!r}")
    out: dict[str, None] = {}
    for root in roots:
        if not isinstance(root, str) or not root:
            raise ConfigError(f"store root {root!r}: expected a non-empty path (--store / EMBER_POOL_STORE)")
        path = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(path):
            what = "does not exist" if not os.path.exists(path) else "is not a directory"
            raise ConfigError(
                f"store root {root!r} {what}: --store / EMBER_POOL_STORE must name existing model "
                "store directories"
            )
        out[path] = None
    return tuple(out)


def _parse_paths(text: str, what: str) -> tuple[str, ...]:
    parts = tuple(text.split(os.pathsep))
    if any(not p for p in parts):
        raise ConfigError(
            f"{what}: expected directories separated by {os.pathsep!r}, got {text!r} (an empty entry)"
        )
    return parts


def _parse_bool(text: str, what: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected true/false, got {text!r}")


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}: expected an integer, got {text!r}") from None


_E = TypeVar("_E", EvictionPolicy, PackingPolicy, ImportancePolicy)


def _parse_enum(kind: type[_E], text: str, what: str) -> _E:
    try:
        return kind(text.strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ConfigError(f"{what}: expected one of {choices}, got {text!r}") from None
