"""Command-line entry of the pool daemon (``ember pool`` and ``python -m gpu_pool``)."""

from __future__ import annotations

import argparse
import sys

from gpu_pool.config import PoolConfig, parse_size
from gpu_pool.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's flags; each falls back to its ``EMBER_POOL_*`` variable."""
    parser.add_argument("--device", help="cpu or cuda:N (EMBER_POOL_DEVICE)")
    parser.add_argument("--arena", help="arena size, e.g. 4GiB (EMBER_POOL_ARENA)")
    parser.add_argument("--socket", help="Unix socket path to serve on (EMBER_POOL_SOCKET)")
    parser.add_argument("--eviction", choices=["mce", "lru", "random"], help="Stage 1 policy")
    parser.add_argument(
        "--importance",
        choices=["iam", "lru", "lfu", "arc", "srrip"],
        help="MCE's p_m from a model-importance policy: mCache's IAM or a baseline "
        "(EMBER_POOL_IMPORTANCE; default: the Poisson probability of a request within the horizon)",
    )
    parser.add_argument("--packing", choices=["pgp", "global_merge"], help="Stage 2 policy")
    parser.add_argument("--no-prefault", action="store_true", help="do not pre-fault the CPU arena at start")
    parser.add_argument(
        "--store",
        action="append",
        metavar="DIR",
        help="a trusted model store root: tensors load only from store entries under one "
        "(repeatable; EMBER_POOL_STORE, os.pathsep-separated). Without any, acquires are refused",
    )
    parser.add_argument(
        "--admin-token-file",
        metavar="PATH",
        help="file whose first line is the admin token ('-': read it from stdin); a hello with it "
        "opens an admin session (evict, grant). Or EMBER_POOL_ADMIN_TOKEN",
    )
    parser.add_argument(
        "--session-kv-quota",
        metavar="SIZE",
        help="KV bytes a session without a ticket may hold, or 'unlimited' "
        "(EMBER_POOL_SESSION_KV_QUOTA; default: unlimited without an admin token, else 0)",
    )
    parser.add_argument(
        "--prefix-bytes",
        metavar="SIZE",
        help="bound on published prefix KV kept for later instances, 0 to keep none "
        "(EMBER_POOL_PREFIX_BYTES; default: a quarter of the arena)",
    )


def config_from_args(args: argparse.Namespace) -> PoolConfig:
    """Merge flags over the environment."""
    from gpu_pool.planner.allocator import PackingPolicy
    from gpu_pool.planner.eviction import EvictionPolicy
    from gpu_pool.planner.importance import ImportancePolicy

    return PoolConfig.from_env(
        device=args.device,
        arena_bytes=parse_size(args.arena, "--arena") if args.arena else None,
        socket_path=args.socket,
        eviction=EvictionPolicy(args.eviction) if args.eviction else None,
        importance=ImportancePolicy(args.importance) if args.importance else None,
        packing=PackingPolicy(args.packing) if args.packing else None,
        prefault=False if args.no_prefault else None,
        store_roots=tuple(args.store) if args.store else None,
        admin_token=read_admin_token(args.admin_token_file) if args.admin_token_file else None,
        session_kv_quota=args.session_kv_quota,
        prefix_bytes=parse_size(args.prefix_bytes, "--prefix-bytes") if args.prefix_bytes else None,
    )


def read_admin_token(path: str) -> str:
    """The first line of ``path`` (``-``: stdin), stripped; at most 4 KiB are read."""
    try:
        if path == "-":
            line = sys.stdin.readline(4096)
        else:
            with open(path, encoding="utf-8") as f:
                line = f.readline(4096)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--admin-token-file {path}: cannot read it ({exc})") from None
    token = line.strip()
    if not token:
        raise ConfigError(f"--admin-token-file {path}: the first line is empty")
    return token


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the daemon until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="ember pool", description="Run a per-device memory pool daemon.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"ember pool: {exc}", file=sys.stderr)
        return 2
    return run(config)


def run(config: PoolConfig) -> int:
    """Run the daemon with ``config`` until SIGTERM/SIGINT; returns the exit status."""
    from gpu_pool.server.daemon import run as run_daemon

    return run_daemon(config)
