"""The ``ember`` command. Each verb imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    from gpu_pool.cli import add_arguments

    parser = argparse.ArgumentParser(prog="ember", description="Ember: serverless LLM functions.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    pool = verbs.add_parser("pool", help="run a per-device memory pool daemon")
    add_arguments(pool)
    status = verbs.add_parser("status", help="show a pool's capacity, residency and reuse counters")
    status.add_argument("--socket", required=True, help="the pool daemon's socket")
    args = parser.parse_args(argv)

    if args.verb == "pool":
        from gpu_pool.cli import config_from_args
        from gpu_pool.daemon import run
        from gpu_pool.errors import ConfigError

        try:
            config = config_from_args(args)
        except ConfigError as exc:
            print(f"ember pool: {exc}", file=sys.stderr)
            return 2
        return run(config)
    if args.verb == "status":
        from gpu_pool.client import PoolClient

        try:
            with PoolClient(args.socket) as client:
                print(json.dumps(client.stats(), indent=2))
        except ConnectionError as exc:
            print(f"ember status: {exc}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.verb)


if __name__ == "__main__":
    sys.exit(main())
